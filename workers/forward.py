"""What a model says about a micro-batch's tokens: logprobs, entropies, values, reward scores.

One alignment rule (`rows_about_tokens`): the output about token ``t`` of a padded row is the model's
output at the position just before it, gathered through the packed layout when packed. So
``logprobs[:, t]`` is ``log p(input_ids[:, t] | tokens < t)`` and ``values[:, t]`` the critic's
value of the state just before token ``t``; a sequence's first token holds 0. Every quantity is
therefore masked by ``action_mask`` directly.

The LM head runs on the wanted tokens only (the actions, or every token with one before it), in chunks
of `ForwardSettings.logits_chunk` tokens recomputed in backward, so no `[tokens, vocabulary]` logits of a
whole micro-batch exist at once: float32 logits of a 16k-token micro-batch at a 150k vocabulary are
~9.6 GB. Logits of at most `UNCHUNKED_LOGITS_MAX_BYTES` are computed whole (`head_chunk`): there chunks
only add kernel launches and a recompute. It runs inside the model's forward (a hook on its decoder), where FSDP has the head's weight
gathered, and the model's own head computes one position only.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint
from transformers import PreTrainedModel

from workers.layout import host_view, model_inputs
from workers.loading import score_head
from workers.sequence_parallel import SequenceGroup
from workers.vision import vision_model_inputs


# float32 logits up to this size are computed whole: chunking them (and recomputing each chunk in backward)
# saves memory only when they are large (long micro-batches, big vocabularies), and costs time always: six
# checkpointed chunks for 6k tokens of a 1,360-token vocabulary (33 MB of logits) were pure overhead.
UNCHUNKED_LOGITS_MAX_BYTES = 64 * 2**20


def head_chunk(tokens: int, vocab: int, chunk: int, unchunked_max_bytes: int = UNCHUNKED_LOGITS_MAX_BYTES) -> int:
    """Tokens of LM-head logits computed at a time for `tokens` wanted tokens: `chunk`, or 0 (all at once) when
    chunks are off or their float32 logits (tokens x vocabulary x 4 bytes) fit `unchunked_max_bytes`."""
    if chunk <= 0 or tokens <= chunk or tokens * vocab * 4 <= unchunked_max_bytes:
        return 0
    return chunk


@dataclass(frozen=True)
class ForwardSettings:
    """How models run on a job's micro-batches: `logits_chunk` tokens of LM-head logits at a time (0: all
    at once; `head_chunk` decides from the micro-batch's logits size) and the sequence-parallel group
    splitting each micro-batch's tokens (None: no split)."""

    logits_chunk: int = 0
    sequence: SequenceGroup | None = None
    unchunked_logits_max_bytes: int = UNCHUNKED_LOGITS_MAX_BYTES

    @classmethod
    def for_job(cls, run, world_size: int, device: torch.device) -> "ForwardSettings":
        """From a job's `model` run keys (`rl_core.config.ModelRunConfig`). Collective under sequence parallelism."""
        return cls(run.logits_chunk, SequenceGroup.build(world_size, run.sequence_parallel, device))


class MicroBatch(dict):
    """A laid-out micro-batch (`[b, T]` tensors and the packed layout, on the device) and how models run on
    it; a plain dict of tensors runs with the default `ForwardSettings`."""

    def __init__(self, tensors: dict[str, torch.Tensor], settings: ForwardSettings,
                 host: dict[str, torch.Tensor] | None = None):
        super().__init__(tensors)
        self.settings = settings
        self.host = host  # the same tensors on the CPU, for what is planned from them (no device read)


def settings_of(batch: dict[str, torch.Tensor]) -> ForwardSettings:
    return getattr(batch, "settings", None) or ForwardSettings()


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution along the last dim: ``logsumexp(z) - sum(p * z)``."""
    logits = logits.float()
    return torch.logsumexp(logits, dim=-1) - (torch.softmax(logits, dim=-1) * logits).sum(dim=-1)


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[labels]`` in float32, without materialising the log-softmax."""
    logits = logits.float()
    return logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - torch.logsumexp(logits, dim=-1)


