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
every rank) and takes each step's batch from it (`Collector.batch`); only rank 0 has the rollout
service and the prompts, and sends the batch to the others.
"""

from __future__ import annotations

import contextlib
import copy
import functools
from typing import Callable, Iterator

from rl_core.distributed import broadcast_object, wait_for_rank0
from rl_core.errors import JobError
from rl_core.ppo.config import PPOConfig
from rl_core.ppo.scoring import Scoring, apply_group_rule, has_reward_variance
from rl_core.rollout.process import RolloutProcess
from rl_core.rollout.service import Collected, RolloutService
from workers.engines.client import EngineError


class Collector:
    """One step's trajectories on every rank. Rank 0 (`start`ed with the rollout service) collects them as its mode
    says (`collect`), applies the group estimators' rule to incomplete groups, and broadcasts them."""

    def __init__(self, cfg: PPOConfig, prompts):
        self.algo = cfg.algorithm
        self.prompts = prompts
        self.service: RolloutService | RolloutProcess | None = None
        self.dead_engines: Callable[[], list[str]] = list

    def start(self, service: RolloutService | RolloutProcess, dead_engines: Callable[[], list[str]]) -> None:
        """Rank 0: collect through `service`; `dead_engines()` names what stopped answering when a rollout fails."""
        self.service, self.dead_engines = service, dead_engines

    def batch(self, version: int) -> tuple[list, dict]:
        """The step's trajectories, and rank 0's rollout metrics (every rank gets both)."""
        trajectories, metrics = None, {}
        if self.service is not None:
            try:
                (trajectories, metrics), dropped = self.collect(version)
            except EngineError as err:
                dead = self.dead_engines()
                if not dead:
                    raise
                raise JobError(f"rollout failed: {'; '.join(dead)}; see that log (trainer.resume=auto continues from "
                               f"the last checkpoint) [{err}]") from err
            metrics = dict(metrics)
            if self.algo.advantage_estimator != "gae":
                trajectories, group_stats = apply_group_rule(trajectories, self.algo.group_size,
                                                             self.algo.incomplete_groups)
                metrics.update(group_stats)
            metrics["async/dropped_stale"] = dropped
            metrics["async/staleness_max"] = max((version - t.min_version for t in trajectories), default=0)
        wait_for_rank0(f"rollout for version {version}")  # a rollout may outlast the collective timeout
        trajectories, metrics = broadcast_object((trajectories, metrics))
        if not trajectories:
            raise JobError("the rollout produced no usable trajectory (every env failed); see rank 0's log")
        return trajectories, metrics

    def collect(self, version: int) -> tuple[Collected, int]:
        """Rank 0: the batch, and how many trajectories were dropped as too stale."""
        raise NotImplementedError

    def resume_state(self) -> dict:
        """Rank 0: the prompt position after the last batch trained on, which checkpoints save."""
        return self.prompts.state_dict()


class SyncCollector(Collector):
    engines_idle_while_training = True  # every request has returned before training starts
    pauses_in_place = False

    def __init__(self, cfg: PPOConfig, prompts):
        super().__init__(cfg, prompts)
        # The score as in training (no reward model: it scores after the rollout) decides DAPO's filter.
        self.scoring = Scoring.from_config(cfg.reward, cfg.algorithm, cfg.rollout.response_length)

    def collect(self, version: int) -> tuple[Collected, int]:
        """One batch generated now with `version`; returns (batch, trajectories dropped as stale: none)."""
        algo = self.algo
        if not algo.filter_zero_variance_groups:
            return self.service.collect(next(self.prompts), version), 0
        # DAPO dynamic sampling: a group whose rewards are all equal has no signal; sample more prompts
        n_groups = algo.batch_size // algo.group_size
        varied = functools.partial(has_reward_variance, scoring=self.scoring)
        max_groups = max(n_groups, int(algo.filter_max_groups_factor * n_groups))
        return self.service.collect_groups(self.prompts.groups(), n_groups, varied, max_groups, version), 0

    @contextlib.contextmanager
    def weight_push(self) -> Iterator[None]:
        yield  # nothing is generating


class AsyncCollector(Collector):
    engines_idle_while_training = False

    def __init__(self, cfg: PPOConfig, prompts):
        super().__init__(cfg, prompts)
        self.settings, self.batch_size = cfg.async_, cfg.algorithm.batch_size
        self.pauses_in_place = cfg.async_.partial_rollout

    def start(self, service: RolloutService | RolloutProcess, dead_engines: Callable[[], list[str]]) -> None:
        """Start the producer on a copy of the prompt stream: `self.prompts` stays at the position after
        the last batch trained on (the producer runs ahead), which checkpoints save."""
        super().start(service, dead_engines)
        service.start_producer(copy.deepcopy(self.prompts), self.settings.queue_batches, self.settings.max_staleness,
                               self.settings.batches_in_flight)

    def collect(self, version: int) -> tuple[Collected, int]:
        """Fresh-enough queued trajectories; returns (batch, trajectories dropped as too stale)."""
        batch = self.service.next_batch(self.batch_size, version, self.settings.max_staleness)
        self.prompts.load_state_dict(self.service.resume_state)
        return batch

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
