"""One rank's inference engine as the job drives it: launched (`launch.py`), then used only through SGLang's HTTP
API.

Both kinds (`embedded`, `sglang`) get the same calls in the same order:

    sync step:  rollout -> release [kv_cache, weights] -> (train) -> resume [weights]
                -> begin_weight_update -> update_weights_from_tensor x buckets -> end_weight_update
                -> resume [kv_cache] -> check (weight_version + logprob probe) -> rollout
    async step: pause (in_place) or drain -> the same push -> continue -> check

Resuming weights before the push and the KV cache after it is the order RL2 and slime use, so
the cache is allocated only once the weights are back. SGLang asserts it is idle when memory
is released, so the caller drains or pauses first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch

from workers.engines.client import EngineClient, EngineError
from workers.engines.embedded.forked import EngineFork
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.weights import (PROBE_TOLERANCE, Probe, WeightPusher, WeightSyncError, check_pushed_weights,
                                     sglang_encode_bucket)
from workers.procs import ManagedProcesses
from workers.trace import span

RELEASE_TAGS = ("kv_cache", "weights")
RESUME_BEFORE_PUSH = ("weights",)
RESUME_AFTER_PUSH = ("kv_cache",)


class RankEngine:
    """This rank's engine as the trainer drives it, the one place that does (release, push, probe, health):
    blocking calls, each run on the engine's own event loop within `timeout_s`; a failure names the engine,
    its log and what was asked."""

    def __init__(self, spec: EngineSpec, url: str, log_path: Path, pusher: WeightPusher,
                 timeout_s: float = 300.0, probe_tolerance: float | None = None):
        self.spec = spec
        self.url = url
        self.log_path = log_path
        self.pusher = pusher
        self.timeout_s = timeout_s
        # Mean |logprob gap| on the probe that still counts as the trainer's weights (None: the dtype's).
        self.probe_tolerance = probe_tolerance or PROBE_TOLERANCE[spec.dtype]
        self.released = False
        self._loop = asyncio.new_event_loop()
        self._client: EngineClient | None = None  # its session lives on `_loop`

    @classmethod
    def launch(cls, spec: EngineSpec, log_path: Path, processes: ManagedProcesses, deadline_s: float,
               bucket_bytes: int, timeout_s: float = 300.0, probe_tolerance: float | None = None,
               fork: EngineFork | None = None) -> "RankEngine":
        url = start_engine(spec, log_path, processes, deadline_s, fork=fork).url
        # CUDA buckets for SGLang need its own pickler (IPC handles keyed by GPU UUID); CPU buckets
        # travel the same way to both engines (shared-memory files), without importing sglang.
        encode = sglang_encode_bucket if spec.kind == "sglang" and spec.device.startswith("cuda") else None
        pusher = WeightPusher(getattr(torch, spec.dtype), bucket_bytes, spec.tp_size, encode)
        return cls(spec, url, log_path, pusher, timeout_s, probe_tolerance)

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.url, timeout_s=self.timeout_s)
        return self._client

    def release_memory(self) -> float:
        """Free KV cache and weights for training (the engine must be idle); returns the seconds it took."""
        started = time.perf_counter()
        with self._failure_named("releasing memory"):
            self._loop.run_until_complete(asyncio.wait_for(self.client.release_memory(RELEASE_TAGS), self.timeout_s))
        self.released = True
        return time.perf_counter() - started

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int, probe: Probe,
             trainer_logprobs: list[float], pause_in_place: bool) -> dict[str, float]:
        """Stream the trainer's weights in as `version` (resuming released memory around it), then fail fast unless
        the engine serves `version` with the trainer's logprobs on the probe. Returns timings and the probe's gap.

        `pause_in_place`: the engine pauses its running requests for the push and continues them on the new
        weights (async partial rollout); otherwise it must be idle (the collector saw to that)."""
        if self.released and self.spec.device.startswith("cuda"):
            # The trainer's cached activation blocks would otherwise stay reserved while the engine takes
            # its weights and KV cache back (OOM on resume; the memory plan counts on this).
            torch.cuda.empty_cache()
        pushing = self._push_and_check(named_tensors, str(version), probe, trainer_logprobs, pause_in_place)
        with self._failure_named(f"the weight push of version {version}"):
            return self._loop.run_until_complete(asyncio.wait_for(pushing, self.timeout_s))

    async def _push_and_check(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str,
                              probe: Probe, trainer_logprobs: list[float],
                              pause_in_place: bool) -> dict[str, Any]:
        """The push's calls in their order (module docstring): pause, resume the weights, the buckets, resume the
        KV cache, continue; then the check of version and probe."""
        resume_s = 0.0  # timed apart from the push: on a GPU the memory saver's remapping is its own cost
        if pause_in_place:
            await self.client.pause_generation("in_place")
        try:
            with span("push"):  # resume weights, gather and send the buckets, flush, resume the KV cache
                if self.released:
                    started = time.perf_counter()
                    await self.client.resume_memory(RESUME_BEFORE_PUSH)
                    resume_s += time.perf_counter() - started
                stats = await self.pusher.push(self.client, named_tensors, version, flush_cache=not pause_in_place)
                if self.released:
                    started = time.perf_counter()
                    await self.client.resume_memory(RESUME_AFTER_PUSH)
                    resume_s += time.perf_counter() - started
                    self.released = False
        finally:
            if pause_in_place:
                await self.client.continue_generation()
        stats["weight_sync/resume_s"] = resume_s
        with span("probe"):
            probing = time.perf_counter()
            stats["weight_sync/probe_gap"] = await check_pushed_weights(self.client, version, probe,
                                                                        trainer_logprobs, self.probe_tolerance)
            stats["weight_sync/probe_s"] = time.perf_counter() - probing
        return stats

    @contextlib.contextmanager
    def _failure_named(self, what: str) -> Iterator[None]:
        """An engine call's failure as one error naming the engine, what was asked and the engine's log."""
        try:
            yield
        except (EngineError, WeightSyncError, asyncio.TimeoutError) as err:
            raise RuntimeError(f"engine {self.url} failed during {what}: {err or type(err).__name__}; "
                               f"its log: {self.log_path}") from err

    def close(self) -> None:
        """A stop signal can interrupt a call (a push, a release) mid-way: cancel it and let it unwind here,
        before its session closes, rather than in a closed loop at exit."""
        pending = asyncio.all_tasks(self._loop)
        for task in pending:
            task.cancel()
        if pending:  # gather() of nothing would belong to another loop
            self._loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
        if self._client is not None:
            self._loop.run_until_complete(self._client.close())
            self._client = None
        self._loop.close()
