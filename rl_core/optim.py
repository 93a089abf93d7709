"""Optimizers and the learning-rate schedule used by the trainers."""

from __future__ import annotations

from typing import Iterable, Literal

import torch
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZER_NAMES = ("adam", "adamw", "tf_adam")


class TFAdam(torch.optim.Optimizer):
    """Adam with TensorFlow's epsilon placement (OpenAI ``lm-human-preferences`` parity).

    ``lr_t = lr * sqrt(1 - b2^t) / (1 - b1^t)`` and ``p -= lr_t * m / (sqrt(v) + eps)``: epsilon
    is added to the *uncorrected* ``sqrt(v)``, which makes early updates larger than PyTorch's
    Adam for the same eps. Uses plain tensor ops only, so FSDP2 DTensor parameters work.
    ``weight_decay`` is decoupled (AdamW-style: ``p *= 1 - lr * wd``); the original uses none.
    """

    def __init__(
        self,
        params: Iterable,
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 0.0,
    ) -> None:
        if lr < 0 or eps < 0 or weight_decay < 0:
            raise ValueError(f"TFAdam needs lr, eps, weight_decay >= 0, "
                             f"got lr={lr}, eps={eps}, weight_decay={weight_decay}")
        if not all(0.0 <= b < 1.0 for b in betas):
            raise ValueError(f"TFAdam betas must lie in [0, 1), got {betas}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        # `found_inf` (1.0: skip this update), as torch's fused Adam takes it: the caller decides on the device
        # whether the gradients are finite, so no host read is needed. The step count lives on the device too.
        found_inf = getattr(self, "found_inf", None)
        for group in self.param_groups:
            beta1, beta2 = group["betas"]
            for param in group["params"]:
                if param.grad is None:
                    continue
                state = self.state[param]
                if not state:
                    state["step"] = torch.zeros((), dtype=torch.float64, device=param.device)
                    state["exp_avg"] = torch.zeros_like(param)
                    state["exp_avg_sq"] = torch.zeros_like(param)
                keep = None if found_inf is None else found_inf.to(param.device) == 0
                grad = param.grad if keep is None else torch.where(keep, param.grad, 0.0)

                def update(tensor: torch.Tensor, new: torch.Tensor) -> None:
                    tensor.copy_(new if keep is None else torch.where(keep, new, tensor))

                step = state["step"].to(param.device) + (1.0 if keep is None else keep.double())
                state["step"] = step
                exp_avg, exp_avg_sq = state["exp_avg"], state["exp_avg_sq"]
                update(exp_avg, exp_avg.mul(beta1).add_(grad, alpha=1 - beta1))
                update(exp_avg_sq, exp_avg_sq.mul(beta2).addcmul_(grad, grad, value=1 - beta2))
                if group["weight_decay"]:
                    update(param, param.mul(1 - group["lr"] * group["weight_decay"]))
                lr_t = group["lr"] * torch.sqrt(1 - beta2**step) / (1 - beta1**step)
                update(param, param - (lr_t * exp_avg / (exp_avg_sq.sqrt() + group["eps"])).to(param.dtype))
        return loss

    # torch.amp's flag for an optimizer that reads `found_inf` itself (TrainableModel.step checks it)
    _step_supports_amp_scaling = True


def build_optimizer(
    params: Iterable,
    name: Literal["adam", "adamw", "tf_adam"],
    lr: float,
    eps: float = 1e-8,
    weight_decay: float = 0.0,
    betas: tuple[float, float] = (0.9, 0.999),
) -> torch.optim.Optimizer:
    """Optimizer by config name: ``adam``/``adamw`` are PyTorch's, ``tf_adam`` is :class:`TFAdam`.

    ``fused=True`` (CPU and CUDA since torch 2.4): one kernel per parameter group instead of a
    dozen multi-tensor ops, each of which pays FSDP2's DTensor dispatch; on CPU the default
    per-parameter loop costs about six times as much per step, ``foreach`` three times.
    """
    if name == "adam":
        return torch.optim.Adam(params, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas, fused=True)
    if name == "adamw":
        return torch.optim.AdamW(params, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas, fused=True)
    if name == "tf_adam":
        return TFAdam(params, lr=lr, eps=eps, weight_decay=weight_decay, betas=betas)
    raise ValueError(f"unknown optimizer name={name!r}; choose one of {OPTIMIZER_NAMES}")


def linear_anneal_schedule(optimizer: torch.optim.Optimizer, total_steps: int, warmup_steps: int = 0) -> LambdaLR:
    """LR rises linearly over ``warmup_steps`` then falls linearly to exactly 0 after ``total_steps``.

    Call ``scheduler.step()`` once per optimizer step. Without warmup the first step uses the
    full LR and step ``i`` uses ``lr * (1 - i / total_steps)`` (OpenAI's ``lrnow`` annealing).
    """
    if warmup_steps < 0 or total_steps <= warmup_steps:
        raise ValueError(f"need 0 <= warmup_steps < total_steps, got warmup_steps={warmup_steps}, "
                         f"total_steps={total_steps}")

    def lr_factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        return max(0.0, (total_steps - step) / (total_steps - warmup_steps))

    return LambdaLR(optimizer, lr_factor)
