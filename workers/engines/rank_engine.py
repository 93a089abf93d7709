"""One rank's inference engine as the job drives it: launched (`launch.py`), then used only through SGLang's HTTP
API.

Both kinds (`embedded`, `sglang`) get the same calls in the same order:

    sync step:  rollout -> release [kv_cache, weights] -> (train) -> resume [weights]
                -> begin_weight_update -> update_weights_from_tensor x buckets -> end_weight_update
                -> resume [kv_cache] -> probe (a prefill: its weight_version and logprobs) -> rollout
    async step: pause (in_place) or drain -> the same push -> continue -> probe

Resuming weights before the push and the KV cache after it is the order RL2 and slime use, so
the cache is allocated only once the weights are back. SGLang asserts it is idle when memory
is released, so the caller drains or pauses first.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from pathlib import Path
from typing import Iterable, Iterator

import torch

from workers.engines.client import EngineClient, EngineError
from workers.engines.embedded.forked import EngineFork
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.weights import PROBE_TOLERANCE, Probe, WeightPusher, WeightSyncError, sglang_encode_bucket
from workers.loading import model_checkpoint_renamer
from workers.procs import ManagedProcesses
from workers.trace import span

RELEASE_TAGS = ("kv_cache", "weights")
RESUME_BEFORE_PUSH = ("weights",)
RESUME_AFTER_PUSH = ("kv_cache",)


class RankEngine:
    """This rank's engine as the trainer drives it, the one place that does (release, push, probe): blocking
    calls, each SGLang call made here in its order and run on the engine's own event loop within `timeout_s`; a
    failure names the engine, its log and what was asked. `probe_tolerance`: the mean |logprob gap| on the probe
    that still counts as the trainer's weights."""

    def __init__(self, url: str, log_path: Path, pusher: WeightPusher, probe_tolerance: float,
                 timeout_s: float = 300.0, device: str = "cpu"):
        self.url = url
        self.log_path = log_path
        self.pusher = pusher
        self.probe_tolerance = probe_tolerance
        self.timeout_s = timeout_s
        self.device = device
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
        # the served model's checkpoint names (a Qwen2/2.5-VL's differ from the trainer's parameter names)
        pusher = WeightPusher(getattr(torch, spec.dtype), bucket_bytes, spec.tp_size, encode,
                              model_checkpoint_renamer(spec.model_path))
        return cls(url, log_path, pusher, probe_tolerance or PROBE_TOLERANCE[spec.dtype], timeout_s, spec.device)

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.url, timeout_s=self.timeout_s)
        return self._client

    def release_memory(self) -> float:
        """Free KV cache and weights for training (the engine must be idle); returns the seconds it took."""
        started = time.perf_counter()
        with self._failure_named("releasing memory"):
            self._loop.run_until_complete(self.client.post("/release_memory_occupation", {"tags": list(RELEASE_TAGS)}))
        self.released = True
        return time.perf_counter() - started

    def push(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | str, probe: Probe | None,
             trainer_logprobs: list[float] | None, pause_in_place: bool = False) -> dict[str, float]:
        """Stream the trainer's weights in as `version` (resuming released memory around it), then fail fast unless
        the engine answers the probe from `version` with the trainer's logprobs (no probe: a test that checks the
        engine otherwise). Returns timings and the probe's gap. The calls in their order (module docstring), each
        made here, on the engine's loop.

        `pause_in_place`: the engine pauses its running requests for the push and continues them on the new
        weights (async partial rollout); otherwise it must be idle (the collector saw to that)."""
        run, post, version = self._loop.run_until_complete, self.client.post, str(version)
        stats = {"weight_sync/resume_s": 0.0, "weight_sync/pack_s": 0.0, "weight_sync/bytes": 0.0,
                 "weight_sync/buckets": 0.0}  # resumes timed apart: on a GPU the memory saver's remapping costs
        if self.released and self.device.startswith("cuda"):
            # The trainer's cached activation blocks would otherwise stay reserved while the engine takes
            # its weights and KV cache back (OOM on resume; the memory plan counts on this).
            torch.cuda.empty_cache()
        with self._failure_named(f"the weight push of version {version}"):
            if pause_in_place:
                run(post("/pause_generation", {"mode": "in_place"}))
            try:
                with span("push"):  # resume weights, gather and send the buckets, flush, resume the KV cache
                    if self.released:
                        resuming = time.perf_counter()
                        run(post("/resume_memory_occupation", {"tags": list(RESUME_BEFORE_PUSH)}))
                        stats["weight_sync/resume_s"] += time.perf_counter() - resuming
                    pushing = time.perf_counter()
                    try:  # a weight-update session; SGLang <= 0.5.20 has none (404) and takes updates without one
                        run(post("/begin_weight_update"))
                        session = True
                    except EngineError as err:
                        if err.status != 404:
                            raise
                        session = False
                    try:
                        for payload, nbytes, pack_s in self.pusher.payloads(named_tensors, version,
                                                                            flush_cache=not pause_in_place):
                            reply = run(post("/update_weights_from_tensor", payload, timeout_s=self.timeout_s))
                            if isinstance(reply, dict) and reply.get("success") is False:
                                raise WeightSyncError(f"/update_weights_from_tensor refused a bucket: "
                                                      f"{reply.get('message', '')}")
                            stats["weight_sync/bytes"] += nbytes
                            stats["weight_sync/pack_s"] += pack_s
                            stats["weight_sync/buckets"] += 1
                    except BaseException:
                        if session:  # closed if the engine still can, but the first error is the one reported
                            with contextlib.suppress(Exception):
                                run(post("/end_weight_update"))
                        raise
                    if session:
                        run(post("/end_weight_update"))
                    stats["weight_sync/push_s"] = time.perf_counter() - pushing
                    if self.released:
                        resuming = time.perf_counter()
                        run(post("/resume_memory_occupation", {"tags": list(RESUME_AFTER_PUSH)}))
                        stats["weight_sync/resume_s"] += time.perf_counter() - resuming
                        self.released = False
            finally:
                if pause_in_place:
                    run(post("/continue_generation"))
            if probe is None:
                return stats
            with span("probe"):
                probing = time.perf_counter()
                answer = run(post("/generate", probe.request(), timeout_s=self.timeout_s))
                stats["weight_sync/probe_gap"] = probe.gap(answer, version, trainer_logprobs, self.probe_tolerance,
                                                           self.url)
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

    def __enter__(self) -> "RankEngine":
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

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
