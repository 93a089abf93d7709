"""Model loading and the per-token quantities the trainer needs (logprobs, entropy, values, rewards).

Batch convention (the trainer relies on it): a micro-batch is a dict of ``[b, T]`` tensors with
right-padded rows: ``input_ids``, ``attention_mask`` (1 on real tokens), ``position_ids``
(exclusive cumsum of ``attention_mask``) and ``action_mask`` (1 on engine-generated tokens).
Everything per-token is aligned to token positions: ``logprobs[:, t]`` is
``log p(input_ids[:, t] | tokens < t)`` and ``values[:, t]`` is the critic's value of the state
just before token ``t``; position 0 holds 0. Every quantity is therefore masked by
``action_mask`` directly.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Sequence

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

logger = logging.getLogger(__name__)

PAD_TOKEN = "[PAD]"
VALUE_HEAD_FILE = "value_head.safetensors"
REQUIRED_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")


# --------------------------------------------------------------------------- model paths


class ModelPathError(ValueError):
    """A configured model path is neither a local model directory nor a model on the hub."""


HUB_HINT = "a local directory saved with save_pretrained (config.json + weights) or a Hugging Face hub name such as 'gpt2'"


def check_model_path(path: str, key: str, need_config: bool = True) -> None:
    """Fail in one line, before anything loads, when `key`'s model cannot be found.

    A path that exists must be a directory (holding config.json when `need_config`); a path that
    cannot be a hub name (absolute, ./, ../, ~, more than one '/') must exist. Anything else is a
    hub name, looked up once: transformers would retry the hub for tens of seconds per file and
    then report a repo-id or sentencepiece error. With HF_HUB_OFFLINE=1 only the local cache counts.
    """
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelPathError(f"{key}={path} is a file, not a model directory; give {HUB_HINT}")
        if need_config and not (local / "config.json").is_file():
            raise ModelPathError(f"{key}={path} has no config.json, so it is not a Hugging Face model directory; "
                                 f"give {HUB_HINT}")
        return
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or "\\" in path:
        raise ModelPathError(f"{key}={path} does not exist (resolved to {local.resolve()}); fix the path or give "
                             f"{HUB_HINT}")
    reason = _hub_lookup(path)
    if reason is not None:
        raise ModelPathError(f"{key}={path} is not a local directory (no {local.resolve()}) and not a model on the "
                             f"Hugging Face hub ({reason}); give a local directory with config.json, or check the hub "
                             "name and the network")


def _hub_lookup(name: str) -> str | None:
    """None if the hub (or, offline, the local cache) has `name`'s config.json, else why not (one request)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
        if constants.HF_HUB_OFFLINE:
            return "HF_HUB_OFFLINE=1 and it is not in the local cache"
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=10, retry_on_errors=False)
    except HFValidationError:
        return "not a valid repo id"
    except Exception as err:  # noqa: BLE001 - any failure is reported in the one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{type(err).__name__}: {text[:160]}"
    return None


# --------------------------------------------------------------------------- tokenizer and policy


def load_tokenizer(path: str):
    """Load a tokenizer; add a ``[PAD]`` token when it has none.

    OpenAI detail: the pad token is distinct from EOS, so padding never reads as end-of-text.
    An added pad id may lie outside the model's vocabulary: it never reaches the model, because
    ``prepare_inputs`` replaces pad positions with id 0 and the engine is sent unpadded ids.
    """
    tokenizer = AutoTokenizer.from_pretrained(path)
    if tokenizer.pad_token is None:
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        logger.warning("tokenizer at %s had no pad token: added %r (id %d)", path, PAD_TOKEN, tokenizer.pad_token_id)
    return tokenizer


