"""FSDP2 plumbing for the trainers on every rank: sharding, and the full weights back from the shards.

The sharded model's optimizer, gradient accumulation and checkpoints are `workers/trainable.py`'s; a step's
metrics read back to the host, `workers/read_back.py`'s.
"""

from __future__ import annotations

from typing import Any, Iterator

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor


MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}


def find_transformer_blocks(model: nn.Module) -> list[nn.Module]:
    """The repeated transformer blocks: HF's ``_no_split_modules`` classes, else the largest ModuleList."""
    block_names: set[str] = set()
    for module in model.modules():
        block_names.update(getattr(module, "_no_split_modules", None) or ())
    blocks = [module for module in model.modules() if type(module).__name__ in block_names]
    if blocks:
        return blocks
    module_lists = [module for module in model.modules() if isinstance(module, nn.ModuleList) and len(module) > 0]
    if not module_lists:
        raise ValueError(f"found no transformer blocks in {type(model).__name__}: it has no ModuleList "
                         "and no _no_split_modules; shard it as a single unit with blocks=[]")
    largest = max(module_lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))
    return list(largest)


def _fsdp_options(mixed_precision: str | None, cpu_offload: bool) -> dict[str, Any]:
    options: dict[str, Any] = {}
    if mixed_precision is not None:
        if mixed_precision not in MIXED_PRECISION_DTYPES:
            raise ValueError(f"mixed_precision={mixed_precision!r}; choose one of "
                             f"{sorted(MIXED_PRECISION_DTYPES)} or None")
        # Gradients are reduced in float32: summing many low-precision shards loses accuracy.
        options["mp_policy"] = MixedPrecisionPolicy(
            param_dtype=MIXED_PRECISION_DTYPES[mixed_precision], reduce_dtype=torch.float32
        )
    if cpu_offload:
        options["offload_policy"] = CPUOffloadPolicy()
    return options


def shard_model(
    model: nn.Module,
    mesh=None,
    mixed_precision: str | None = None,
    cpu_offload: bool = False,
    blocks: list[nn.Module] | None = None,
) -> nn.Module:
    """FSDP2: ``fully_shard`` each transformer block, then the root (which holds embeddings and heads).

    ``mesh=None`` uses the default 1-D mesh over all ranks. Works on CPU with gloo.
    """
    if not dist.is_initialized():
        raise RuntimeError("shard_model needs a process group; call init_distributed() first")
    if cpu_offload and not torch.cuda.is_available():
        raise ValueError("cpu_offload=True only makes sense with a GPU; set it to False on CPU")
    options = _fsdp_options(mixed_precision, cpu_offload)
    if mesh is not None:
        options["mesh"] = mesh
    trained = {p.requires_grad for p in model.parameters()}
    if (mesh.size() if mesh is not None else dist.get_world_size()) == 1 and len(trained) == 1:
        # One rank holds every parameter whole anyway: freeing them after each forward only to gather (copy)
        # them again for the backward costs time and saves nothing but that copy's memory. (Several ranks keep
        # FSDP's default, which already leaves the root's parameters gathered.) Not with frozen and trained
        # weights mixed (a LoRA actor, whose reference pass switches the adapters off and on): there the first
        # backward's reshard left sharded adapters without requires_grad, and the next micro-batch failed with
        # "element 0 of tensors does not require grad" (tests/ppo/test_lora.py, one rank).
        options["reshard_after_forward"] = False
    for block in find_transformer_blocks(model) if blocks is None else blocks:
        fully_shard(block, **options)
    fully_shard(model, **options)
    return model


def iter_full_tensors(model: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield ``(hf_name, full tensor)`` one parameter at a time, on the model's device, on every rank.

    Gathering tensor by tensor keeps the memory peak at one full parameter, which is what
    streaming weights into an engine needs. Tied weights (GPT-2's ``lm_head`` = ``wte``) come
    once, under their first name. Collective: every rank must consume the whole iterator.
    """
    seen: set[int] = set()
    for name, tensor in get_model_state_dict(model).items():
        if id(tensor) in seen:
            continue
        seen.add(id(tensor))
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        yield name, tensor.detach()


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """Unsharded CPU state dict with Hugging Face names, on every rank (collective)."""
    state = {}
    for name, tensor in get_model_state_dict(model).items():
        if isinstance(tensor, DTensor):
            tensor = tensor.full_tensor()
        state[name] = tensor.detach().cpu()
    return state
