"""A PPO step reads the training device back to the host at most 3 times: on a GPU each read waits until the
device has finished everything queued, so a read per metric, micro-batch or optimizer step left the GPU idle
while the host caught up (issue: the GPU step). Counted here on CPU, over the step's forward passes (old and
reference logprobs, values, reward-model scores), advantages and PPO epochs (2 epochs x 2 minibatches, several
micro-batches each, actor and critic)."""

import pytest
import torch

from rl_core.ppo import algorithms as alg
from rl_core.ppo.config import AlgorithmConfig, ModelConfig, RewardConfig
from rl_core.ppo.models import PPOModels
from rl_core.ppo.step import (Experience, Scoring, StepSettings, compute_advantages, forward_passes, minibatch_order,
                              score_metrics, task_scores, train_minibatch, update_metrics)
from rl_core.profiling import DeviceReads
from rl_core.rollout.trajectory import TokenSequence, Trajectory
from workers.loading import init_reward_model
from workers.worker import BatchWorker

def trajectory(prompt: int, response: int, token: int) -> Trajectory:
    seq = TokenSequence()
    seq.extend_context([5 + (token + i) % 50 for i in range(prompt)])
    seq.extend_action([60 + (token * 7 + i) % 50 for i in range(response)], [-1.0] * response, [0] * response)
    return Trajectory([seq], {"group_id": token // 2})


@pytest.mark.parametrize("layout", [None, "rows"])
def test_a_ppo_step_reads_the_device_back_three_times(process_group, tiny_model_dir, tmp_path, layout):
    reward_dir = tmp_path / "rm"
    init_reward_model(tiny_model_dir, pad_token_id=0, seed=0).save_pretrained(reward_dir)
    algo = AlgorithmConfig(noptepochs=2, nminibatches=2)
    models = PPOModels(ModelConfig(path=tiny_model_dir), algo, str(reward_dir), pad_token_id=0, total_steps=4)
    assert models.critic is not None and models.reference is not None and models.uses_reference
    # max_tokens small enough for several micro-batches per minibatch
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=40, layout=layout)
    settings = StepSettings(algo, Scoring.from_config(RewardConfig(), algo, 12), temperature=0.7, norm_length=12,
                            seed=0, engine_old_logprobs_max_gap=-float("inf"))
    kl_ctl = alg.AdaptiveKLController(algo.kl.init_coef, algo.kl.target, algo.kl.horizon)
    exp = Experience.from_trajectories([trajectory(4 + i % 3, 6 + i % 5, i) for i in range(8)])
    before = [p.detach().clone() for p in models.actor.model.parameters()]

    with DeviceReads([models.actor.model, models.critic.model, models.reference, models.reward_model]) as counter:
        exp = forward_passes(exp, models, worker, settings, old_from_engine=False)
        metrics = score_metrics(exp, old_from_engine=False)
        scores, _ = task_scores(exp, settings.scoring)
        advantages, stats = compute_advantages(exp, scores, kl_ctl.value, algo)
        exp = exp.with_rows("advantages", advantages)
        history = [train_minibatch(exp.select(ids), models, worker, settings, kl_ctl.value)
                   for _, _, ids in minibatch_order(len(exp.trajectories), settings, step=0)]
        metrics.update(update_metrics(history, stats, models, kl_ctl.value))

    # one copy of the policy's, reference's and critic's outputs, one of the reward model's scores, and every
    # metric of the 4 optimizer steps (losses, clip fractions, grad norms) at the end
    assert counter.reads == ["cpu", "cpu", "tolist"], counter.where
    assert metrics["policy/optimizer_steps"] == 4 and metrics["policy/grad_norm"] > 0
    assert not any(isinstance(v, torch.Tensor) for v in metrics.values())
    assert any(not torch.equal(a, b.detach()) for a, b in zip(before, models.actor.model.parameters()))


def test_the_counter_sees_reads_of_what_the_model_computed(process_group, tiny_model_dir):
    """The counter is not blind: a metric read per micro-batch, as the step did before, is counted."""
    from workers import forward

    models = PPOModels(ModelConfig(path=tiny_model_dir), AlgorithmConfig(advantage_estimator="grpo"), None,
                       pad_token_id=0, total_steps=1)
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=40)
    exp = Experience.from_trajectories([trajectory(4, 6, i) for i in range(4)])
    with DeviceReads([models.actor.model]) as counter:
        for micro, _ in worker.micro_batches(exp.batch):
            forward.token_logprobs(models.actor.model, micro, actions_only=True).sum().item()
        exp.batch["action_mask"].sum().item()  # the host's own batch: not a device read
    assert counter.reads == ["item"] * len(worker.plan(exp.batch))
