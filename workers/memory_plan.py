"""Memory planning for one device shared by a trainer rank and its engine: what each part needs, the
engine's KV pool in tokens, and whether both fit at once (then the engine never releases its memory).

`plan_memory` is pure arithmetic over stated numbers (`MemoryInputs`, `Device`), so it is tested with
the sizes of real models and GPUs on any machine. The helpers below it read those numbers from a
`transformers` config and from the machine (`model_shape`, `detect_device`).

The estimates, per device (a trainer rank and its engine):
- trainer: each trained model holds its master weights, gradients and optimizer states (Adam: 2 per
  weight), all in the master dtype and sharded by FSDP over `dp_size` ranks; frozen models (reference,
  reward model) hold their weights only. `cpu_offload` keeps all of these in host memory.
- activations of one micro-batch of `max_tokens_per_device` tokens (the job passes one rank's share of a
  minibatch where that is less): for the families of `ACTIVATION_VALUES` their measured values per token
  and layer (per hidden and per MLP unit) in the compute dtype; for others 64 x hidden bytes per token and
  layer in 16-bit, twice that in fp32; with gradient checkpointing one hidden state per layer plus one layer
  recomputed; plus the LM head's float32 logits, their log-softmax and gradient over `logits_chunk` tokens
  at a time. Korthikanti et al. 2022 ("Reducing Activation Recomputation in Large Transformer Models")
  count 34 without the attention scores, which sdpa and flash kernels never keep, but they assume fused
  kernels: what autograd saves in `transformers`' own layers is more (measured in bf16, tiny random models:
  GPT-2 60, with its tanh GELU written out; Qwen3 53; Phi-3 46; Llama and Mistral 44; the norms keep
  float32 copies), and the plan's 34 put the ~86M GPT-2 trainer at 4.1 GiB where an H200 measured a 7.7
  GiB peak. Eager attention (Gemma 2's soft-capping) also keeps the attention scores, not counted here.
- engine: its weights in the engine dtype (split over `tp_size` GPUs) and a KV pool of
  2 x layers x kv_heads x head_dim x dtype bytes per token (GQA and MQA through kv_heads).
- a fixed reserve (`Device.reserve_bytes`): CUDA contexts of both processes, SGLang's decode
  workspace and CUDA graphs, FSDP's all-gathered layers, allocator fragmentation; on CPU each
  process's Python and torch runtime.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

GIB = 1 << 30
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
OPTIMIZER_STATES = {"adam": 2, "adamw": 2, "tf_adam": 2}  # states per trained weight (first and second moments)
ACTIVATION_FACTOR_16BIT = 64  # bytes per token, layer and hidden unit in 16-bit (see the module doc)
# Where the family is known, the values autograd keeps per token and layer, as (per hidden unit, per MLP unit),
# measured on transformers' own layers in float32 and bfloat16 and rounded up (tests/workers/test_memory_plan.py
# holds them as upper bounds): a gated MLP keeps 4 values per MLP unit; attention, norms and residuals 11-16
# per hidden unit (the norms' float32 copies count double in 16-bit, Qwen3's q/k norms add more). GPT-2 (5
# per inner unit, 10 per hidden: 60 bytes per hidden unit in bf16) keeps the flat factor, which an H200 run
# of the ~86M GPT-2 already measured above the plan. SmolLM2-135M in float32 keeps 44.6 kB per token and layer: 51 kB by these, 74 kB by the
# flat factor above.
ACTIVATION_VALUES = {"llama": (11.2, 4), "mistral": (11.2, 4), "qwen2": (11.2, 4),
                     "qwen3": (15.8, 4), "phi3": (12.2, 4)}
LOGIT_COPIES = 3  # float32 logits, their log-softmax and its gradient
# The KV pool holds every sequence a rollout can have in flight on one engine, with room for the
# router's imbalance (cache_aware routing sends a light load to one engine): an engine that runs out of
# KV mid-decode retracts requests and recomputes them later.
ROUTER_IMBALANCE = 2.0
CUDA_RESERVE_BYTES = 4 * GIB
CPU_RESERVE_BYTES = 1 * GIB  # a trainer rank's and its engine's Python + torch, about 0.4 GB each
PROCESS_RUNTIME_BYTES = GIB // 2  # on CPU, each process's Python, torch and transformers before any model
FRAGMENTATION = 0.05  # of the device, lost to the allocators' fragmentation
RELEASE_MODES = ("auto", "always", "never")


@dataclasses.dataclass(frozen=True)
class ModelShape:
    """What the plan needs to know of a model."""
    params: int
    layers: int
    hidden: int
    vocab: int
    kv_values_per_token: int  # K and V values one token keeps over all layers: 2 x layers x kv_heads x head_dim
    activation_values: int | None = None  # values kept for backward per token and layer (None: the flat factor)

    def kv_bytes_per_token(self, dtype_bytes: int) -> int:
        return self.kv_values_per_token * dtype_bytes


@dataclasses.dataclass(frozen=True)
class MemoryInputs:
    """The job's numbers, as the plan reads them (per trainer rank and engine unless said otherwise)."""
    policy: ModelShape
    engine_dtype_bytes: int
    master_dtype_bytes: int  # the trainer's weights (fp32 master weights under mixed precision)
    compute_dtype_bytes: int  # activations: 2 under bf16/fp16 mixed precision, else the master dtype's
    optimizer_states: int = 2  # per trained weight
    trained_models: int = 1  # full trained copies of the policy's size: the actor (0 with LoRA) and the critic
    frozen_params: int = 0  # weights of the frozen models: reference, reward model
    dp_size: int = 1  # ranks FSDP shards over
    tp_size: int = 1  # GPUs one engine spans
    cpu_offload: bool = False
    max_tokens_per_device: int = 8192  # one micro-batch's tokens
    gradient_checkpointing: bool = False
    logits_chunk: int = 0  # 0 = the whole micro-batch's logits at once
    sequences_in_flight: int = 1  # the whole job's: a batch's trajectories the rollout runs at once
    batches_in_flight: int = 1
    sequence_tokens: int = 1  # prompt + responses of the longest sequence
    engines: int = 1
    min_kv_tokens: int = 0  # the pool holds at least one sequence of the served context
    kv_tokens: int | None = None  # the user's pool size: taken as it is
    engine_static_bytes: int | None = None  # the most the engine may hold (SGLang: mem_fraction_static x device)


