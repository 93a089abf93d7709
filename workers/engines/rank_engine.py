"""One rank's inference engine as the job drives it: launched, then used only through SGLang's HTTP API.

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

import dataclasses
import subprocess
import time
from pathlib import Path
from typing import Any, Iterable

import torch

from workers.engines.client import EngineClient
from workers.engines.weights import WeightPusher, check_pushed_weights, sglang_encode_bucket
from workers.procs import ManagedProcesses, free_port, stop_process, wait_http_ok

RELEASE_TAGS = ("kv_cache", "weights")
RESUME_BEFORE_PUSH = ("weights",)
RESUME_AFTER_PUSH = ("kv_cache",)


@dataclasses.dataclass
class EngineSpec:
    """What one rank's engine serves and how it is launched."""
    kind: str  # embedded | sglang
    model_path: str
    dtype: str  # float32 | bfloat16 | float16: the engine's weights
    device: str  # cpu | cuda:N (the rank's device)
    host: str = "127.0.0.1"
    seed: int = 0
    max_batch_size: int = 64
    num_threads: int = 0  # embedded on CPU: torch threads
    tp_size: int = 1
    mem_fraction_static: float = 0.6
    sglang_args: dict = dataclasses.field(default_factory=dict)
    gpu_ids: tuple[int, ...] | None = None  # sglang: the GPUs of this rank's server
    sglang_python: str | None = None  # sglang: the interpreter that runs the server (None: this one)
    # sglang: the context it serves, the one the trainer checks its lengths against (workers.loading.
    # context_length; the embedded engine reads the same from the model). None: SGLang's own derivation,
    # which differs for some configs (it multiplies by a rope-scaling factor, reads other keys first).
    context_length: int | None = None
    # sglang: its KV pool in tokens (max_total_tokens; the job's memory plan), unless sglang_args sets it.
    # The embedded engine grows its cache per decode batch and has no pool to size.
    kv_tokens: int | None = None


def engine_argv(spec: EngineSpec, port: int) -> tuple[list[str], dict[str, str] | None]:
    """The command line and environment that start `spec`'s server on `port`."""
    if spec.kind == "embedded":
        from workers.engines.embedded import build_engine_argv

        return build_engine_argv(spec, port), None
    from workers.engines.sglang_engine import build_server_argv, server_env, server_kwargs, server_python

    # (None would drop the CPU default pool: only a planned size replaces it.)
    pool = {} if spec.kv_tokens is None else {"max_total_tokens": int(spec.kv_tokens)}
    kwargs = server_kwargs(spec, port, extra={"random_seed": spec.seed, "context_length": spec.context_length,
                                              **pool, **spec.sglang_args})
    return build_server_argv(kwargs, server_python(spec.sglang_python)), server_env(spec.gpu_ids, device=spec.device)


@dataclasses.dataclass
class EngineProcess:
    """A running engine server: where it answers, its process and its log."""
    name: str  # "<kind> engine <url>", as errors and the process list call it
    url: str
    proc: subprocess.Popen
    log_path: Path

    def wait_ready(self, deadline_s: float) -> "EngineProcess":
        """Block until /health answers; an engine that exits or never answers is stopped and named."""
        try:
            wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name=self.name)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def start_engine(spec: EngineSpec, log_path: Path, processes: ManagedProcesses, deadline_s: float,
                 wait: bool = True) -> EngineProcess:
    """The one way an engine starts (job, tests, benchmarks): `spec`'s server on a free port of its
    host, owned by `processes`; with `wait`, once /health answers."""
    port = free_port(spec.host)
    argv, env = engine_argv(spec, port)
    url = f"http://{spec.host}:{port}"
    name = f"{spec.kind} engine {url}"
    engine = EngineProcess(name, url, processes.start(name, argv, log_path, env), Path(log_path))
    return engine.wait_ready(deadline_s) if wait else engine


class RankEngine:
    """This rank's engine process and the HTTP calls the job makes to it.

    Methods are coroutines for the rank's own event loop; the client session lives on that loop.
    """

    def __init__(self, spec: EngineSpec, url: str, log_path: Path, pusher: WeightPusher,
                 timeout_s: float = 300.0):
        self.spec = spec
        self.url = url
        self.log_path = log_path
        self.pusher = pusher
        self.timeout_s = timeout_s
        self.released = False
        self._client: EngineClient | None = None

    @classmethod
    def launch(cls, spec: EngineSpec, log_path: Path, processes: ManagedProcesses, deadline_s: float,
               bucket_bytes: int, timeout_s: float = 300.0) -> "RankEngine":
        url = start_engine(spec, log_path, processes, deadline_s).url
        # CUDA buckets for SGLang need its own pickler (IPC handles keyed by GPU UUID); CPU buckets
        # travel the same way to both engines (shared-memory files), without importing sglang.
        encode = sglang_encode_bucket if spec.kind == "sglang" and spec.device.startswith("cuda") else None
        pusher = WeightPusher(getattr(torch, spec.dtype), bucket_bytes, spec.tp_size, encode)
        return cls(spec, url, log_path, pusher, timeout_s)

    @property
    def client(self) -> EngineClient:
        if self._client is None:
            self._client = EngineClient(self.url, timeout_s=self.timeout_s)
        return self._client

    async def release_memory(self) -> None:
        """Free KV cache and weights for training (the engine must be idle)."""
        await self.client.release_memory(RELEASE_TAGS)
        self.released = True

    async def push_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int,
                           flush_cache: bool = True) -> dict[str, Any]:
        """Resume released weights, stream the new ones in, resume the KV cache; returns timings."""
        resume_s = 0.0  # timed apart from the push: on a GPU the memory saver's remapping is its own cost
        if self.released:
            started = time.perf_counter()
            await self.client.resume_memory(RESUME_BEFORE_PUSH)
            resume_s += time.perf_counter() - started
        stats = await self.pusher.push(self.client, named_tensors, str(version), flush_cache)
        if self.released:
            started = time.perf_counter()
            await self.client.resume_memory(RESUME_AFTER_PUSH)
            resume_s += time.perf_counter() - started
            self.released = False
        return {**stats, "weight_sync/resume_s": resume_s}

    async def check_weights(self, version: int, probe_ids: list[int], trainer_logprobs: list[float],
                            tolerance: float) -> float:
        """Fail fast unless the engine now serves `version` with the trainer's logprobs."""
        return await check_pushed_weights(self.client, str(version), probe_ids, trainer_logprobs, tolerance)

    async def pause_generation(self, mode: str) -> None:
        await self.client.pause_generation(mode)

    async def continue_generation(self) -> None:
        await self.client.continue_generation()

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None
