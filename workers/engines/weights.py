"""Weight push into an engine through SGLang's `/update_weights_from_tensor`, and its check.

Both engines receive weights the same way (reference: SGLang's weight-update API):
`/begin_weight_update`, then one `/update_weights_from_tensor` call per *flattened bucket*
(one uint8 buffer + per-tensor metadata, SGLang's `FlattenedTensorBucket` layout), then
`/end_weight_update`. The payload pickles handles, not bytes: CUDA IPC handles on GPU,
shared-memory file names for CPU tensors, so the sender keeps each bucket alive and unchanged
until its HTTP call returns (CPU staging buffers longer: see `WeightPusher`). Tensors arrive
in the engine's dtype, one bucket at a time: on GPU the host never holds a copy of the model
for the push; on CPU the embedded engine serves from the staging buffers, so they are its weights.

The check after a push (`Probe`) asks the engine for its logprobs of a fixed probe sequence (`/generate` with
`max_new_tokens=0`, `return_logprob`, `logprob_start_len=0`) and compares the answer's `weight_version` and
logprobs with the trainer's. `workers.engines.rank_engine.RankEngine.push` makes the calls, in their order.
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import io
import os
import pickle
import sys
import time
import types
from typing import Any, Callable, Iterable, Iterator, Sequence

import torch

DEFAULT_BUCKET_BYTES = 512 << 20
# Mean absolute gap between engine and trainer logprobs on the probe that still counts as "same
# weights": kernels and reduction orders differ, more so in low precision. Wrong or partial
# weights give gaps of whole nats.
PROBE_TOLERANCE = {"float32": 2e-3, "float16": 3e-2, "bfloat16": 1e-1}
PROBE_TEXT = "Once upon a time, the old man walked to the market. He was happy and sang a song."


class WeightSyncError(RuntimeError):
    """An engine did not end up with the weights that were sent."""


# ---------------------------------------------------------------- buckets and payloads


@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Same fields as sglang's `weight_sync.tensor_bucket.FlattenedTensorMetadata`.

    Pickled as a `types.SimpleNamespace` with those fields: SGLang only reads the attributes, and
    its unpickler's allow-list takes a SimpleNamespace but not a class of ours, so one payload
    serves both engines without the sender importing sglang.
    """
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int

    def __reduce__(self):
        return types.SimpleNamespace, (), dict(vars(self))


def tensor_nbytes(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()


def bucket_named_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]],
                         bucket_bytes: int) -> Iterable[list[tuple[str, torch.Tensor]]]:
    """Group tensors, in order, into buckets of at most `bucket_bytes` (a bigger tensor travels alone).

    Lazy: a bucket is yielded as soon as it is full, so a generator of gathered parameters is
    consumed (and its memory released) bucket by bucket.
    """
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be positive, got {bucket_bytes}")
    current: list[tuple[str, torch.Tensor]] = []
    current_bytes = 0
    for name, tensor in named_tensors:
        size = tensor_nbytes(tensor)
        if current and current_bytes + size > bucket_bytes:
            yield current
            current, current_bytes = [], 0
        current.append((name, tensor))
        current_bytes += size
    if current:
        yield current


def flatten_bucket(bucket: Sequence[tuple[str, torch.Tensor]], out: torch.Tensor | None = None) -> dict:
    """SGLang's flattened-bucket payload: one uint8 buffer plus metadata.

    Each tensor starts at a multiple of 16 bytes, so the receiver can view its bytes as any
    dtype. With `out` (a uint8 buffer at least `flattened_nbytes(bucket)` long) the bytes are
    written there, so a shared-memory staging buffer serves bucket after bucket.
    """
    metadata, offset = [], 0
    for name, tensor in bucket:
        size = tensor_nbytes(tensor)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + size,
                                                tensor.numel()))
        offset = _aligned(offset + size)
    flat = out[:offset] if out is not None else torch.empty(offset, dtype=torch.uint8, device=_device_of(bucket))
    for (_, tensor), meta in zip(bucket, metadata):
        flat[meta.start_idx:meta.end_idx].copy_(tensor.detach().contiguous().view(-1).view(torch.uint8))
    return {"flattened_tensor": flat, "metadata": metadata}


def flattened_nbytes(bucket: Sequence[tuple[str, torch.Tensor]]) -> int:
    total = 0
    for _, tensor in bucket:
        total = _aligned(total + tensor_nbytes(tensor))
    return total


