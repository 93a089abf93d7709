"""On-policy distillation (rl_core/ppo/distill.py): the per-token advantage by hand, with and without the task
reward, over padded multi-sequence trajectories; the local teacher's logprobs the same padded and packed and
equal to the teacher's own forward pass; and the refusals (another tokenizer, a server that does not answer)."""

import math
import socket

import pytest
import torch

from rl_core.config import ConfigError, load_config
from rl_core.ppo.config import AlgorithmConfig, DistillConfig, KLConfig, ModelConfig, PPOConfig
from rl_core.ppo.distill import RemoteTeacher, TeacherError, check_same_tokenizer, distill_advantages
from rl_core.ppo.models import PPOModels
from rl_core.ppo.step import Experience, Scoring, StepSettings, compute_advantages, forward_passes
from rl_core.ppo.validation import validate
from rl_core.rollout.trajectory import TokenSequence, Trajectory
from workers.worker import BatchWorker


def test_the_per_token_term_by_hand_with_and_without_the_reward():
    student = torch.tensor([[-1.0, -2.0, 0.0]])
    teacher = torch.tensor([[-0.5, -3.0, 0.0]])
    mask = torch.tensor([[True, True, False]])  # the last position is padding
    reward = torch.tensor([[0.4, 0.4, 0.0]])

    kept, stats = distill_advantages(reward, student, teacher, mask, DistillConfig(coef=1.0, reward_coef=1.0))
    assert kept[0].tolist() == pytest.approx([0.4 + 0.5, 0.4 - 1.0, 0.0])
    assert stats["distill/reverse_kl"] == pytest.approx((-0.5 + 1.0) / 2)  # log student - log teacher
    assert stats["distill/teacher_logprob"] == pytest.approx((-0.5 - 3.0) / 2)

    pure, _ = distill_advantages(reward, student, teacher, mask, DistillConfig(coef=2.0, reward_coef=0.0))
    assert pure[0].tolist() == pytest.approx([1.0, -2.0, 0.0])


def sequence(prompt: list[int], actions: list[int], pad: int = 0) -> TokenSequence:
    seq = TokenSequence()
    seq.extend_context([0] * pad + prompt, num_padding=pad)
    seq.extend_action(actions, [-1.0] * len(actions), [0] * len(actions))
    return seq


def test_group_advantages_get_the_teacher_term_on_each_action_token_of_every_sequence():
    # Trajectory 0 has two sequences (a tool turn) and a left-padded first prompt; 1 and 2 are one sequence each.
    # All three in one group: GRPO's advantage from scores 1, 0, 0 is (s - mean) / std, the same on every token.
    trajectories = [Trajectory([sequence([3, 4], [10, 11], pad=1), sequence([5], [12])], {"group_id": 0}),
                    Trajectory([sequence([3, 4, 6], [13, 14, 15])], {"group_id": 0}),
                    Trajectory([sequence([3], [16])], {"group_id": 0})]
    exp = Experience.from_trajectories(trajectories)
    width = exp.batch["input_ids"].shape[1]
    old, teacher = torch.zeros(4, width), torch.zeros(4, width)  # 4 sequences
    acting = exp.batch["action_mask"].bool()
    old[acting] = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.25, -3.0, -0.75])
    teacher[acting] = torch.tensor([-1.5, -1.0, -0.5, -0.5, -2.25, -1.0, -0.25])
    exp.batch.update(old_logprobs=old, ref_logprobs=old.clone(), values=torch.zeros_like(old), teacher_logprobs=teacher)
    algo = AlgorithmConfig(advantage_estimator="grpo", group_size=3, whiten_advantages=False,
                           kl=KLConfig(init_coef=0.0, adaptive=False))
    scores = torch.tensor([1.0, 0.0, 0.0])
    std = math.sqrt(((2 / 3) ** 2 + 2 * (1 / 3) ** 2) / 2)  # torch.std: unbiased
    group = [(1 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6), (0 - 1 / 3) / (std + 1e-6)]

    for reward_coef in (1.0, 0.0):
        targets, stats = compute_advantages(exp, scores, 0.0, algo, DistillConfig(teacher_path="t", coef=0.5,
                                                                             reward_coef=reward_coef))
        expected = torch.zeros(4, width)
        by_traj = [0, 0, 0, 1, 1, 1, 2]  # the action tokens' trajectories, in row order
        expected[acting] = torch.tensor([reward_coef * group[t] for t in by_traj]) + 0.5 * (teacher - old)[acting]
        assert targets["advantages"].flatten().tolist() == pytest.approx(expected.flatten().tolist(), abs=1e-5), \
            reward_coef
        assert targets["advantages"][~acting].abs().sum() == 0  # prompts and padding get nothing
        assert stats["distill/reverse_kl"] == pytest.approx((old - teacher)[acting].mean().item())


