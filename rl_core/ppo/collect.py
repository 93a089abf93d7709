"""Where each step's batch comes from: sync or async, decided here and nowhere else.

Sync (on-policy): rank 0 generates the batch with the weights just pushed, then the engines sit
idle while the trainer runs, so they free their memory. With DAPO's dynamic sampling it draws
prompt groups until enough have reward variance.

Async (bounded staleness): a producer on rank 0 keeps generating ahead with whatever weights the
engines hold; a step takes trajectories at most `async.max_staleness` versions old. Around a
weight push it either holds new requests until the running ones end (they finish on the old
weights) or, with `async.partial_rollout`, the engines pause requests in place and continue them
on the new weights.

Every rank builds the same collector (what the engines must do around a push is the same on
every rank); only rank 0 has the rollout service and the prompts.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Iterator

from rl_core.ppo.config import PPOConfig
from rl_core.ppo.step import Scoring, has_reward_variance
from rl_core.rollout.rollout import RolloutResult
from rl_core.rollout.process import RolloutProcess
from rl_core.rollout.service import RolloutService


class SyncCollector:
    engines_idle_while_training = True  # every request has returned before training starts
    pauses_in_place = False

    def __init__(self, cfg: PPOConfig, prompts):
        self.algo = cfg.algorithm
        # The score as in training (no reward model: it scores after the rollout) decides DAPO's filter.
        self.scoring = Scoring.from_config(cfg.reward, cfg.algorithm, cfg.rollout.response_length)
        self.prompts = prompts
        self.service: RolloutService | None = None

    def start(self, service: RolloutService) -> None:
        self.service = service

    def collect(self, version: int) -> tuple[RolloutResult, int]:
        """One batch generated now with `version`; returns (batch, trajectories dropped as stale: none)."""
        algo = self.algo
        if not algo.filter_zero_variance_groups:
            return self.service.collect(next(self.prompts), version), 0
        # DAPO dynamic sampling: a group whose rewards are all equal has no signal; sample more prompts
        n_groups = algo.batch_size // algo.group_size
        varied = functools.partial(has_reward_variance, scoring=self.scoring)
        max_groups = max(n_groups, int(algo.filter_max_groups_factor * n_groups))
        return self.service.collect_groups(self.prompts.groups(), n_groups, varied, max_groups, version), 0

    def resume_state(self) -> dict:
        return self.prompts.state_dict()

    @contextlib.contextmanager
    def weight_push(self) -> Iterator[None]:
        yield  # nothing is generating


class AsyncCollector:
    engines_idle_while_training = False

    def __init__(self, cfg: PPOConfig, prompts):
        self.settings, self.batch_size = cfg.async_, cfg.algorithm.batch_size
        self.pauses_in_place = cfg.async_.partial_rollout
        self.prompts = prompts
        self.service: RolloutService | None = None

    def start(self, service: RolloutService | RolloutProcess) -> None:
        """Start the producer on a copy of the prompt stream: `self.prompts` stays at the position after
        the last batch trained on (the producer runs ahead), which checkpoints save."""
        self.service = service
        service.start_producer(copy.deepcopy(self.prompts), self.settings.queue_batches, self.settings.max_staleness,
                               self.settings.batches_in_flight)

    def collect(self, version: int) -> tuple[RolloutResult, int]:
        """Fresh-enough queued trajectories; returns (batch, trajectories dropped as too stale)."""
        batch = self.service.next_batch(self.batch_size, version, self.settings.max_staleness)
        self.prompts.load_state_dict(self.service.resume_state)
        return batch

    def resume_state(self) -> dict:
        return self.prompts.state_dict()

    @contextlib.contextmanager
    def weight_push(self) -> Iterator[None]:
        holding = self.service is not None and not self.pauses_in_place
        if holding:
            self.service.hold()
        try:
            yield
        finally:
            if holding:
                self.service.release()


def make_collector(cfg: PPOConfig, prompts) -> SyncCollector | AsyncCollector:
    return AsyncCollector(cfg, prompts) if cfg.trainer.mode == "async" else SyncCollector(cfg, prompts)
