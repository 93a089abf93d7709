"""FSDP2 plumbing for the trainers on every rank: sharding, full weights, one trainable model.

Loss-scaling rule (the caller applies it): ranks hold different numbers of sequences after
balancing, so each rank sums its losses, divides by the *global* count and multiplies by
``dp_size``; FSDP averages gradients over ranks, so the result equals the single-process
gradient of the whole minibatch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable, Iterator

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, get_state_dict, set_state_dict
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor

MIXED_PRECISION_DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16}

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


# --------------------------------------------------------------------------- sharding


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
    if (mesh.size() if mesh is not None else dist.get_world_size()) == 1:
        # One rank holds every parameter whole anyway: freeing them after each forward only to gather (copy)
        # them again for the backward costs time and saves nothing but that copy's memory. (Several ranks keep
        # FSDP's default, which already leaves the root's parameters gathered.)
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


# --------------------------------------------------------------------------- trainable model


def _check_same_count_on_all_ranks(count: int) -> None:
    """Each backward is a collective, so every rank must run the same number of micro-batches."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend() == "nccl" else None
    counts = torch.tensor([count, -count], dtype=torch.int64, device=device)
    dist.all_reduce(counts, op=dist.ReduceOp.MAX)
    if counts[0].item() != count or -counts[1].item() != count:
        raise ValueError(f"ranks hold different numbers of micro-batches (this rank {count}, max "
                         f"{counts[0].item()}, min {-counts[1].item()}); balance into a multiple of dp_size")


def read_back(metrics: dict[str, list]) -> dict[str, list[float]]:
    """The metrics as floats, every tensor among them read back to the host in one transfer per device: on a
    GPU each read is a sync that stalls the host until the device is done, so one per metric and micro-batch
    (about 40 a PPO step) left the GPU idle between launches."""
    tensors = [(key, k, value.full_tensor() if isinstance(value, DTensor) else value)
               for key, values in metrics.items() for k, value in enumerate(values) if isinstance(value, torch.Tensor)]
    out = {key: [float(v) if not isinstance(v, torch.Tensor) else None for v in values] for key, values in metrics.items()}
    for device in {value.device for _, _, value in tensors}:
        mine = [(key, k, value) for key, k, value in tensors if value.device == device]
        for (key, k, _), number in zip(mine, torch.stack([v.float().reshape(()) for _, _, v in mine]).tolist()):
            out[key][k] = number
    return out


class TrainableModel:
    """A sharded model with its optimizer, LR schedule and gradient clipping.

    Build the optimizer *after* sharding, so it holds the sharded (DTensor) parameters.
    """

    def __init__(
        self,
        model: nn.Module,
        build_optimizer: Callable[[nn.Module], torch.optim.Optimizer],
        build_scheduler: Callable[[torch.optim.Optimizer], Any] | None = None,
        max_grad_norm: float | None = 1.0,
        sharded: bool = True,
    ):
        self.model = model
        # An unsharded model (e.g. the RM bootstrap inside another job's process group) must not
        # run the cross-rank micro-batch check: the other ranks are not training it.
        self.sharded = sharded
        self.optimizer = build_optimizer(model)
        self.scheduler = build_scheduler(self.optimizer) if build_scheduler is not None else None
        self.max_grad_norm = max_grad_norm

    def forward_backward(self, micro_batches: Iterable[dict[str, torch.Tensor]], loss_fn: LossFn) -> dict[str, list]:
        """Accumulate gradients over micro-batches; ``loss_fn`` returns an already-scaled loss.

        Returns each metric as a list with one entry per micro-batch (``loss`` included), tensors left where
        they were computed: the caller reads a whole step's numbers back at once (`read_back`).
        """
        micro_batches = list(micro_batches)
        if self.sharded:
            _check_same_count_on_all_ranks(len(micro_batches))
        self.model.train()
        metrics: dict[str, list] = {}
        for micro_batch in micro_batches:
            loss, micro_metrics = loss_fn(self.model, micro_batch)
            loss.backward()
            for key, value in {"loss": loss, **micro_metrics}.items():
                metrics.setdefault(key, []).append(value.detach() if isinstance(value, torch.Tensor) else value)
        return metrics

    def step(self) -> torch.Tensor:
        """Clip, step optimizer and schedule, zero grads; returns the pre-clip global grad norm (a 0-dim tensor
        on the device, unread).

        A non-finite norm skips the update (the gradients are dropped) rather than corrupting weights. The
        skip is decided on the device (the optimizer's `found_inf`, the flag torch's fused Adam/AdamW and
        `TFAdam` honour): deciding it on the host would stall a GPU at every optimizer step.
        """
        max_norm = self.max_grad_norm if self.max_grad_norm is not None else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm)
        if isinstance(grad_norm, DTensor):
            grad_norm = grad_norm.full_tensor()
        if getattr(self.optimizer, "_step_supports_amp_scaling", False):
            self.optimizer.found_inf = (~torch.isfinite(grad_norm)).float()
            self.optimizer.step()
        elif torch.isfinite(grad_norm):  # an optimizer without `found_inf` (e.g. a plain SGD): decided on the host
            self.optimizer.step()
        if self.scheduler is not None:
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return grad_norm.detach()

    def current_lr(self) -> float:
        return float(self.optimizer.param_groups[0]["lr"])

    def state_dict(self) -> dict[str, Any]:
        """Sharded model + optimizer (+ scheduler) state, ready for ``dcp.save`` / as a ``dcp.load`` template."""
        model_state, optim_state = get_state_dict(self.model, self.optimizer)
        state: dict[str, Any] = {"model": model_state, "optimizer": optim_state}
        if self.scheduler is not None:
            state["scheduler"] = self.scheduler.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        if self.scheduler is not None and "scheduler" in state:
            self.scheduler.load_state_dict(state["scheduler"])

    def save_checkpoint(self, checkpoint_dir: str) -> None:
        """Collective: every rank writes its shards with torch.distributed.checkpoint."""
        dcp.save(self.state_dict(), checkpoint_id=checkpoint_dir)

    def load_checkpoint(self, checkpoint_dir: str) -> None:
        """Collective: reshards on load, so the world size may differ from the one that saved."""
        state = self.state_dict()
        dcp.load(state, checkpoint_id=checkpoint_dir)
        self.load_state_dict(state)