def _aligned(offset: int, alignment: int = 16) -> int:
    return -(-offset // alignment) * alignment


def _device_of(bucket: Sequence[tuple[str, torch.Tensor]]) -> torch.device:
    return bucket[0][1].device if bucket else torch.device("cpu")


def unflatten_bucket(payload: dict) -> list[tuple[str, torch.Tensor]]:
    """Views of each tensor inside a flattened bucket (no copy)."""
    flat = payload["flattened_tensor"]
    return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in payload["metadata"]]


def update_tensor_payload(serialized: str, tp_size: int, is_last: bool, weight_version: str | None,
                          flush_cache: bool = True) -> dict[str, Any]:
    """Body of /update_weights_from_tensor for one bucket.

    Every TP rank reads its own entry; on one node all can open the same handles. The cache is
    flushed only with the last bucket (a refused flush reports success=false although the
    weights loaded), and never while paused requests are in flight (SGLang asserts then); the
    version moves only once every bucket is in.
    """
    payload: dict[str, Any] = {"serialized_named_tensors": [serialized] * tp_size,
                               "load_format": "flattened_bucket", "flush_cache": is_last and flush_cache}
    if is_last and weight_version is not None:
        payload["weight_version"] = weight_version
    return payload


# ---------------------------------------------------------------- serialisation


_TORCH_NAMES = {"Size", "Tensor", "UntypedStorage", "device"}
_ALLOWED_MODULES = ("torch.multiprocessing.reductions", "torch._utils", "torch.storage")
_ALLOWED_GLOBALS = {("copyreg", "__newobj__"), ("copyreg", "_reconstructor"), ("builtins", "object"),
                    ("collections", "OrderedDict"), ("multiprocessing.resource_sharer", "DupFd"),
                    ("types", "SimpleNamespace")}


class _TensorUnpickler(pickle.Unpickler):
    """Unpickles tensors and flattened-bucket metadata only (like sglang's SafeUnpickler)."""

    def find_class(self, module: str, name: str):
        if name == "FlattenedTensorMetadata":
            return FlattenedTensorMetadata  # sglang's class maps onto ours, so sglang is not needed
        if module == "torch" and (name in _TORCH_NAMES or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if module.startswith(_ALLOWED_MODULES) or (module, name) in _ALLOWED_GLOBALS:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"refusing to unpickle {module}.{name}: not a tensor payload")


@contextlib.contextmanager
def _file_system_sharing():
    """CPU tensors shared through named shared-memory files, not file descriptors: the default fd
    strategy needs the receiver to share this process's multiprocessing authkey, which a
    separately launched server does not."""
    import torch.multiprocessing as torch_mp

    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        torch_mp.set_sharing_strategy(previous)


def serialize_for_engine(obj) -> str:
    """ForkingPickler + base64, as sglang's `MultiprocessingSerializer.serialize(obj, output_str=True)`.

    Handles, not bytes: keep the tensors alive and unchanged until the HTTP call returns.
    """
    import torch.multiprocessing.reductions  # noqa: F401  registers the tensor reducers
    from multiprocessing.reduction import ForkingPickler

    with _file_system_sharing():
        data = bytes(ForkingPickler.dumps(obj))
    return base64.b64encode(data).decode("ascii")


def shared_cpu_buffer(nbytes: int) -> torch.Tensor:
    """A uint8 CPU buffer in shared memory that `serialize_for_engine` sends without copying."""
    with _file_system_sharing():
        return torch.empty(nbytes, dtype=torch.uint8).share_memory_()


def start_shared_memory_manager_off_stderr() -> None:
    """Have torch start this process's shared-memory manager now, with its stderr on /dev/null.

    torch forks `torch_shm_manager` at a process's first file_system share, and the manager inherits stderr.
    It outlives its last client by 2 s (libshm's SHUTDOWN_TIMEOUT), so whatever read a job's output to its
    end (`| tee`, a test's pipe) waited 2 s after the job had ended, at every launch. The manager writes
    nothing there (it hands torch its address through a pipe of its own). Call it before the first share,
    where no other thread writes to stderr: for those few milliseconds fd 2 is /dev/null; once started, a
    manager is reused and this costs one 1-byte share."""
    with _stderr_on_devnull(), _file_system_sharing():
        torch.empty(1, dtype=torch.uint8).share_memory_()


