"""LoRA adapters on a causal LM (PEFT), and the merged full weights an engine serves.

`lora` arguments are a job's `model.lora` section: `rank` (0 = no adapters), `alpha`, `dropout`,
`target_modules` (None = PEFT's default for the architecture).
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch
from torch import nn

PEFT_PREFIX = "base_model.model."  # PeftModel's state-dict names: the wrapped model's under this prefix


def with_lora(model: nn.Module, lora, checkpointing: bool = False) -> nn.Module:
    """`model` with LoRA adapters on `lora.target_modules` and its other weights frozen, or `model`
    itself when `lora.rank` is 0."""
    if not lora.rank:
        return model
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    conv1d = any(isinstance(module, Conv1D) for module in model.modules())  # GPT-2 stores weights transposed
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout, task_type="CAUSAL_LM",
                        target_modules=list(lora.target_modules) if lora.target_modules else None,
                        fan_in_fan_out=conv1d)
    if checkpointing:
        model.enable_input_require_grads()  # checkpointed blocks need an input that requires grad
    try:
        return get_peft_model(model, config)
    except ValueError as err:  # PEFT knows no default target for this architecture, or a name is wrong
        raise ValueError(f"model.lora: {err}; set model.lora.target_modules to the names of the linear "
                         "layers to adapt") from err


def merged_weights(model: nn.Module, named_tensors: Iterable[tuple[str, torch.Tensor]]
                   ) -> Iterator[tuple[str, torch.Tensor]]:
    """The full tensors of a LoRA model (`model`'s own, e.g. gathered one at a time from its shards)
    as the plain model's: each adapted weight becomes W + scaling * B @ A under the base model's name.

    Written here rather than PEFT's `merge_and_unload` because that merges into the module's own
    weights, which under FSDP are the sharded training weights; this merges copies on their way to
    the engine and leaves training untouched.
    """
    from peft.tuners.lora import LoraLayer

    layers = {name.removeprefix(PEFT_PREFIX): module for name, module in model.named_modules()
              if isinstance(module, LoraLayer)}
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named_tensors:
        name = name.removeprefix(PEFT_PREFIX)
        if ".lora_A." in name or ".lora_B." in name:
            layer, _, rest = name.partition(".lora_")
            parts = pending.setdefault(layer, {})
            parts[rest[0]] = tensor  # "A" or "B"
        elif ".base_layer." in name:
            layer, _, leaf = name.partition(".base_layer.")
            if leaf != "weight":
                yield f"{layer}.{leaf}", tensor
                continue
            parts = pending.setdefault(layer, {})
            parts["W"] = tensor
        elif "lora_" in name:
            raise ValueError(f"model.lora: cannot merge {name!r} for the engine (only LoRA on linear layers is "
                             "supported); set model.lora.target_modules to linear layers")
        else:
            yield name, tensor
            continue
        if len(parts) == 3:
            del pending[layer]
            yield f"{layer}.weight", _merge(parts["W"], parts["A"], parts["B"], layers[layer])
    if pending:
        raise RuntimeError(f"LoRA layers with missing parts: {sorted(pending)}")


def _merge(weight: torch.Tensor, a: torch.Tensor, b: torch.Tensor, layer) -> torch.Tensor:
    delta = (b.float() @ a.float()) * layer.scaling["default"]
    if layer.fan_in_fan_out:  # Conv1D stores [in, out]
        delta = delta.T
    return (weight.float() + delta).to(weight.dtype)
