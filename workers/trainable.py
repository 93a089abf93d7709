"""One trainable model on every rank: a sharded model with its optimizer, LR schedule and gradient clipping, its
gradients accumulated over micro-batches, its checkpoints.

Loss-scaling rule (the caller applies it): ranks hold different numbers of sequences after
balancing, so each rank sums its losses, divides by the *global* count and multiplies by
``dp_size``; FSDP averages gradients over ranks, so the result equals the single-process
gradient of the whole minibatch.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor

LossFn = Callable[[nn.Module, dict[str, torch.Tensor]], tuple[torch.Tensor, dict[str, float]]]


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
