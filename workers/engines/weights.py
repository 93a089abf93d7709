"""Weight sync for the embedded engine, and the tensor (de)serialisation both engines share.

The trainer writes its full state dict as one safetensors file in /dev/shm (RAM, not disk),
asks the engine to load it with `/update_weights_from_disk`, then compares a checksum the
engine computes on its live weights with the one computed here on what was sent.

Checksum: each tensor is upcast to float32 and hashed (sha256 over its bytes and shape);
the checksum is the sha256 of the sorted set of those digests. Any tensor that was not
updated changes its digest, so a partial update is detected. Names are not hashed and equal
tensors count once, so tied weights (GPT-2 `lm_head` = `wte`) match whether a side stores them
once or twice; the price is that swapping two equal-shape tensors between names would go
unnoticed. Cost is one pass over the bytes (~30 ms for 4M float32 parameters).
"""

from __future__ import annotations

import asyncio
import base64
import dataclasses
import hashlib
import io
import os
import pickle
import time
from pathlib import Path
from typing import Iterable, Mapping

import torch

DEFAULT_SHM_DIR = "/dev/shm"


class WeightSyncError(RuntimeError):
    """An engine did not end up with the weights that were sent."""


# ---------------------------------------------------------------- checksum

def _named_tensors(state_dict_or_model) -> Iterable[tuple[str, torch.Tensor]]:
    if isinstance(state_dict_or_model, torch.nn.Module):
        return state_dict_or_model.state_dict().items()
    return state_dict_or_model.items()


def tensor_digest(tensor: torch.Tensor) -> str:
    """sha256 of a tensor's float32 values and shape (dtype-independent for exact upcasts)."""
    values = tensor.detach().to("cpu", torch.float32).contiguous()
    digest = hashlib.sha256(str(tuple(values.shape)).encode())
    digest.update(values.view(torch.uint8).numpy().tobytes() if values.numel() else b"")
    return digest.hexdigest()


def weights_checksum(state_dict_or_model) -> str:
    """Deterministic checksum of a model's or state dict's tensors (see module docstring)."""
    digests = sorted({tensor_digest(tensor) for _, tensor in _named_tensors(state_dict_or_model)})
    return hashlib.sha256("".join(digests).encode()).hexdigest()


# ---------------------------------------------------------------- files