def single_token_id(tokenizer, text: str, config_key: str) -> int:
    """The id of ``text``, which must be exactly one token (e.g. the '.' of OpenAI's truncation)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{config_key}={text!r} is {len(ids)} tokens for this tokenizer; "
                         "it must be exactly one (e.g. '.')")
    return ids[0]


def _config_without_dropout(path: str, **overrides: Any) -> PretrainedConfig:
    """The checkpoint's config with every dropout probability set to 0 (OpenAI detail: no dropout)."""
    config = AutoConfig.from_pretrained(path, **overrides)
    for name, value in list(config.to_dict().items()):
        is_dropout = name.endswith("pdrop") or "dropout" in name
        if is_dropout and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` to p=0 so train mode and eval mode give the same outputs."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM with dropout off everywhere (OpenAI detail: no dropout). `attn_implementation`: the
    attention kernel by transformers' name (None: its default, sdpa where the model has it)."""
    model = AutoModelForCausalLM.from_pretrained(path, config=_config_without_dropout(path), dtype=dtype,
                                                 attn_implementation=attn_implementation)
    return disable_dropout(model)


# --------------------------------------------------------------------------- batches


def prepare_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of a micro-batch, with pad positions' ids replaced by 0.

    OpenAI detail: the pad id may lie outside the pretrained vocabulary, so it must never reach
    the embedding; pad positions are masked out anyway.
    """
    missing = [key for key in REQUIRED_BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(f"micro-batch lacks {missing}; build it with make_micro_batch()")
    attention_mask = batch["attention_mask"]
    input_ids = batch["input_ids"].masked_fill(~attention_mask.bool(), 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": batch["position_ids"]}


def exclusive_cumsum(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding anywhere in a row (OpenAI detail: pads don't shift positions)."""
    mask = attention_mask.long()
    return mask.cumsum(dim=-1) - mask


def _pad_rows(rows: Sequence[Sequence[float]], length: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    out = torch.full((len(rows), length), value, dtype=dtype)
    for i, row in enumerate(rows):
        out[i, : len(row)] = torch.as_tensor(row, dtype=dtype)
    return out


def make_micro_batch(rows: list[dict[str, list]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Collate rows into right-padded ``[b, T]`` tensors.

    Each row needs ``input_ids`` and ``action_mask`` (same length); any other key is a per-token
    float list of the same length (``old_logprobs``, ``advantages``, ...) and is padded with 0.
    ``attention_mask`` may be given per row (e.g. a left-padded query inside the row); otherwise
    every listed token is real.
    """
    if not rows:
        raise ValueError("make_micro_batch got no rows; a micro-batch needs at least one sequence")
    keys = set(rows[0])
    for i, row in enumerate(rows):
        if set(row) != keys:
            raise ValueError(f"row {i} has keys {sorted(row)} but row 0 has {sorted(keys)}; all rows need the same keys")
        if "input_ids" not in row or "action_mask" not in row:
            raise ValueError(f"row {i} needs 'input_ids' and 'action_mask'")
        length = len(row["input_ids"])
        bad = [key for key in row if len(row[key]) != length]
        if length == 0 or bad:
            raise ValueError(f"row {i}: every per-token list must have len(input_ids)={length} > 0; wrong: {bad}")
    length = max(len(row["input_ids"]) for row in rows)
    batch = {"input_ids": _pad_rows([r["input_ids"] for r in rows], length, pad_token_id, torch.long)}
    for key in ("action_mask", "attention_mask"):
        if key in keys:
            batch[key] = _pad_rows([r[key] for r in rows], length, 0, torch.long)
    if "attention_mask" not in batch:
        batch["attention_mask"] = _pad_rows([[1] * len(r["input_ids"]) for r in rows], length, 0, torch.long)
    batch["action_mask"] = batch["action_mask"] * batch["attention_mask"]
    batch["position_ids"] = exclusive_cumsum(batch["attention_mask"])
    for key in sorted(keys - set(batch)):
        batch[key] = _pad_rows([r[key] for r in rows], length, 0.0, torch.float32)
    return batch


@torch.no_grad()
def decode(model, prompts: list[list[int]], max_new_tokens: int, eos_token_id: int | None, pad_token_id: int,
           device: torch.device, temperature: float = 0.0, generator: torch.Generator | None = None,
           batch_size: int = 64) -> list[list[int]]:
    """Greedy (`temperature` 0) or sampled continuations, with a KV cache and exactly
    `max_new_tokens` forwards per batch (no early stop), so a sharded model on every rank runs the
    same collectives; tokens after `eos_token_id` are dropped (None keeps them all: fixed length).
    Prompts are left-padded with position ids counted from the first real token (GPT-2's absolute
    positions, OpenAI's detail)."""
    completions = []
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start:start + batch_size]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        positions = exclusive_cumsum(attention)
        out = model(input_ids=input_ids.masked_fill(attention == 0, 0), attention_mask=attention,
                    position_ids=positions, use_cache=True)
        generated = []
        for _ in range(max_new_tokens):
            logits = out.logits[:, -1].float()
            if temperature > 0:
                probs = torch.softmax(logits / temperature, dim=-1)
                next_ids = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
            else:
                next_ids = logits.argmax(-1, keepdim=True)
            generated.append(next_ids)
            attention = torch.cat([attention, torch.ones_like(next_ids)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=next_ids, attention_mask=attention, position_ids=positions,
                        past_key_values=out.past_key_values, use_cache=True)
        for row in torch.cat(generated, dim=1).tolist():
            completions.append(row[:row.index(eos_token_id)] if eos_token_id in row else row)
    return completions


def grid_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Token positions the model runs on for this micro-batch: the padded or the packed rows' size."""
    return (batch["packed_input_ids"] if "packed_index" in batch else batch["input_ids"]).numel()


def padding_fraction(batch: dict[str, torch.Tensor]) -> float:
    """Share of the grid the model runs on (the packed rows when packed) that is padding (wasted compute)."""
    if "packed_index" in batch:  # a shared prompt is one run of tokens however many sequences read it
        return 1.0 - (batch["packed_segment_ids"] >= 0).sum().item() / batch["packed_segment_ids"].numel()
    return 1.0 - batch["attention_mask"].sum().item() / batch["attention_mask"].numel()


# --------------------------------------------------------------------------- padding-free micro-batches


def pack(batch: dict[str, torch.Tensor], share_prompts: bool = False, one_row: bool = False) -> dict[str, torch.Tensor]:
    """`batch` (from `make_micro_batch`) plus the layout the model then runs on: each row's real tokens
    back to back in as few rows as hold them (first fit, longest first, each row as long as the
    longest unit, so attention costs about what it did padded and only the padding goes).

    `one_row`: every sequence in a single row, no padding at all: the layout flash-attention's varlen
    kernel reads (`models.packs_into_one_row`); with a dense mask it would cost (all tokens)^2.

    A unit is one sequence, or with `share_prompts` every sequence of the micro-batch with the same
    prompt (its real tokens before the first action): the prompt once, then each sequence's rest,
    which attends to the shared prompt and to itself (a GRPO group's responses are computed on one
    copy of their prompt; exact, as the rest of a sequence only ever reads the prompt's keys and values).

    Adds `packed_input_ids`, `packed_position_ids` (each sequence's own positions, the same as the
    padded rows' `exclusive_cumsum`), `packed_segment_ids` (-1 for padding), `packed_context_ids` (the
    segment a position may read besides its own: the shared prompt's, else its own) and `packed_index`
    (where each padded position went, as a flat index into the packed rows; -1 for padding; a shared
    prompt's tokens are one place for all its sequences). The loss side keeps the padded `[b, T]`
    rows: `rows_about_tokens` (and `to_rows` without shared prompts) brings outputs back to them.
    """
    if share_prompts and one_row:
        raise ValueError("a shared prompt is read by other sequences, which flash-attention's varlen kernel cannot "
                         "express; pack with share_prompts or one_row, not both")
    real = batch["attention_mask"].bool()
    columns = [real[row].nonzero().squeeze(1) for row in range(real.shape[0])]
    units = _packing_units(batch, columns, share_prompts)  # (shared prompt length, rows)
    sizes = [prompt + sum(len(columns[row]) - prompt for row in rows) for prompt, rows in units]
    longest = sum(sizes) if one_row else max(sizes)
    bins: list[list[int]] = []
    loads: list[int] = []
    for unit in sorted(range(len(units)), key=lambda u: -sizes[u]):
        fits = next((b for b, load in enumerate(loads) if load + sizes[unit] <= longest), None)
        if fits is None:
            bins.append([unit])
            loads.append(sizes[unit])
        else:
            bins[fits].append(unit)
            loads[fits] += sizes[unit]
    width = max(loads)
    ids = torch.zeros(len(bins), width, dtype=torch.long)  # id 0 under padding (OpenAI detail, prepare_inputs)
    positions = torch.zeros(len(bins), width, dtype=torch.long)
    segments = torch.full((len(bins), width), -1, dtype=torch.long)
    contexts = torch.full((len(bins), width), -1, dtype=torch.long)
    index = torch.full(real.shape, -1, dtype=torch.long)
    segment = 0
    for packed_row, members in enumerate(bins):
        start = 0
        for unit in members:
            prompt, rows = units[unit]
            prompt_segment = segment
            if prompt:  # the shared prompt, once
                span = torch.arange(start, start + prompt)
                first = rows[0]
                ids[packed_row, span] = batch["input_ids"][first, columns[first][:prompt]]
                positions[packed_row, span] = torch.arange(prompt)
                segments[packed_row, span] = contexts[packed_row, span] = segment
                for row in rows:
                    index[row, columns[row][:prompt]] = packed_row * width + span
                start, segment = start + prompt, segment + 1
            for row in rows:  # each sequence's own tokens (all of them when nothing is shared)
                own = columns[row][prompt:]
                span = torch.arange(start, start + len(own))
                ids[packed_row, span] = batch["input_ids"][row, own]
                positions[packed_row, span] = torch.arange(prompt, prompt + len(own))
                segments[packed_row, span] = segment
                contexts[packed_row, span] = prompt_segment if prompt else segment
                index[row, own] = packed_row * width + span
                start, segment = start + len(own), segment + 1
    out = {**batch, "packed_input_ids": ids, "packed_position_ids": positions, "packed_segment_ids": segments,
           "packed_context_ids": contexts, "packed_index": index}
    if any(prompt for prompt, _ in units):
        out["packed_shared_prompts"] = torch.tensor(1)  # marker: `to_rows`' shift does not hold
    if one_row:
        out["packed_one_row"] = torch.tensor(1)  # marker: `model_inputs` passes no mask
    return out


def packs_into_one_row(attn_implementation: str | None) -> bool:
    """Whether packed micro-batches go to the model as one row without a mask (flash-attention: its
    varlen kernel attends within each sequence) rather than as rows with a block-diagonal mask (sdpa, eager)."""
    return "flash" in (attn_implementation or "")  # flash_attention_2/3 and the hub kernels (kernels-community/flash-attn*)


def packing_layout(packing: bool, attn_implementation: str | None) -> str | None:
    """How a job's micro-batches reach the model: None (padded rows), "rows" (`pack`: rows with a
    block-diagonal mask) or "one_row" (`pack(one_row=True)`: flash-attention's varlen layout)."""
    if not packing:
        return None
    return "one_row" if packs_into_one_row(attn_implementation) else "rows"


def laid_out(batch: dict[str, torch.Tensor], layout: str | None, share_prompts: bool = False) -> dict[str, torch.Tensor]:
    """`batch` (from `make_micro_batch`) in the `packing_layout` the job runs."""
    return batch if layout is None else pack(batch, share_prompts=share_prompts, one_row=layout == "one_row")


def prompt_of(real_ids: list[int], real_actions: list[int]) -> tuple[int, ...] | None:
    """The part of a sequence that other sequences may share: its real tokens before its first action;
    None when it has no action or starts with one. Packing and the balancing of shared prompts use it."""
    first = next((position for position, action in enumerate(real_actions) if action), 0)
    return tuple(real_ids[:first]) if first else None


def _packing_units(batch: dict[str, torch.Tensor], columns: list[torch.Tensor],
                   share_prompts: bool) -> list[tuple[int, list[int]]]:
    """`(prompt length, rows)`: rows whose first `prompt length` real tokens are packed once (0: none)."""
    if not share_prompts:
        return [(0, [row]) for row in range(len(columns))]
    by_prompt: dict[tuple[int, ...], list[int]] = {}
    units: list[tuple[int, list[int]]] = []
    for row, real_columns in enumerate(columns):
        prompt = prompt_of(batch["input_ids"][row, real_columns].tolist(), batch["action_mask"][row, real_columns].tolist())
        if prompt is None:
            units.append((0, [row]))
        else:
            by_prompt.setdefault(prompt, []).append(row)
    for prompt, rows in by_prompt.items():
        units.append((len(prompt) if len(rows) > 1 else 0, rows))
    return units


def model_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What the model runs on: the padded rows (`prepare_inputs`), or the packed ones with a
    block-diagonal causal mask (a token sees the earlier tokens of its own sequence, and of its shared
    prompt; padding sees itself), exact with any attention kernel that takes a 4-D boolean mask (sdpa, eager)."""
    if "packed_index" not in batch:
        return prepare_inputs(batch)
    if "packed_one_row" in batch:
        # No mask: transformers' flash path finds each sequence where position_ids restart (`cu_seqlens` for
        # the varlen kernel), and sdpa/eager build the same block-diagonal mask from them; both only without
        # a KV cache, so none is made.
        return {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"],
                "use_cache": False}
    segments = batch["packed_segment_ids"]
    contexts = batch.get("packed_context_ids", segments)
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    same = (segments[:, :, None] == segments[:, None, :]) | (contexts[:, :, None] == segments[:, None, :])
    mask = causal[None] & same
    return {"input_ids": batch["packed_input_ids"], "attention_mask": mask[:, None],
            "position_ids": batch["packed_position_ids"]}


def to_rows(batch: dict[str, torch.Tensor], next_token_values: torch.Tensor) -> torch.Tensor:
    """Per-token model outputs about the *next* token (`[n, L-1]` in the `model_inputs` layout) as
    `[b, T]` about each token of the micro-batch's rows: 0 at t=0, and when packed also at each
    sequence's first real token (nothing of its own predicts it) and at padding."""
    values = _prepend_zero(next_token_values)
    if "packed_index" not in batch:
        return values
    if "packed_shared_prompts" in batch:
        raise ValueError("to_rows shifts by one packed position, which a shared prompt breaks; use rows_about_tokens")
    starts = batch["packed_position_ids"].to(values.device) == 0
    index = batch["packed_index"].to(values.device)
    flat = values.masked_fill(starts, 0.0).flatten()
    return flat[index.clamp(min=0)].masked_fill(index < 0, 0.0)


def _prepend_zero(next_token_values: torch.Tensor) -> torch.Tensor:
    """``[b, T-1]`` quantities about tokens 1..T-1 -> ``[b, T]`` aligned to token positions (0 at t=0)."""
    return torch.nn.functional.pad(next_token_values, (1, 0), value=0.0)


# --------------------------------------------------------------------------- policy quantities


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


# --------------------------------------------------------------------------- critic


class ValueModel(nn.Module):
    """A base transformer with a scalar head: one value per position.

    OpenAI detail: the value head starts at zero (weight and bias), so initial values are 0.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        attn_implementation: str | None = None) -> "ValueModel":
        """Backbone from a causal-LM or value checkpoint; head from ``value_head.safetensors`` if present."""
        config = _config_without_dropout(path)
        backbone = AutoModel.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn_implementation)
        model = cls(disable_dropout(backbone))
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.exists():
            from safetensors.torch import load_file

            model.head.load_state_dict(load_file(str(head_file)))
        return model

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Backbone as a Hugging Face checkpoint plus the head as ``value_head.safetensors``."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(str(out_dir))
        head = {name: tensor.detach().cpu().contiguous() for name, tensor in self.head.state_dict().items()}
        save_file(head, str(Path(out_dir) / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                use_cache: bool = False) -> torch.Tensor:
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache
        ).last_hidden_state
        # A fresh tensor, not a squeeze view: FSDP2 hooks the module output for backward, and a
        # view would let a later in-place op bypass that hook.
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).clone()


def token_values(value_model: nn.Module, batch: dict[str, torch.Tensor]) -> torch.Tensor:
    """``[b, T]``: ``values[:, t]`` is the critic output at t-1 (value before action token t)."""
    return _as_rows(batch, rows_about_tokens(batch, value_model(**model_inputs(batch))), 1, actions_only=False)


# --------------------------------------------------------------------------- reward model


def _score_head(model: PreTrainedModel) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(model).__name__} has no 'score' or 'classifier' head; "
                     "use an AutoModelForSequenceClassification checkpoint with num_labels=1")


def _ensure_gain_bias(model: PreTrainedModel) -> PreTrainedModel:
    """Default gain 1 / bias 0 so any HF sequence-classification checkpoint loads."""
    model.config.reward_gain = float(getattr(model.config, "reward_gain", 1.0))
    model.config.reward_bias = float(getattr(model.config, "reward_bias", 0.0))
    return model


def _set_pad_token_id(model: PreTrainedModel, pad_token_id: int | None) -> None:
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id


def init_reward_model(
    policy_path: str,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
    seed: int | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A fresh reward model (scalar sequence classifier) on top of a causal-LM checkpoint.

    OpenAI detail: head weight ~ N(0, 1/sqrt(d_model + 1)), bias 0; gain 1 and bias 0 until fitted.
    """
    config = _config_without_dropout(policy_path, num_labels=1)
    model = AutoModelForSequenceClassification.from_pretrained(policy_path, config=config, dtype=dtype,
                                                               attn_implementation=attn_implementation)
    _set_pad_token_id(model, pad_token_id)
    head = _score_head(model)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    d_model = head.weight.shape[1]
    with torch.no_grad():
        init = torch.randn(head.weight.shape, generator=generator) / (d_model + 1) ** 0.5
        head.weight.copy_(init.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()
    set_reward_gain_bias(model, 1.0, 0.0)
    return disable_dropout(model)


def load_reward_model(path: str, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None,
                      attn_implementation: str | None = None) -> PreTrainedModel:
    """A trained reward model (any HF seq-cls checkpoint with one label); gain/bias from its config."""
    config = _config_without_dropout(path)
    if config.num_labels != 1:
        raise ValueError(f"reward model at {path} has num_labels={config.num_labels}; a scalar reward needs 1")
    model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                               attn_implementation=attn_implementation)
    _set_pad_token_id(model, pad_token_id)
    return disable_dropout(_ensure_gain_bias(model))


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
    handle = _score_head(model).register_forward_hook(lambda module, args, output: captured.append(output))
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


def set_reward_gain_bias(model: PreTrainedModel, gain: float, bias: float) -> None:
    """Store the normalisation in the config so ``save_pretrained`` carries it."""
    model.config.reward_gain, model.config.reward_bias = float(gain), float(bias)


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence a model's positions allow (None when its config does not say)."""
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch on `device`."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
