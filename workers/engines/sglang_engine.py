"""Launch and drive a real SGLang server (GPU; the `sglang` extra). sglang is imported lazily.

One server per node or TP group, launched by the owning rank as `python -m sglang.launch_server`.
Around training the engine releases KV cache and weights; afterwards it resumes weights,
receives the new weights as CUDA-IPC tensor buckets (no disk), then resumes the KV cache,
the order RL2 and slime use so the cache is allocated only once the weights are back
(reference sections 2-3). Pure functions below build the argv, env, buckets and payloads so
they are testable without sglang or a GPU.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping

from workers.engines.client import EngineClient, EngineError
from workers.procs import ManagedProcesses, free_port, start_process, stop_process, wait_http_ok

RELEASE_TAGS = ("kv_cache", "weights")
RESUME_BEFORE_UPDATE = ("weights",)
RESUME_AFTER_UPDATE = ("kv_cache",)
DEFAULT_BUCKET_BYTES = 512 << 20


def server_kwargs(model_path: str, host: str = "127.0.0.1", port: int = 30000, tp_size: int = 1,
                  mem_fraction_static: float = 0.6, enable_memory_saver: bool = True, base_gpu_id: int = 0,
                  dtype: str = "auto", log_level: str = "info", **extra: Any) -> dict[str, Any]:
    """ServerArgs fields for a colocated engine (set mem_fraction_static: the trainer shares the GPU)."""
    if not 0 < mem_fraction_static < 1:
        raise ValueError(f"mem_fraction_static must be in (0, 1), got {mem_fraction_static}")
    if tp_size < 1:
        raise ValueError(f"tp_size must be >= 1, got {tp_size}")
    return {"model_path": str(model_path), "host": host, "port": int(port), "tp_size": tp_size,
            "mem_fraction_static": mem_fraction_static, "enable_memory_saver": enable_memory_saver,
            "base_gpu_id": base_gpu_id, "dtype": dtype, "skip_tokenizer_init": False, "log_level": log_level,
            **extra}


def build_server_argv(kwargs: Mapping[str, Any], python: str = sys.executable) -> list[str]:
    """`python -m sglang.launch_server` flags from ServerArgs kwargs (True -> bare flag, False/None -> omitted)."""
    argv = [python, "-m", "sglang.launch_server"]
    for key, value in kwargs.items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            argv.append(flag)
        elif value is False or value is None:
            continue
        else:
            argv += [flag, str(value)]
    return argv


def server_env(base_env: Mapping[str, str] | None = None, cuda_visible_devices: str | None = None) -> dict[str, str]:
    """Environment for the server process."""
    env = dict(os.environ if base_env is None else base_env)
    # Health probes must not generate: a paused or released engine would fail them (pitfall 2).
    env["SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION"] = "false"
    # expandable_segments breaks torch_memory_saver and CUDA IPC (pitfall 4); slime drops it too.
    env.pop("PYTORCH_CUDA_ALLOC_CONF", None)
    if cuda_visible_devices is not None:
        env["CUDA_VISIBLE_DEVICES"] = cuda_visible_devices
    return env


def tensor_nbytes(tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_named_tensors(named_tensors: Iterable[tuple[str, Any]], bucket_bytes: int) -> list[list[tuple[str, Any]]]:
    """Group tensors in order into buckets of at most `bucket_bytes` (a bigger tensor gets its own bucket)."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    buckets: list[list[tuple[str, Any]]] = []
    current: list[tuple[str, Any]] = []
    current_bytes = 0
    for name, tensor in named_tensors:
        size = tensor_nbytes(tensor)
        if current and current_bytes + size > bucket_bytes:
            buckets.append(current)
            current, current_bytes = [], 0
        current.append((name, tensor))
        current_bytes += size
    if current:
        buckets.append(current)
    return buckets


def update_tensor_payload(serialized: str, tp_size: int, is_last: bool, weight_version: str | None,
                          load_format: str | None = "flattened_bucket") -> dict[str, Any]:
    """Body of /update_weights_from_tensor for one bucket.

    Every TP rank reads its own entry; on one node all ranks can open the same IPC handles.
    The cache is flushed only with the last bucket: a refused flush reports success=false even
    though the weights loaded (reference section 2). The version moves only once all buckets are in.
    """
    payload: dict[str, Any] = {"serialized_named_tensors": [serialized] * tp_size, "load_format": load_format,
                               "flush_cache": is_last}
    if is_last and weight_version is not None:
        payload["weight_version"] = weight_version
    return payload