def rows_about_tokens(batch: dict[str, torch.Tensor], per_position: torch.Tensor, first: int = 1) -> torch.Tensor:
    """The model's outputs (`[n, L, ...]` in the `model_inputs` layout) at the position just before
    each token `first`..T-1 of the padded rows: `[b, T-first, ...]`, what the model said about that
    token. Packed, it is gathered through `packed_index` (a shared prompt's last position is the one
    before every first response token of its group); rows whose previous token is padding get row 0's
    output: mask them (they are never actions)."""
    if "packed_index" not in batch:
        return per_position[:, first - 1:-1]
    previous = batch["packed_index"][:, first - 1:-1].to(per_position.device)
    return per_position.flatten(0, 1)[previous.clamp(min=0)]


def _has_previous_token(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, T]` 1 where a token and the one before it are real."""
    real = batch["attention_mask"].bool()
    return real & torch.nn.functional.pad(real[:, :-1], (1, 0), value=False)


def _previous_positions(batch: dict[str, torch.Tensor], rows: torch.Tensor, columns: torch.Tensor) -> torch.Tensor:
    """Where, as a flat index into the model's `[n, L]` positions, the token before each (row, column) is."""
    if "packed_index" in batch:
        return batch["packed_index"][rows, columns - 1]
    return rows * batch["input_ids"].shape[1] + columns - 1


def _model_config(model: nn.Module):
    return model.config if hasattr(model, "config") else model.backbone.config


def _causal_lm(model: nn.Module) -> PreTrainedModel:
    return model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA, peft's wrapper


def run_inputs(model: nn.Module, batch: dict[str, torch.Tensor]) -> dict:
    """The keywords `model` runs on for this micro-batch: its rows as `model_inputs` lays them out, a vision model's
    images and 3-D positions, under sequence parallelism this rank's share of the tokens (with the whole rows'
    mask and the group for the attention, `workers.sequence_parallel`), and no KV cache."""
    inputs = model_inputs(batch, _model_config(model))
    group = settings_of(batch).sequence
    if "image_grid_thw" in batch:  # a vision-language micro-batch (`workers.vision.with_vision`)
        inputs = vision_model_inputs(batch, inputs, sequence_parallel=group is not None)
    if group is not None:
        inputs = {**inputs, "input_ids": group.shard(inputs["input_ids"]),
                  "position_ids": group.shard(inputs["position_ids"]), "sequence_group": group}
    # No KV cache: nothing here decodes, and a model whose config says use_cache made one at every forward
    # (a copy of every layer's keys and values). transformers' flash path for packed rows also needs it off.
    return {**inputs, "use_cache": False}


def _per_position(batch: dict[str, torch.Tensor], local: torch.Tensor) -> torch.Tensor:
    """A model's per-position output `[n, L(/N)]` as the whole rows' (gathered over the sequence group)."""
    group = settings_of(batch).sequence
    return local if group is None else group.gather_replicated(local, dim=1)


# --------------------------------------------------------------------------- the LM head on the wanted tokens


@dataclass(frozen=True)
class _Wanted:
    logprobs: bool = True
    entropy: bool = False
    entropy_grad: bool = True
    hits: bool = False


def _head_outputs(hidden: torch.Tensor, labels: torch.Tensor, *, weight: torch.Tensor, bias: torch.Tensor | None,
                  temperature: float, softcap: float | None, wanted: _Wanted) -> tuple[torch.Tensor, ...]:
    """Logprob of each label, entropy and argmax hit for `[k, H]` hidden states (one chunk)."""
    # OpenAI detail: logprobs come from logits / sampling temperature, matching the sampler. Without a soft cap
    # the division goes on the hidden states and bias (H wide), not on the logits (vocabulary wide): the same
    # logits, one pass over the vocabulary-wide tensor and its gradient fewer.
    scale = 1.0 if softcap else 1.0 / temperature
    if scale != 1.0:
        hidden, bias = hidden * scale, None if bias is None else bias * scale
    logits = torch.nn.functional.linear(hidden, weight, bias).float()
    if softcap:  # Gemma's final soft-capping, as its own forward applies it after the head
        logits = torch.tanh(logits / softcap) * softcap / temperature
    logprobs, entropy = _LabelLogprobs.apply(logits, labels, wanted.entropy, wanted.entropy_grad)
    outputs = [logprobs] + ([entropy] if wanted.entropy else [])
    if wanted.hits:
        outputs.append((logits.detach().argmax(-1) == labels).float())
    return tuple(outputs)


class _LabelLogprobs(torch.autograd.Function):
    """`[k, V]` logits -> each label's logprob and (optionally) the entropy, with a hand-written backward.

    Autograd through log_softmax, gather and the entropy's exp/mul/sum keeps several `[k, V]` tensors and makes
    about eight passes over them; the gradient in closed form takes three: d log p_y / dz = onehot(y) - p and
    dH/dz = -p (log p + H). Why by hand: the LM head's vocabulary-wide tensors are the largest of a step."""

    @staticmethod
    def forward(ctx, logits, labels, with_entropy: bool, entropy_grad: bool):
        logp = torch.log_softmax(logits, dim=-1)
        label_logp = logp.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        entropy = -(logp.exp() * logp).sum(-1) if with_entropy else label_logp.new_zeros(0)
        ctx.entropy_grad = with_entropy and entropy_grad
        if not ctx.entropy_grad:
            ctx.mark_non_differentiable(entropy)
        ctx.save_for_backward(logp, labels, entropy)
        return label_logp, entropy

    @staticmethod
    def backward(ctx, grad_logp, grad_entropy):
        logp, labels, entropy = ctx.saved_tensors
        if grad_logp is None:  # only the entropy is in the loss
            grad_logp = logp.new_zeros(logp.shape[:-1])
        grad = logp.exp()
        if ctx.entropy_grad and grad_entropy is not None:
            grad *= -(grad_logp.unsqueeze(-1) + grad_entropy.unsqueeze(-1) * (logp + entropy.unsqueeze(-1)))
        else:
            grad *= -grad_logp.unsqueeze(-1)
        grad.scatter_add_(-1, labels.unsqueeze(-1), grad_logp.unsqueeze(-1))
        return grad, None, None, None


def _in_chunks(head: Callable, hidden: torch.Tensor, labels: torch.Tensor, settings: ForwardSettings,
               vocab: int) -> list[torch.Tensor]:
    """`head(hidden, labels)` (`_head_outputs`) over `head_chunk` tokens at a time, each chunk's logits recomputed
    in backward (activation checkpointing), so the backward holds the hidden states, not the logits."""
    chunk = head_chunk(len(hidden), vocab, settings.logits_chunk, settings.unchunked_logits_max_bytes)
    if chunk == 0:
        return list(head(hidden, labels))
    parts = [checkpoint(head, hidden[i:i + chunk], labels[i:i + chunk], use_reentrant=False)
             for i in range(0, len(hidden), chunk)]
    return [torch.cat(outputs) for outputs in zip(*parts)]


def _final_softcap(config) -> float | None:
    if getattr(config, "logit_scale", None) or getattr(config, "logits_scaling", None):
        raise ValueError(f"{type(config).__name__} scales its logits after the LM head; the trainer's head "
                         "(workers.forward) does not know that transformation yet")
    return getattr(config, "final_logit_softcapping", None)


def _token_outputs(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float, wanted: _Wanted,
                   actions_only: bool) -> list[torch.Tensor]:
    """`[b, T]` rows of the `wanted` outputs about each token (the actions with `actions_only`, else every
    token with a real one before it; 0 elsewhere)."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use the sampling temperature")
    settings = settings_of(batch)
    host = host_view(batch)
    keep = host["action_mask"].bool() & _has_previous_token(host) if actions_only else _has_previous_token(host)
    device = batch["input_ids"].device
    rows, columns = (index.to(device, non_blocking=True) for index in keep.nonzero(as_tuple=True))
    previous = _previous_positions(batch, rows, columns)
    labels = batch["input_ids"][rows, columns]
    lm = _causal_lm(model)
    computed: list[list[torch.Tensor]] = []

    def head_on_wanted_tokens(module, args, output):
        # Inside the model's forward: FSDP has gathered the root's weights (embeddings, final norm, head).
        hidden = output[0] if isinstance(output, tuple) else output.last_hidden_state
        linear = lm.get_output_embeddings()
        head = functools.partial(_head_outputs, weight=linear.weight, bias=linear.bias, temperature=temperature,
                                 softcap=_final_softcap(lm.config), wanted=wanted)
        group = settings.sequence
        if group is None:
            computed.append(_in_chunks(head, hidden.flatten(0, 1)[previous], labels, settings, linear.weight.shape[0]))
            return
        # Sequence parallel: whole rows of hidden states, the head on this rank's share of the tokens.
        hidden = group.gather_hidden(hidden).flatten(0, 1)
        start, stop, share = group.split(len(previous))
        mine = _in_chunks(head, hidden[previous[start:stop]], labels[start:stop], settings, linear.weight.shape[0])
        padded = [torch.nn.functional.pad(out, (0, share - (stop - start))) for out in mine]
        computed.append([group.gather_replicated(out)[:len(previous)] for out in padded])

    handle = lm.get_decoder().register_forward_hook(head_on_wanted_tokens)
    try:
        output = model(**run_inputs(model, batch), logits_to_keep=1)
    finally:
        handle.remove()
    tie = output.logits.sum() * 0  # keeps the model's own output in the graph, so FSDP's backward hooks all run
    outputs = []
    for values in computed[0]:
        out = torch.zeros(keep.shape, dtype=values.dtype, device=values.device)
        outputs.append(out.index_put((rows, columns), values) + tie)
    return outputs


def token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                   actions_only: bool = False) -> torch.Tensor:
    """``[b, T]``: ``log p(input_ids[:, t] | < t)`` at temperature; 0 at a sequence's first token, on padding
    and, with `actions_only`, on every token that is not an action (computed for the actions only)."""
    return _token_outputs(model, batch, temperature, _Wanted(), actions_only)[0]


def token_logprobs_and_hits(model: nn.Module, batch: dict[str, torch.Tensor],
                            actions_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, T]`` logprobs (temperature 1) and whether the argmax was the token (SFT's token accuracy)."""
    logprobs, hits = _token_outputs(model, batch, 1.0, _Wanted(hits=True), actions_only)
    return logprobs, hits


def token_logprobs_and_entropy(
    model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, entropy_grad: bool = True,
    actions_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, T]`` logprobs and entropies of the distribution each token was drawn from (`actions_only`:
    see `token_logprobs`).

    ``entropy_grad=False`` (no entropy bonus: the entropy is only logged) keeps the vocabulary-wide
    entropy out of the backward pass.
    """
    logprobs, entropy = _token_outputs(model, batch, temperature, _Wanted(entropy=True, entropy_grad=entropy_grad),
                                       actions_only)
    return logprobs, entropy


def token_values(value_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, T]``: ``values[:, t]`` is the critic output at t-1 (value before action token t); 0 at a
    sequence's first token and on padding."""
    per_position = _per_position(batch, value_model(**run_inputs(value_model, batch)))
    values = torch.nn.functional.pad(rows_about_tokens(batch, per_position), (1, 0))
    return values * _has_previous_token(batch).to(values.device, values.dtype)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` index of each row's last attended token (rows may hold padding on both sides)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device).expand_as(attention_mask)
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values
    if (last < 0).any():
        raise ValueError("a row has no attended token; every sequence needs at least one real token")
    return last