@contextlib.contextmanager
def _stderr_on_devnull() -> Iterator[None]:
    """fd 2 on /dev/null inside the block, restored after it (a process without an fd 2 is left as it is)."""
    try:
        saved = os.dup(2)
    except OSError:  # no stderr: nothing for a child to inherit
        yield
        return
    if sys.stderr is not None:
        sys.stderr.flush()
    devnull = os.open(os.devnull, os.O_WRONLY)
    try:
        os.dup2(devnull, 2)
        yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        os.close(devnull)


def deserialize_for_engine(serialized: str) -> Any:
    """Inverse of `serialize_for_engine` (tensor payloads only)."""
    import torch.multiprocessing.reductions  # noqa: F401

    return _TensorUnpickler(io.BytesIO(base64.b64decode(serialized))).load()


def sglang_encode_bucket(bucket: list[tuple[str, torch.Tensor]]) -> str:
    """A bucket as real SGLang reads it: its own FlattenedTensorBucket (its unpickler allows only its
    classes) and MultiprocessingSerializer (CUDA IPC handles keyed by GPU UUID)."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorBucket

    monkey_patch_torch_reductions()  # GPU UUIDs instead of indices, so CUDA_VISIBLE_DEVICES may differ
    flat = FlattenedTensorBucket(named_tensors=bucket)
    payload = {"flattened_tensor": flat.get_flattened_tensor(), "metadata": flat.get_metadata()}
    return MultiprocessingSerializer.serialize(payload, output_str=True)


# ---------------------------------------------------------------- push


class WeightPusher:
    """Streams one rank's full weights into its engine, bucket by bucket, in the engine's dtype.

    GPU buckets are packed on the device and travel as CUDA IPC handles (the server copies them).
    CPU buckets are packed into shared-memory staging buffers that the embedded engine keeps
    serving from: it adopts the received tensors as its weights instead of copying them, so a
    push costs one copy of the weights (the packing). Pushes therefore alternate between two
    sets of staging buffers: a set is rewritten only two pushes later, when the engine has
    replaced every tensor that lived in it (it copies out any it still holds from an older
    session, see the server's `/end_weight_update`). `encode` (a bucket -> its payload) replaces
    this with an engine's own format: SGLang's for CUDA buckets (`sglang_encode_bucket`).

    `rename` gives each tensor the served model's checkpoint name (a Qwen2/2.5-VL's differ from the trainer's:
    `workers.loading.model_checkpoint_renamer`); text models' names go as they are.
    """

    def __init__(self, dtype: torch.dtype, bucket_bytes: int = DEFAULT_BUCKET_BYTES, tp_size: int = 1,
                 encode: Callable[[list[tuple[str, torch.Tensor]]], str] | None = None,
                 rename: Callable[[str], str] | None = None):
        self.dtype = dtype
        self.bucket_bytes = bucket_bytes
        self.tp_size = tp_size
        self.encode = encode
        self.rename = rename
        self._staging: tuple[list[torch.Tensor], list[torch.Tensor]] = ([], [])  # per push parity, per bucket
        self._pushes = 0

    def _staging_buffer(self, parity: int, index: int, nbytes: int) -> torch.Tensor:
        if not any(self._staging):  # this process's first share: the job's first push, nothing else running yet
            start_shared_memory_manager_off_stderr()
        buffers = self._staging[parity]
        if index == len(buffers):
            buffers.append(shared_cpu_buffer(nbytes))
        elif buffers[index].numel() < nbytes:
            buffers[index] = shared_cpu_buffer(nbytes)
        return buffers[index]

    def _flatten(self, bucket: list[tuple[str, torch.Tensor]], parity: int, index: int) -> str:
        """A bucket as the embedded engine reads it: flattened (CPU: into a shared staging buffer)."""
        out = None if bucket[0][1].is_cuda else self._staging_buffer(parity, index, flattened_nbytes(bucket))
        return serialize_for_engine(flatten_bucket(bucket, out=out))

    def _cast(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.to(self.dtype) if tensor.is_floating_point() else tensor

    def payloads(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: str,
                 flush_cache: bool = True) -> Iterator[tuple[dict[str, Any], int, float]]:
        """One `/update_weights_from_tensor` body per bucket, in order (`version` and the cache flush with the last),
        each with its tensors' bytes and the seconds its packing took. The caller sends each before asking for the
        next: a CUDA bucket is collected only once the engine has answered for it."""
        parity = self._pushes % 2
        self._pushes += 1
        rename = self.rename or (lambda name: name)
        casted = ((rename(name), self._cast(tensor)) for name, tensor in named_tensors)
        for index, (bucket, is_last) in enumerate(_with_last(bucket_named_tensors(casted, self.bucket_bytes))):
            packing = time.perf_counter()
            on_gpu = bucket[0][1].is_cuda
            serialized = self.encode(bucket) if self.encode is not None else self._flatten(bucket, parity, index)
            if on_gpu:
                torch.cuda.synchronize()  # the receiver reads the tensors through IPC: they must be written
            pack_s = time.perf_counter() - packing
            yield (update_tensor_payload(serialized, self.tp_size, is_last, version, flush_cache),
                   sum(tensor_nbytes(t) for _, t in bucket), pack_s)
            if on_gpu:
                torch.cuda.ipc_collect()  # the server answered: it holds no more references to this bucket


def _with_last(buckets: Iterable[list]) -> Iterator[tuple[list, bool]]:
    """(bucket, is_last) pairs; a bucket is known to be last once the source is exhausted."""
    previous = None
    for bucket in buckets:
        if previous is not None:
            yield previous, False
        previous = bucket
    if previous is not None:
        yield previous, True


# ---------------------------------------------------------------- check


@dataclasses.dataclass(frozen=True)
class Probe:
    """The fixed prompt engine and trainer must score alike after every push: `ids` as the trainer runs them. A
    vision-language policy's probe shows one image (its weight push carries the vision tower, which only an image
    exercises): the engine is sent `engine_ids` (one image pad) with `image_data` and expands the pad itself;
    `images` holds the processor's `pixel_values` and `image_grid_thw` for the trainer; `image_pad_id` marks the
    positions whose input logprobs mean nothing (the image's own: SGLang names token 0 there)."""
    ids: list[int]
    engine_ids: list[int]
    image_data: list[str] | None = None
    images: dict[str, torch.Tensor] | None = None
    image_pad_id: int | None = None

    @classmethod
    def text(cls, ids: Sequence[int]) -> "Probe":
        return cls([int(i) for i in ids], [int(i) for i in ids])

    def compared(self) -> list[bool]:
        """For each token after the first: whether its logprob is compared (every one but an image pad)."""
        return [token != self.image_pad_id for token in self.ids[1:]]

    def request(self) -> dict[str, Any]:
        """The `/generate` body: prefill only, every prompt token's logprob from raw logits."""
        body = {"input_ids": self.engine_ids, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}
        return body if self.image_data is None else {**body, "image_data": self.image_data}

    def gap(self, answer: dict, version: str, trainer_logprobs: Sequence[float], tolerance: float, url: str) -> float:
        """The mean |logprob gap| between the engine's `answer` to `request()` and the trainer (over the compared
        tokens: all but an image's pads); WeightSyncError unless the answer comes from `version` within
        `tolerance`."""
        meta = (answer or {}).get("meta_info") or {}
        if str(meta.get("weight_version")) != str(version):
            raise WeightSyncError(f"engine {url} reports weight_version {meta.get('weight_version')!r} after the push "
                                  f"of version {version!r}")
        entries = meta.get("input_token_logprobs") or []
        if len(entries) != len(self.ids) or any(int(entry[1]) != token for entry, token in zip(entries, self.ids)
                                                if token != self.image_pad_id):
            raise WeightSyncError(f"engine {url} answered the weight probe with other input logprobs than one for "
                                  f"each of its {len(self.ids)} tokens")
        gaps = [abs(float(entry[0]) - trainer) for entry, trainer, compared
                in zip(entries[1:], trainer_logprobs, self.compared()) if compared]  # the first has none (null)
        gap = sum(gaps) / max(len(gaps), 1)
        if not gap <= tolerance:  # also catches NaN
            raise WeightSyncError(f"engine {url} disagrees with the trainer after the push of version {version!r}: "
                                  f"mean |logprob gap| {gap:.4f} on the probe > tolerance {tolerance:g} "
                                  "(rollout.weight_check_tolerance); the engine's weights are not the trainer's")
        return gap


def probe_token_ids(tokenizer, min_tokens: int = 8) -> list[int]:
    """A fixed, tokenizer-independent-length probe sequence (the text, repeated if it is short)."""
    ids = tokenizer.encode(PROBE_TEXT, add_special_tokens=False)
    while len(ids) < min_tokens:
        ids = ids + ids
    return [int(i) for i in ids[:64]]
