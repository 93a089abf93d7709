"""One trainable model on every rank: a sharded model with its optimizer, LR schedule and gradient clipping, and
its checkpoints. The gradients it steps on are accumulated by the job's micro-batch loop (`workers.worker`, which
also holds the loss-scaling rule)."""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.tensor import DTensor



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
    ):
        self.model = model
        self.optimizer = build_optimizer(model)
        self.scheduler = build_scheduler(self.optimizer) if build_scheduler is not None else None
        self.max_grad_norm = max_grad_norm

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
