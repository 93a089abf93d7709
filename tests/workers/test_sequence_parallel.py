"""Sequence parallelism (Ulysses) on 2 gloo ranks: one sequence group of 2 (dp 1 x sp 2), FSDP2 over both.

Each rank runs the packed micro-batches on half of their tokens; everything it reports must equal one
process running the same batch without sequence parallelism, in float32 to 1e-5: logprobs, entropies
(the LM head in chunks, split over the group), critic values, reward scores, the loss and every gradient
of a step through the one worker. Families: Qwen3 (q/k norms, grouped-query attention) and Gemma 2 (eager
kernel with soft-capped scores, a sliding window shorter than the sequences, shared prompts).
"""

import os

import pytest
import torch

from tests.ranks import run_ranks
from workers.read_back import read_back

WORLD_SIZE = 2
FAMILIES = {"qwen3": {}, "gemma2": {"sliding_window": 8}}
MAX_TOKENS = 64  # per device: a micro-batch of the group holds 2 x 64 tokens


def _batch():
    """Two GRPO-like groups (a shared prompt, responses of different lengths) and one lone sequence."""
    from workers.layout import rows_to_batch

    generator = torch.Generator().manual_seed(0)
    rows = []
    for prompt_length, responses in ((9, (13, 7, 11)), (6, (10, 15))):
        prompt = torch.randint(3, 290, (prompt_length,), generator=generator).tolist()
        for length in responses:
            response = torch.randint(3, 290, (length,), generator=generator).tolist()
            rows.append({"input_ids": prompt + response, "action_mask": [0] * prompt_length + [1] * length})
    rows.append({"input_ids": torch.randint(3, 290, (21,), generator=generator).tolist(),
                 "action_mask": [0] * 4 + [1] * 17})
    batch = rows_to_batch(rows, pad_token_id=1)
    batch["advantages"] = torch.randn(batch["input_ids"].shape, generator=generator)
    return batch


def _loss(model, micro):
    """A policy-gradient-like loss with an entropy bonus, summed over the actions."""
    from workers.forward import token_logprobs_and_entropy

    logprobs, entropy = token_logprobs_and_entropy(model, micro, temperature=0.9, actions_only=True)
    mask = micro["action_mask"].float()
    return (-(logprobs * micro["advantages"]) - 0.01 * entropy).mul(mask).sum(), {}


def _run(model_dir: str, tokenizer, world_size: int, rank: int, group) -> dict:
    """One step's outputs and gradients, with `group` splitting the tokens (None: one process, no split)."""
    from workers.forward import ForwardSettings, raw_reward_scores, token_logprobs_and_entropy, token_values
    from workers.fsdp import shard_model
    from workers.trainable import TrainableModel
    from workers.loading import ValueModel, init_reward_model, load_causal_lm, prepare_for_run
    from workers.worker import BatchWorker

    class Run:  # the job's `model` keys this test varies
        gradient_checkpointing = False
        sequence_parallel = 1 if group is None else group.size

    sharded = group is not None
    prepare = (lambda m: shard_model(prepare_for_run(m, Run, trained=False))) if sharded else (lambda m: m)
    torch.manual_seed(0)
    policy = prepare(load_causal_lm(model_dir))
    critic = ValueModel.from_pretrained(model_dir)
    torch.nn.init.normal_(critic.head.weight, generator=torch.Generator().manual_seed(3))
    critic = prepare(critic)
    reward_model = prepare(init_reward_model(model_dir, pad_token_id=tokenizer.pad_token_id, seed=0))
    worker = BatchWorker(rank, world_size, torch.device("cpu"), MAX_TOKENS, layout="rows", share_prompts=True,
                         settings=ForwardSettings(logits_chunk=16, sequence=group, unchunked_logits_max_bytes=0))
    batch = _batch()
    outputs = worker.compute_and_share(batch, lambda micro: (
        *token_logprobs_and_entropy(policy, micro, temperature=0.9, actions_only=True),
        token_values(critic, micro), raw_reward_scores(reward_model, micro)))
    trainable = TrainableModel(policy, lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    count = float(batch["action_mask"].sum())
    metrics, _ = worker.forward_backward(trainable, batch, _loss, count)
    metrics = read_back(metrics)
    grads = {}
    for name, parameter in policy.named_parameters():
        grad = parameter.grad
        grads[name] = (grad.full_tensor() if hasattr(grad, "full_tensor") else grad).detach().clone()
    return {"logprobs": outputs[0], "entropy": outputs[1], "values": outputs[2], "rewards": outputs[3],
            "loss": sum(metrics["loss"]), "grads": grads, "micro_batches": len(metrics["loss"])}


def _worker(rank: int, model_dirs: dict, out_dir: str) -> None:
    from workers.loading import load_tokenizer
    from workers.sequence_parallel import SequenceGroup

    group = SequenceGroup.build(WORLD_SIZE, 2, torch.device("cpu"))
    results = {}
    for family, model_dir in model_dirs.items():
        results[family] = _run(model_dir, load_tokenizer(model_dir), WORLD_SIZE, rank, group)
    torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))


@pytest.fixture(scope="module")
def model_dirs(tmp_path_factory, tiny_model_dir):
    from offline.families import save_family_model

    root = tmp_path_factory.mktemp("sp_models")
    return {family: save_family_model(family, tiny_model_dir, root / family, **overrides)
            for family, overrides in FAMILIES.items()}


@pytest.fixture(scope="module")
def split_results(model_dirs, tmp_path_factory):
    out_dir = str(tmp_path_factory.mktemp("sequence_parallel"))
    run_ranks(_worker, WORLD_SIZE, out_dir, args=(model_dirs, out_dir))
    return [torch.load(os.path.join(out_dir, f"rank{rank}.pt"), weights_only=False) for rank in range(WORLD_SIZE)]


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_sequence_parallel_equals_one_process(family, model_dirs, split_results):
    from workers.loading import load_tokenizer

    expected = _run(model_dirs[family], load_tokenizer(model_dirs[family]), 1, 0, None)
    assert expected["micro_batches"] >= 2  # the batch really is cut into several micro-batches
    for rank, results in enumerate(split_results):
        got = results[family]
        assert got["micro_batches"] >= 1
        for key in ("logprobs", "entropy", "values", "rewards"):
            assert expected[key].abs().sum() > 0
            torch.testing.assert_close(got[key], expected[key], atol=1e-5, rtol=0, msg=f"{key} on rank {rank}")
        # Each rank of the group reports its share of the loss: the mean over ranks is the loss.
        assert got["loss"] == pytest.approx(expected["loss"], abs=1e-5)
        assert got["grads"].keys() == expected["grads"].keys()
        for name, grad in expected["grads"].items():
            torch.testing.assert_close(got["grads"][name], grad, atol=1e-5, rtol=1e-4, msg=f"{name} on rank {rank}")


def test_head_counts_that_do_not_divide_are_one_line(model_dirs):
    from workers.loading import load_causal_lm
    from workers.sequence_parallel import check_sequence_parallel, enable

    with pytest.raises(ValueError, match=r"model.sequence_parallel=3 must divide the model's attention head count \(4\)"):
        enable(load_causal_lm(model_dirs["qwen3"]), 3)
    with pytest.raises(ValueError, match=r"model.sequence_parallel=4 must divide the model's key/value head count \(2\)"):
        enable(load_causal_lm(model_dirs["qwen3"]), 4)
    with pytest.raises(ValueError, match="must be >= 1 and divide the world size 2"):
        check_sequence_parallel(4, 2)