def sglang_serialize_bucket(bucket: list[tuple[str, Any]]) -> str:
    """Serialize one bucket with sglang's own FlattenedTensorBucket + MultiprocessingSerializer."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # GPU UUIDs instead of indices, so CUDA_VISIBLE_DEVICES may differ
    flat = FlattenedTensorBucket(named_tensors=bucket)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return MultiprocessingSerializer.serialize(payload, output_str=True)


async def push_weight_buckets(client: EngineClient, named_tensors: Iterable[tuple[str, Any]], version: str,
                              tp_size: int = 1, bucket_bytes: int = DEFAULT_BUCKET_BYTES,
                              serialize: Callable[[list], str] = sglang_serialize_bucket,
                              load_format: str | None = "flattened_bucket") -> int:
    """Stream tensors to a server in buckets inside a weight-update session; return the bucket count."""
    import torch

    try:
        await client.post("/begin_weight_update")
        session = True
    except EngineError as err:
        if err.status != 404:
            raise
        session = False  # sglang <= 0.5.20 has no sessions
    buckets = bucket_named_tensors(named_tensors, bucket_bytes)
    try:
        for index, bucket in enumerate(buckets):
            on_gpu = torch.cuda.is_available() and any(t.is_cuda for _, t in bucket)
            if on_gpu:
                torch.cuda.synchronize()
            payload = update_tensor_payload(serialize(bucket), tp_size, index == len(buckets) - 1, version,
                                            load_format)
            reply = await client.post("/update_weights_from_tensor", payload, timeout_s=client.timeout_s)
            if isinstance(reply, dict) and reply.get("success") is False:
                raise EngineError(f"{client.base_url}/update_weights_from_tensor", 200, reply.get("message", ""))
            if on_gpu:
                torch.cuda.ipc_collect()  # the server holds no more references to this bucket
    finally:
        if session:
            await client.post("/end_weight_update")
    return len(buckets)


class SGLangEngine:
    """One SGLang server process owned by this rank."""

    def __init__(self, model_path: str, log_path: str | Path, host: str = "127.0.0.1", port: int | None = None,
                 tp_size: int = 1, mem_fraction_static: float = 0.6, base_gpu_id: int = 0, dtype: str = "auto",
                 enable_memory_saver: bool = True, cuda_visible_devices: str | None = None,
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, processes: ManagedProcesses | None = None,
                 **extra_server_args: Any):
        self.host = host
        self.port = port or free_port(host)
        self.tp_size = tp_size
        self.log_path = Path(log_path)
        self.bucket_bytes = bucket_bytes
        self.kwargs = server_kwargs(model_path, host, self.port, tp_size, mem_fraction_static, enable_memory_saver,
                                    base_gpu_id, dtype, **extra_server_args)
        self.env = server_env(cuda_visible_devices=cuda_visible_devices)
        self.processes = processes
        self.proc = None
        self.client = EngineClient(self.url)

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, deadline_s: float = 600.0) -> "SGLangEngine":
        argv = build_server_argv(self.kwargs)
        name = f"sglang server {self.url}"
        self.proc = self.processes.start(name, argv, self.log_path, self.env) if self.processes \
            else start_process(argv, self.log_path, self.env)
        try:
            wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name=name)
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self) -> None:
        if self.proc is not None:
            if self.processes is not None:
                self.processes.stop(self.proc)
            else:
                stop_process(self.proc)
            self.proc = None

    async def release_memory(self) -> None:
        """Free KV cache and weights for training (the server must be idle)."""
        await self.client.release_memory(list(RELEASE_TAGS))

    async def update_weights(self, named_tensors: Iterable[tuple[str, Any]], version: str,
                             serialize: Callable[[list], str] = sglang_serialize_bucket) -> int:
        """Resume weights, push the new ones in buckets, then resume the KV cache."""
        await self.client.resume_memory(list(RESUME_BEFORE_UPDATE))
        count = await push_weight_buckets(self.client, named_tensors, version, self.tp_size, self.bucket_bytes,
                                          serialize)
        await self.client.resume_memory(list(RESUME_AFTER_UPDATE))
        return count

    async def close(self) -> None:
        await self.client.close()
