"""Every model a job loads, built one way: PPO's actor, reference, critic, reward model and distillation
teacher, SFT's policy, DPO's policy, reference and scoring reward model, the reward-model job's model and
its sampling policy; and the host copy an export loads trained weights into (`build_export_template`).

A model is loaded by kind from its path (dropout off, `workers.loading`) with the job's `model` run keys
(`rl_core.config.ModelRunConfig`: weight dtype, attention kernel, activation checkpointing on a trained
model, sequence parallelism, LoRA on a trained causal LM, FSDP2 mixed precision and CPU offload), then placed
on this rank: FSDP2-sharded over the process group, or whole on one device. `build_frozen` gives it with
every weight frozen, `build_trained` as a `TrainableModel` with its optimizer and schedule.

`run=None`: a model that keeps its own defaults whatever the job's keys (float32, transformers' attention
kernel, no mixed precision, no offload, no run keys), e.g. the reward model DPO scores its samples with.

A trained model's optimizer comes from its job's optimizer keys (`rl_core.config.OptimizerConfig`, the same set in
every job) through `Optimization.from_config`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Literal

import torch
from torch import nn

from rl_core.config import ModelRunConfig, OptimizerConfig
from rl_core.optim import build_optimizer
from workers import loading
from workers.fsdp import shard_model
from workers.lora import with_lora
from workers.trainable import TrainableModel

Kind = Literal["causal_lm", "value", "reward", "new_reward"]


@dataclass(frozen=True)
class Placement:
    """Where a built model lives on this rank: FSDP2-sharded over the default process group (the shards on
    the mesh's device), or whole on `device`."""
    sharded: bool = True
    device: torch.device | None = None

    @classmethod
    def whole(cls, device: torch.device) -> "Placement":
        return cls(sharded=False, device=device)


@dataclass(frozen=True)
class Optimization:
    """A trained model's optimizer (by `rl_core.optim` name, over the weights that require grad: all, or the
    LoRA adapters), its schedule (`schedule(optimizer)`, None: constant) and gradient clipping."""
    optimizer: str
    lr: float
    eps: float = 1e-8
    weight_decay: float = 0.0
    betas: tuple = (0.9, 0.999)
    max_grad_norm: float | None = 1.0
    schedule: Callable | None = None

    @classmethod
    def from_config(cls, settings: OptimizerConfig, schedule: Callable | None = None,
                    lr: float | None = None) -> "Optimization":
        """A job's optimizer from its section's optimizer keys (`OptimizerConfig`: PPO's `algorithm`, the
        others' `train`); `lr` overrides the section's (PPO's critic: `algorithm.critic_lr`)."""
        return cls(settings.optimizer, settings.lr if lr is None else lr, eps=settings.adam_eps,
                   weight_decay=settings.weight_decay, betas=tuple(settings.adam_betas),
                   max_grad_norm=settings.max_grad_norm, schedule=schedule)

    def build(self, model: nn.Module) -> torch.optim.Optimizer:
        return build_optimizer([p for p in model.parameters() if p.requires_grad], self.optimizer, lr=self.lr,
                               eps=self.eps, weight_decay=self.weight_decay, betas=tuple(self.betas))


def load(path: str, kind: Kind, run: ModelRunConfig | None, *, pad_token_id: int | None = None,
         seed: int | None = None) -> nn.Module:
    """The model at `path` as `kind`: a causal LM, a value model (`loading.ValueModel`), a trained reward model,
    or a new one on a causal LM (`new_reward`: OpenAI's head init, seeded by `seed`); in `run`'s weight dtype
    (`model.dtype`; float32 with `run=None`) with its attention kernel."""
    dtype = getattr(torch, run.dtype if run is not None else "float32")
    attention = run.attn_implementation if run is not None else None
    if kind == "causal_lm":
        return loading.load_causal_lm(path, dtype, attention)
    if kind == "value":
        return loading.ValueModel.from_pretrained(path, dtype, attention)
    if kind == "reward":
        return loading.load_reward_model(path, dtype, pad_token_id, attention)
    if kind == "new_reward":
        return loading.init_reward_model(path, dtype, pad_token_id, seed, attention)
    raise ValueError(f"unknown model kind {kind!r}")


def build_frozen(path: str, kind: Kind, run: ModelRunConfig | None, placement: Placement, *,
                 pad_token_id: int | None = None) -> nn.Module:
    """A model that is only run (reference, reward model, teacher, sampling policy): loaded, placed, every
    weight frozen, in eval mode."""
    model = load(path, kind, run, pad_token_id=pad_token_id)
    if run is not None:
        loading.prepare_for_run(model, run, trained=False)
    return place(model, run, placement).requires_grad_(False).eval()


def build_trained(path: str, kind: Kind, run: ModelRunConfig, placement: Placement, optimization: Optimization, *,
                  pad_token_id: int | None = None, seed: int | None = None,
                  vocab_size: int | None = None) -> TrainableModel:
    """A model being trained, with its optimizer and schedule (see `make_trainable`). `vocab_size`: the
    tokenizer's ids, when the model must have an embedding row for each (SFT: its [PAD] may be fed as input)."""
    model = load(path, kind, run, pad_token_id=pad_token_id, seed=seed)
    if vocab_size is not None and vocab_size > model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(vocab_size)  # a [PAD] the tokenizer gained
    return make_trainable(model, run, placement, optimization)


def build_export_template(path: str, lora, trained_rows: Callable[[nn.Module], int]) -> nn.Module:
    """The causal LM at `path` on the host in its own defaults (`run=None`), shaped as the job trained it: the
    embedding rows `trained_rows(model)` says the trained state holds (a job may grow the vocabulary, SFT's added
    tokens) and the job's LoRA adapters (`lora`: its `model.lora` settings). A trained state then loads into it
    as saved, for `rl_core.checkpoint.export_hf` and `rl-core export`."""
    model = load(path, "causal_lm", None)
    rows = trained_rows(model)
    if rows != model.get_input_embeddings().num_embeddings:
        model.resize_token_embeddings(rows)
    return with_lora(model, lora)


def make_trainable(model: nn.Module, run: ModelRunConfig, placement: Placement,
                   optimization: Optimization) -> TrainableModel:
    """A loaded model made trainable: activation checkpointing and sequence parallelism (`run`), LoRA adapters
    on a causal LM when `run.lora.rank` says so, placed, with its optimizer and schedule."""
    loading.prepare_for_run(model, run, trained=True)
    lora = getattr(run, "lora", None)
    if lora is not None and not isinstance(model, loading.ValueModel):  # the critic trains every weight
        model = with_lora(model, lora, run.gradient_checkpointing)
    return TrainableModel(place(model, run, placement), optimization.build, optimization.schedule,
                          optimization.max_grad_norm)


def place(model: nn.Module, run: ModelRunConfig | None, placement: Placement) -> nn.Module:
    """Sharded: FSDP2 over the default process group, with `run`'s mixed precision and CPU offload (the shards
    go to the mesh's device, or stay in host memory when offloaded; `run=None`: neither); else the whole model
    on the device."""
    if not placement.sharded:
        return model.to(placement.device)
    if run is None:
        return shard_model(model)
    return shard_model(model, mixed_precision=run.mixed_precision, cpu_offload=run.cpu_offload)
