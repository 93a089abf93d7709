"""What a model says about a micro-batch's tokens: logprobs, entropies, values, reward scores.

One alignment rule (`rows_about_tokens`): the output about token ``t`` of a padded row is the model's
output at the position just before it, gathered through the packed layout when packed. So
``logprobs[:, t]`` is ``log p(input_ids[:, t] | tokens < t)`` and ``values[:, t]`` the critic's
value of the state just before token ``t``; a sequence's first token holds 0. Every quantity is
therefore masked by ``action_mask`` directly.
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedModel

from workers.layout import model_inputs
from workers.loading import score_head


def logprobs_from_logits(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[labels]`` without materialising the full log-softmax.

    Half-precision logits are processed one row at a time in float32, keeping the extra memory
    at one row of the vocabulary-sized tensor.
    """
    if logits.shape[:-1] != labels.shape:
        raise ValueError(f"logits {tuple(logits.shape)} must be labels {tuple(labels.shape)} plus a vocab dim")
    if logits.dtype in (torch.float32, torch.float64):
        picked = logits.gather(-1, labels.unsqueeze(-1)).squeeze(-1)
        return picked - torch.logsumexp(logits, dim=-1)
    rows = [
        torch.log_softmax(row.float(), dim=-1).gather(-1, row_labels.unsqueeze(-1)).squeeze(-1)
        for row, row_labels in zip(logits, labels)
    ]
    return torch.stack(rows)


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of the softmax distribution along the last dim: ``logsumexp(z) - sum(p * z)``."""
    probs = torch.softmax(logits.float(), dim=-1)
    return torch.logsumexp(logits.float(), dim=-1) - (probs * logits.float()).sum(dim=-1)


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


def _token_logits(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float, first: int) -> torch.Tensor:
    """`[b, T-first, V]` logits about tokens `first`..T-1 (`first` >= 1) of the padded rows; padded rows
    run the LM head on those positions only."""
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}; use the sampling temperature")
    packed = "packed_index" in batch
    keep = {"logits_to_keep": batch["input_ids"].shape[1] - first + 1} if first > 1 and not packed else {}
    logits = model(**model_inputs(batch), **keep).logits
    logits = rows_about_tokens(batch, logits, first) if packed else logits[:, :-1]
    # OpenAI detail: logprobs come from logits / sampling temperature, matching the sampler.
    return logits / temperature


def _first_needed(batch: dict[str, torch.Tensor], actions_only: bool) -> int:
    """The first token whose logprob is wanted: 1, or with `actions_only` the leftmost action column (the
    prompt's logits are never used, and the LM head over a large vocabulary is a good share of a small
    model's compute; TRL and veRL skip it the same way)."""
    length = batch["input_ids"].shape[1]
    if not actions_only or length < 3:
        return 1
    columns = batch["action_mask"].any(dim=0).nonzero()
    first = int(columns[0]) if len(columns) else length - 1  # a stand-in: one position keeps the graph whole
    return min(max(first, 1), length - 1)


def _labels(batch: dict[str, torch.Tensor], first: int, device: torch.device) -> torch.Tensor:
    """Tokens `first`..T-1 of the padded rows, id 0 under padding (a pad id may lie outside the vocabulary)."""
    ids = batch["input_ids"][:, first:].masked_fill(batch["attention_mask"][:, first:] == 0, 0)
    return ids.to(device)


def _as_rows(batch: dict[str, torch.Tensor], values: torch.Tensor, first: int, actions_only: bool) -> torch.Tensor:
    """Values about tokens `first`..T-1 as `[b, T]` rows: 0 before `first`, at each sequence's first real
    token (nothing of its own predicts it) and, with `actions_only`, off the actions."""
    rows = torch.nn.functional.pad(values, (first, 0))
    keep = batch["action_mask"] if actions_only else _has_previous_token(batch)
    return rows * keep.to(rows.device, rows.dtype)


def _has_previous_token(batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """`[b, T]` 1 where a token and the one before it are real: every real token but the first (padded
    rows keep every column but 0, as they always did; the losses mask padding)."""
    if "packed_index" not in batch:
        keep = torch.ones_like(batch["attention_mask"])
        keep[:, 0] = 0
        return keep
    index = batch["packed_index"]
    previous = torch.nn.functional.pad(index[:, :-1], (1, 0), value=-1)
    return ((previous >= 0) & (index >= 0)).long()


def token_logprobs(model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0,
                   actions_only: bool = False) -> torch.Tensor:
    """``[b, T]``: ``log p(input_ids[:, t] | < t)`` at temperature; 0 at t=0, and with `actions_only`
    0 on every token that is not an action (computed for the actions only)."""
    first = _first_needed(batch, actions_only)
    logits = _token_logits(model, batch, temperature, first)
    return _as_rows(batch, logprobs_from_logits(logits, _labels(batch, first, logits.device)), first, actions_only)


def token_logprobs_and_hits(model: nn.Module, batch: dict[str, torch.Tensor],
                            actions_only: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, T]`` logprobs (temperature 1) and whether the argmax was the token (SFT's token accuracy)."""
    first = _first_needed(batch, actions_only)
    logits = _token_logits(model, batch, 1.0, first)
    labels = _labels(batch, first, logits.device)
    hits = (logits.detach().argmax(-1) == labels).float()
    return (_as_rows(batch, logprobs_from_logits(logits, labels), first, actions_only),
            _as_rows(batch, hits, first, actions_only))


def token_logprobs_and_entropy(
    model: nn.Module, batch: dict[str, torch.Tensor], temperature: float = 1.0, entropy_grad: bool = True,
    actions_only: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[b, T]`` logprobs and entropies of the distribution each token was drawn from (`actions_only`:
    see `token_logprobs`).

    ``entropy_grad=False`` (no entropy bonus: the entropy is only logged) keeps the vocabulary-wide
    entropy out of the backward pass.
    """
    first = _first_needed(batch, actions_only)
    logits = _token_logits(model, batch, temperature, first)
    logprobs = logprobs_from_logits(logits, _labels(batch, first, logits.device))
    entropy = entropy_from_logits(logits if entropy_grad else logits.detach())
    return _as_rows(batch, logprobs, first, actions_only), _as_rows(batch, entropy, first, actions_only)


def token_values(value_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, T]``: ``values[:, t]`` is the critic output at t-1 (value before action token t)."""
    return _as_rows(batch, rows_about_tokens(batch, value_model(**model_inputs(batch))), 1, actions_only=False)


def last_token_index(attention_mask: torch.Tensor) -> torch.Tensor:
    """``[b]`` index of each row's last attended token (rows may hold padding on both sides)."""
    positions = torch.arange(attention_mask.shape[-1], device=attention_mask.device).expand_as(attention_mask)
    last = torch.where(attention_mask.bool(), positions, -1).max(dim=-1).values
    if (last < 0).any():
        raise ValueError("a row has no attended token; every sequence needs at least one real token")
    return last


def raw_reward_scores(model: PreTrainedModel, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b]`` head output at each row's last real token, before gain/bias (`batch` from
    `make_micro_batch`, packed or not).

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
        model(**model_inputs(batch))
    finally:
        handle.remove()
    per_position = captured[0].squeeze(-1)
    last = last_token_index(batch["attention_mask"]).to(per_position.device)
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