@pytest.fixture(scope="module")
def teacher_dir(tiny_model_dir, tmp_path_factory):
    """Another model of the student's tokenizer (another seed): a teacher whose logprobs differ."""
    from transformers import AutoTokenizer

    from offline.assets import init_tiny_gpt2

    out = tmp_path_factory.mktemp("teacher")
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.save_pretrained(out)
    init_tiny_gpt2(tokenizer, n_layer=2, n_embd=32, n_head=2, n_positions=64, seed=7).save_pretrained(out)
    return str(out)


@pytest.mark.parametrize("layout", [None, "rows"])
def test_the_local_teacher_scores_the_actions_as_its_own_forward_pass(process_group, tiny_model_dir, teacher_dir,
                                                                      layout):
    from transformers import AutoModelForCausalLM

    algo = AlgorithmConfig(advantage_estimator="grpo", group_size=2, kl=KLConfig(init_coef=0.0, adaptive=False),
                           packing=layout is not None)
    models = PPOModels(ModelConfig(path=tiny_model_dir), algo, None, pad_token_id=0, total_steps=1,
                       distill=DistillConfig(teacher_path=teacher_dir))
    assert models.teacher is not None and models.reference is None
    trajectories = [Trajectory([sequence([5 + i, 6, 7][: 1 + i % 3], [40 + i, 41, 42, 43][: 2 + i % 3], pad=i % 2)],
                               {"group_id": i // 2}) for i in range(6)]
    exp = Experience.from_trajectories(trajectories)
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=16, layout=layout)
    settings = StepSettings(algo, Scoring(-1.0, None, 0, None, 4, 0, 1.0), temperature=0.7, norm_length=4, seed=0,
                            engine_old_logprobs_max_gap=float("inf"))
    exp = forward_passes(exp, models, worker, settings, old_from_engine=True)

    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    for row, seq in enumerate(exp.sequences):
        ids = seq.real_ids
        with torch.no_grad():  # temperature 1: the teacher's own distribution, as a server reports it
            logprobs = torch.log_softmax(teacher(torch.tensor([ids])).logits[0, :-1], -1)
        own = logprobs.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        real = [t for t, m in enumerate(seq.attention_mask) if m]
        acting = [i for i, t in enumerate(real[1:]) if seq.action_mask[t]]
        got = [exp.batch["teacher_logprobs"][row, real[1:][i]].item() for i in acting]
        assert got == pytest.approx(own[acting].tolist(), abs=1e-5)
        assert exp.batch["teacher_logprobs"][row][~exp.batch["action_mask"][row].bool()].abs().sum() == 0
        assert len(acting) == seq.num_action_tokens


def test_a_teacher_with_another_tokenizer_is_one_line_naming_both(tiny_model_dir, small_job):
    from workers.loading import load_tokenizer

    student_path = next(o.split("=", 1)[1] for o in small_job["overrides"] if o.startswith("model.path="))
    with pytest.raises(TeacherError) as err:
        check_same_tokenizer(load_tokenizer(student_path), load_tokenizer(tiny_model_dir), student_path, tiny_model_dir)
    line = str(err.value)
    assert "\n" not in line and student_path in line and tiny_model_dir in line and "vocabularies" in line
    check_same_tokenizer(load_tokenizer(student_path), load_tokenizer(student_path), student_path, student_path)


def test_a_teacher_server_that_does_not_answer_is_one_line():
    with socket.socket() as sock:  # a loopback port nobody listens on
        sock.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{sock.getsockname()[1]}"
    with pytest.raises(TeacherError) as err:
        RemoteTeacher(url, timeout_s=5).check()
    assert "\n" not in str(err.value) and f"distill.teacher_url={url} does not answer" in str(err.value)


def test_two_teachers_or_a_negative_weight_are_refused_at_parse_time():
    with pytest.raises(ConfigError, match="keep one"):
        load_config("grpo_arithmetic.yaml", ["distill.teacher_path=a", "distill.teacher_url=http://127.0.0.1:1"],
                    PPOConfig, validate)
    with pytest.raises(ConfigError, match="distill.reward_coef"):
        load_config("grpo_arithmetic.yaml", ["distill.teacher_path=a", "distill.reward_coef=-1"], PPOConfig, validate)