@dataclasses.dataclass(frozen=True)
class Device:
    kind: str  # cuda | cpu
    total_bytes: int  # the memory one trainer rank and its engine share
    reserve_bytes: int

    @classmethod
    def of(cls, kind: str, total_bytes: int) -> "Device":
        fixed = CUDA_RESERVE_BYTES if kind == "cuda" else CPU_RESERVE_BYTES
        return cls(kind, int(total_bytes), fixed + int(FRAGMENTATION * total_bytes))


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    device: Device
    trainer_params: int
    trainer_grads: int
    trainer_optimizer: int
    trainer_frozen: int
    trainer_activations: int
    engine_weights: int
    kv_bytes_per_token: int
    work_tokens: int  # KV the rollout's sequences need on one engine
    kv_tokens: int  # the engine's pool
    fits: bool  # trainer at its peak and engine with its whole pool fit together
    trainer_fits: bool  # the trainer alone fits (else expect an out-of-memory error)
    reason: str
    policy_whole_bytes: int = 0  # the policy's weights in the master dtype, unsharded (as loaded)

    @property
    def engine_kv(self) -> int:
        return self.kv_tokens * self.kv_bytes_per_token

    @property
    def trainer_total(self) -> int:
        return (self.trainer_params + self.trainer_grads + self.trainer_optimizer + self.trainer_frozen
                + self.trainer_activations)

    @property
    def engine_total(self) -> int:
        return self.engine_weights + self.engine_kv

    def parts(self) -> dict[str, int]:
        return {"trainer_params": self.trainer_params, "trainer_grads": self.trainer_grads,
                "trainer_optimizer": self.trainer_optimizer, "trainer_frozen": self.trainer_frozen,
                "trainer_activations": self.trainer_activations, "engine_weights": self.engine_weights,
                "engine_kv": self.engine_kv, "reserve": self.device.reserve_bytes}

    def process_peaks(self) -> dict[str, int]:
        """On CPU, each process's peak resident memory (what `ru_maxrss` reads): the trainer's parts, its runtime,
        and twice the policy's size for its loading, when the mapped checkpoint file and the loaded copy are both
        resident before FSDP shards it (SmolLM2-135M in float32: 6.1 GiB measured, 5.5 planned, at 48 x 112
        tokens; 3.6 and 3.1 at 8 x 88); the engine's parts and its runtime."""
        return {"trainer": self.trainer_total + 2 * self.policy_whole_bytes + PROCESS_RUNTIME_BYTES,
                "engine": self.engine_total + PROCESS_RUNTIME_BYTES}

    def metrics(self) -> dict[str, float]:
        """`memory_plan/*` for the metrics log: bytes in GiB, the pool in tokens, the decision as 0/1."""
        out = {f"memory_plan/{name}_gib": value / GIB for name, value in self.parts().items()}
        out.update({"memory_plan/device_gib": self.device.total_bytes / GIB, "memory_plan/kv_tokens": self.kv_tokens,
                    "memory_plan/work_tokens": self.work_tokens, "memory_plan/fits": float(self.fits)})
        if self.device.kind == "cpu":  # beside memory/trainer_peak_gib, the trainer process's measured peak
            out.update({f"memory_plan/{name}_process_gib": value / GIB for name, value in self.process_peaks().items()})
        return out

    def to_dict(self) -> dict[str, Any]:
        return {"device": dataclasses.asdict(self.device), "parts_bytes": self.parts(),
                "kv_bytes_per_token": self.kv_bytes_per_token, "work_tokens": self.work_tokens,
                "kv_tokens": self.kv_tokens, "fits": self.fits, "trainer_fits": self.trainer_fits,
                "reason": self.reason}

    def lines(self, release: bool) -> list[str]:
        """The compact block printed at start."""
        dev = self.device
        lines = [f"memory plan ({dev.kind}, {size(dev.total_bytes)} per rank and engine, reserve {size(dev.reserve_bytes)}):",
                 f"  trainer {size(self.trainer_total)} = params {size(self.trainer_params)} + grads "
                 f"{size(self.trainer_grads)} + optimizer {size(self.trainer_optimizer)} + frozen models "
                 f"{size(self.trainer_frozen)} + activations {size(self.trainer_activations)}",
                 f"  engine {size(self.engine_total)} = weights {size(self.engine_weights)} + KV {size(self.engine_kv)} "
                 f"({self.kv_tokens} tokens x {self.kv_bytes_per_token} B; the rollout needs {self.work_tokens})",
                 f"  {self.reason}; release engine memory each step: {'yes' if release else 'no'}"]
        if dev.kind == "cpu":
            peaks = self.process_peaks()
            lines.append(f"  each process at its peak, with its runtime: trainer {size(peaks['trainer'])} (loading the "
                         f"policy whole included), engine {size(peaks['engine'])}")
        if not self.trainer_fits:
            lines.append(f"  warning: the trainer alone needs {size(self.trainer_total)} of "
                         f"{size(dev.total_bytes - dev.reserve_bytes)} usable: expect out-of-memory errors; shard over "
                         "more ranks, or use model.cpu_offload, LoRA or a smaller algorithm.max_tokens_per_device")
        return lines