def unique_tensors(state_dict: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop names whose tensor shares storage with an earlier one (safetensors refuses aliases)."""
    seen: set[tuple[int, int]] = set()
    out: dict[str, torch.Tensor] = {}
    for name in sorted(state_dict):
        tensor = state_dict[name]
        key = (tensor.untyped_storage().data_ptr(), tensor.storage_offset()) if tensor.numel() else (id(tensor), 0)
        if key in seen:
            continue
        seen.add(key)
        out[name] = tensor.detach().to("cpu").contiguous()
    return out


def write_weights_to_shm(state_dict: Mapping[str, torch.Tensor], path: str | Path) -> Path:
    """Write `state_dict` as safetensors at `path` atomically (tmp file, then rename)."""
    from safetensors.torch import save_file

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp_path = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        save_file(unique_tensors(state_dict), str(tmp_path))
        os.replace(tmp_path, path)  # readers see the old file or the whole new one, never half
    finally:
        tmp_path.unlink(missing_ok=True)
    return path


def read_weight_files(model_path: str | Path) -> dict[str, torch.Tensor]:
    """Load a `.safetensors` file, or every `*.safetensors` (else `*.bin`) file in a HF directory."""
    from safetensors.torch import load_file

    model_path = Path(model_path)
    if model_path.is_file():
        if model_path.suffix == ".safetensors":
            return load_file(str(model_path))
        return torch.load(model_path, map_location="cpu", weights_only=True)
    if not model_path.is_dir():
        raise FileNotFoundError(f"weights not found: {model_path} is neither a file nor a directory")
    files = sorted(model_path.glob("*.safetensors"))
    if files:
        return {k: v for f in files for k, v in load_file(str(f)).items()}
    files = sorted(model_path.glob("*.bin"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors or *.bin weight files in {model_path}")
    return {k: v for f in files for k, v in torch.load(f, map_location="cpu", weights_only=True).items()}


def load_into_model(model: torch.nn.Module, state_dict: Mapping[str, torch.Tensor]) -> int:
    """Copy `state_dict` into `model` in place; every model tensor must be covered (tied aliases excepted)."""
    own = model.state_dict()
    unexpected = sorted(set(state_dict) - set(own))
    if unexpected:
        raise ValueError(f"weights contain names the model does not have: {unexpected[:5]} "
                         f"(model names look like {sorted(own)[:3]}); strip wrapper prefixes before sending")
    loaded_storage = {own[name].untyped_storage().data_ptr() for name in state_dict}
    missing = [name for name in own if name not in state_dict
               and own[name].untyped_storage().data_ptr() not in loaded_storage]
    if missing:
        raise ValueError(f"weights miss {len(missing)} model tensors, e.g. {missing[:5]}; send the full state dict")
    with torch.no_grad():
        for name, tensor in state_dict.items():
            target = own[name]
            if tuple(target.shape) != tuple(tensor.shape):
                raise ValueError(f"shape mismatch for {name}: model {tuple(target.shape)}, sent {tuple(tensor.shape)}")
            target.copy_(tensor.to(target.device, target.dtype))
    return len(state_dict)


# ---------------------------------------------------------------- tensor payloads (/update_weights_from_tensor)

@dataclasses.dataclass
class FlattenedTensorMetadata:
    """Same fields as sglang's `weight_sync.tensor_bucket.FlattenedTensorMetadata`."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start_idx: int
    end_idx: int
    numel: int


_TORCH_NAMES = {"Size", "Tensor", "UntypedStorage", "device"}
_ALLOWED_MODULES = ("torch.multiprocessing.reductions", "torch._utils", "torch.storage")
_ALLOWED_GLOBALS = {("copyreg", "__newobj__"), ("copyreg", "_reconstructor"), ("builtins", "object"),
                    ("collections", "OrderedDict"), ("multiprocessing.resource_sharer", "DupFd")}


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


def serialize_for_engine(obj) -> str:
    """ForkingPickler + base64, as sglang's `MultiprocessingSerializer.serialize(obj, output_str=True)`.

    CPU tensors go through shared-memory files (`file_system` strategy): the default fd strategy
    needs the receiver to share this process's multiprocessing authkey, which a separately
    launched server does not. Keep the tensors alive until the HTTP call returns.
    """
    import torch.multiprocessing as torch_mp
    import torch.multiprocessing.reductions  # noqa: F401  registers the tensor reducers
    from multiprocessing.reduction import ForkingPickler

    previous = torch_mp.get_sharing_strategy()
    torch_mp.set_sharing_strategy("file_system")
    try:
        data = bytes(ForkingPickler.dumps(obj))
    finally:
        torch_mp.set_sharing_strategy(previous)
    return base64.b64encode(data).decode("ascii")


def flatten_bucket(named_tensors: list[tuple[str, torch.Tensor]]) -> dict:
    """One uint8 buffer plus metadata, the shape of sglang's `FlattenedTensorBucket` payload."""
    metadata, chunks, offset = [], [], 0
    for name, tensor in named_tensors:
        data = tensor.detach().contiguous().view(-1).view(torch.uint8)
        metadata.append(FlattenedTensorMetadata(name, tensor.shape, tensor.dtype, offset, offset + data.numel(),
                                                tensor.numel()))
        chunks.append(data)
        offset += data.numel()
    return {"flattened_tensor": torch.cat(chunks) if chunks else torch.empty(0, dtype=torch.uint8),
            "metadata": metadata}


def deserialize_named_tensors(serialized: str) -> list[tuple[str, torch.Tensor]]:
    """Inverse of `serialize_for_engine` for a `(name, tensor)` list or a flattened bucket dict."""
    import torch.multiprocessing.reductions  # noqa: F401

    obj = _TensorUnpickler(io.BytesIO(base64.b64decode(serialized))).load()
    if isinstance(obj, dict) and "flattened_tensor" in obj:
        flat = obj["flattened_tensor"]
        return [(m.name, flat[m.start_idx:m.end_idx].view(m.dtype).reshape(m.shape)) for m in obj["metadata"]]
    return [(name, tensor) for name, tensor in obj]


# ---------------------------------------------------------------- sync

async def verify_weights(client, expected_checksum: str, version: str) -> None:
    """Raise WeightSyncError unless the engine reports `version` and `expected_checksum`."""
    reply = await client.weights_checksum()
    if reply.get("weight_version") != version:
        raise WeightSyncError(f"engine {client.base_url} reports weight_version "
                              f"{reply.get('weight_version')!r} after loading version {version!r}")
    if reply.get("checksum") != expected_checksum:
        raise WeightSyncError(f"engine {client.base_url} weights checksum {reply.get('checksum')} != "
                              f"sent {expected_checksum} for version {version!r}: the update was partial or wrong")


async def sync_weights(client, state_dict: Mapping[str, torch.Tensor], version: str,
                       shm_dir: str | Path = DEFAULT_SHM_DIR, dtype: torch.dtype | None = None,
                       file_name: str | None = None) -> dict:
    """Push `state_dict` to an embedded engine through a /dev/shm file and verify it landed.

    `client` is an `EngineClient` for one engine (not the router). Tensors are cast to the
    engine's dtype first (asked from /get_server_info unless `dtype` is given) so both sides
    hash the same values. Returns timings; raises WeightSyncError on a version or checksum mismatch.
    """
    started = time.perf_counter()
    if dtype is None:
        dtype = getattr(torch, (await client.server_info()).get("dtype", "float32"))
    tensors = {name: t.detach().to("cpu", dtype) if t.is_floating_point() else t.detach().to("cpu")
               for name, t in unique_tensors(state_dict).items()}
    path = Path(shm_dir) / (file_name or f"rl_weights_{os.getpid()}_{abs(hash(client.base_url))}.safetensors")
    write_weights_to_shm(tensors, path)
    written = time.perf_counter()
    expected = asyncio.create_task(asyncio.to_thread(weights_checksum, tensors))  # overlaps the engine's load
    try:
        await client.update_weights_from_disk(str(path), version)
    except BaseException:
        expected.cancel()
        raise
    finally:
        path.unlink(missing_ok=True)
    loaded = time.perf_counter()
    await verify_weights(client, await expected, version)
    return {"write_s": written - started, "load_s": loaded - written,
            "verify_s": time.perf_counter() - loaded, "total_s": time.perf_counter() - started,
            "num_tensors": len(tensors)}