def raw_reward_scores(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b]`` head output at each row's last real token, before gain/bias (`batch` from
    `rows_to_batch`, packed or not).

    OpenAI detail: the reward is the score of the last token of query+response. The index comes
    from ``attention_mask`` (not HF's pad-id search), so any pad id and padding side work. The
    head's per-position output is captured inside the model's own forward, so FSDP2's hooks
    gather the head and backbone exactly as in training.
    """
    if model.config.pad_token_id is None:
        raise ValueError("reward model config has no pad_token_id (HF's seq-cls forward needs one for "
                         "batches); pass pad_token_id=tokenizer.pad_token_id to init/load_reward_model")
    captured: list[torch.Tensor] = []
    handle = score_head(model).register_forward_hook(lambda module, args, output: captured.append(output))
    try:
        model(**run_inputs(model, batch))
    finally:
        handle.remove()
    per_position = _per_position(batch, captured[0].squeeze(-1))
    last = last_token_index(host_view(batch)["attention_mask"]).to(per_position.device)
    rows = torch.arange(len(last), device=per_position.device)
    if "packed_index" in batch:  # where each row's last token went in the packed rows
        return per_position.flatten()[batch["packed_index"].to(per_position.device)[rows, last]]
    return per_position[rows, last]


def reward_scores(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b]`` last-token scores, affinely normalised: ``raw * reward_gain + reward_bias``."""
    raw = raw_reward_scores(model, batch)
    gain = getattr(model.config, "reward_gain", 1.0)
    bias = getattr(model.config, "reward_bias", 0.0)
    return raw * gain + bias