def size(n: int) -> str:
    return f"{n / GIB:.2f} GiB" if abs(n) >= GIB else f"{n / (1 << 20):.1f} MiB"


def plan_memory(inputs: MemoryInputs, device: Device) -> MemoryPlan:
    """Bytes per part, the KV pool in tokens and whether trainer and engine fit on `device` together."""
    n, shards = inputs.policy.params, max(inputs.dp_size, 1)
    on_device = 0 if inputs.cpu_offload else 1
    trained = inputs.trained_models * n
    params = on_device * trained * inputs.master_dtype_bytes // shards
    grads = params
    optimizer = on_device * inputs.optimizer_states * trained * inputs.master_dtype_bytes // shards
    frozen = on_device * inputs.frozen_params * inputs.master_dtype_bytes // shards
    activations = activation_bytes(inputs)
    engine_weights = n * inputs.engine_dtype_bytes // max(inputs.tp_size, 1)
    per_token = max(inputs.policy.kv_bytes_per_token(inputs.engine_dtype_bytes) // max(inputs.tp_size, 1), 1)
    work = work_tokens(inputs)
    usable = device.total_bytes - device.reserve_bytes
    trainer_peak = params + grads + optimizer + frozen + activations
    # Released, the engine shares the device only with what the trainer keeps between steps: weights and
    # optimizer states (gradients are freed by zero_grad, activations by the end of the step, and the
    # trainer empties its CUDA cache before the engine resumes).
    trainer_between_steps = params + optimizer + frozen
    if inputs.kv_tokens is not None:
        kv_tokens, why = inputs.kv_tokens, "rollout.kv_tokens as set"
    else:
        # A pool that cannot sit beside the training peak stays whole and is released while training rather
        # than shrunk to fit: requests queued for KV cost more than a release and resume (17 ms on an H200).
        whole_pool_fits = trainer_peak + engine_weights + work * per_token <= usable
        room = usable - (trainer_peak if whole_pool_fits else trainer_between_steps) - engine_weights
        if inputs.engine_static_bytes is not None:
            room = min(room, inputs.engine_static_bytes - engine_weights)
        kv_tokens = max(min(work, room // per_token), inputs.min_kv_tokens)
        why = "sized from the rollout" if kv_tokens == work else \
            f"capped by memory at {kv_tokens} of the {work} tokens the rollout needs (requests will queue)"
    together = trainer_peak + engine_weights + kv_tokens * per_token
    fits = together <= usable
    verdict = "fit together" if fits else "do not fit together"
    reason = f"trainer and engine {verdict} ({size(together)} of {size(usable)} usable); KV {why}"
    return MemoryPlan(device, params, grads, optimizer, frozen, activations, engine_weights, per_token, work,
                      int(kv_tokens), fits, trainer_peak <= usable, reason, n * inputs.master_dtype_bytes)


def activation_bytes(inputs: MemoryInputs) -> int:
    """One micro-batch's activations kept for backward (see the module doc for the estimate)."""
    shape, tokens, width = inputs.policy, inputs.max_tokens_per_device, inputs.compute_dtype_bytes
    if shape.activation_values is not None:
        per_layer = shape.activation_values * width  # per token
    else:
        per_layer = ACTIVATION_FACTOR_16BIT * shape.hidden * width // 2
    if inputs.gradient_checkpointing:  # each layer keeps its input; one layer's internals exist at a time
        body = tokens * (shape.layers * shape.hidden * width + per_layer)
    else:
        body = tokens * shape.layers * per_layer
    from workers.forward import head_chunk  # the trainer's own rule for when the head runs in chunks

    chunk = head_chunk(tokens, shape.vocab, inputs.logits_chunk) or tokens
    return body + LOGIT_COPIES * chunk * shape.vocab * 4


def work_tokens(inputs: MemoryInputs) -> int:
    """KV tokens one engine needs for the sequences it may hold at once: its share of the rollout's
    in-flight sequences (the router's imbalance allowed for), each at its longest, at least one sequence
    of the served context."""
    in_flight = inputs.sequences_in_flight * inputs.batches_in_flight
    per_engine = min(in_flight, math.ceil(ROUTER_IMBALANCE * in_flight / max(inputs.engines, 1)))
    return max(per_engine * inputs.sequence_tokens, inputs.min_kv_tokens)


def decide_release(mode: str, plan: MemoryPlan) -> bool:
    """`rollout.release_memory`: always, never, or auto = only when trainer and engine do not fit together."""
    if mode not in RELEASE_MODES:
        raise ValueError(f"release mode {mode!r} is not one of {RELEASE_MODES}")
    return mode == "always" or (mode == "auto" and not plan.fits)


# ------------------------------------------------------------------ reading the numbers


def model_shape(config: Any, params: int | None = None) -> ModelShape:
    """A model's shape from its `transformers` config (any family: GPT-2's n_layer/n_head/n_embd reach
    these names through the config's attribute map; a multimodal config's language model holds them).
    `params`: its parameter count; None counts a skeleton built on the meta device (no memory)."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    layers, hidden = int(text.num_hidden_layers), int(text.hidden_size)
    heads = int(text.num_attention_heads)
    if getattr(text, "kv_lora_rank", None):  # multi-head latent attention keeps one compressed vector per token
        kv = layers * (int(text.kv_lora_rank) + int(text.qk_rope_head_dim))
    else:
        kv_heads = int(getattr(text, "num_key_value_heads", None) or heads)  # GQA/MQA: fewer KV heads
        head_dim = int(getattr(text, "head_dim", None) or hidden // heads)  # Qwen3, Gemma: not hidden / heads
        kv = 2 * layers * kv_heads * head_dim
    activations = None
    if getattr(text, "model_type", None) in ACTIVATION_VALUES:
        per_hidden, per_mlp = ACTIVATION_VALUES[text.model_type]
        mlp = int(getattr(text, "intermediate_size", None) or getattr(text, "n_inner", None) or 4 * hidden)
        activations = math.ceil(per_hidden * hidden + per_mlp * mlp)
    return ModelShape(params if params is not None else count_parameters(config), layers, hidden,
                      int(text.vocab_size), kv, activations)


def count_parameters(config: Any, sequence_classification: bool = False) -> int:
    """Parameters of the model `config` describes, built on the meta device (tied weights counted once)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoModelForImageTextToText, AutoModelForSequenceClassification

    auto = AutoModelForSequenceClassification if sequence_classification else AutoModelForCausalLM
    if hasattr(config, "vision_config") and not sequence_classification:  # its vision tower counted too
        auto = AutoModelForImageTextToText
    with torch.device("meta"):
        model = auto.from_config(config)
    return sum(p.numel() for p in model.parameters())


def detect_device(device: Any, ranks_on_node: int) -> Device:
    """The memory one rank and its engine share: a GPU's total, or on CPU the machine's divided by the
    node's ranks (every rank's trainer and engine share it)."""
    if getattr(device, "type", str(device)).startswith("cuda"):
        import torch

        return Device.of("cuda", torch.cuda.mem_get_info(device)[1])
    import psutil

    return Device.of("cpu", psutil.virtual_memory().total // max(ranks_on_node, 1))
