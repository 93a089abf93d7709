"""Batch layout: rows collated into right-padded `[b, T]` tensors, and the padding-free (packed)
layout the model may run on instead.

Convention every worker relies on: a micro-batch is a dict of ``[b, T]`` tensors with right-padded
rows: ``input_ids``, ``attention_mask`` (1 on real tokens), ``position_ids`` (exclusive cumsum of
``attention_mask``) and ``action_mask`` (1 on engine-generated or trained tokens). Packed, it also
holds the ``packed_*`` tensors (`pack`); `model_inputs` gives what the model runs on either way, and
`workers.forward` brings the outputs back to the padded rows.
"""

from __future__ import annotations

from typing import Any, Sequence

import torch

REQUIRED_BATCH_KEYS = ("input_ids", "attention_mask", "position_ids")


def prepare_inputs(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The model inputs of a micro-batch, with pad positions' ids replaced by 0.

    OpenAI detail: the pad id may lie outside the pretrained vocabulary, so it must never reach
    the embedding; pad positions are masked out anyway.
    """
    missing = [key for key in REQUIRED_BATCH_KEYS if key not in batch]
    if missing:
        raise ValueError(f"micro-batch lacks {missing}; build it with rows_to_batch()")
    attention_mask = batch["attention_mask"]
    input_ids = batch["input_ids"].masked_fill(~attention_mask.bool(), 0)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "position_ids": batch["position_ids"]}


def exclusive_cumsum(attention_mask: torch.Tensor) -> torch.Tensor:
    """Position ids that skip padding anywhere in a row (OpenAI detail: pads don't shift positions)."""
    mask = attention_mask.long()
    return mask.cumsum(dim=-1) - mask


def pad_rows(rows: Sequence[Sequence[float]], length: int, value: float, dtype: torch.dtype) -> torch.Tensor:
    """Right-padded `[len(rows), length]`: one tensor from all rows' values and one masked write, not a tensor
    per row (256 rows x 5 keys made ~8,000 small ops per step)."""
    lengths = torch.tensor([len(row) for row in rows])
    out = torch.full((len(rows), length), value, dtype=dtype)
    out[torch.arange(length) < lengths[:, None]] = torch.tensor([v for row in rows for v in row], dtype=dtype)
    return out


def rows_to_batch(rows: list[dict[str, list]], pad_token_id: int) -> dict[str, torch.Tensor]:
    """A job's rows (lists per token) as one batch of right-padded ``[N, T]`` tensors: the whole step's batch,
    which the worker later cuts into micro-batches.

    Each row needs ``input_ids`` and ``action_mask`` (same length); any other key is a per-token
    float list of the same length (``old_logprobs``, ``advantages``, ...) and is padded with 0.
    ``attention_mask`` may be given per row (e.g. a left-padded query inside the row); otherwise
    every listed token is real.
    """
    if not rows:
        raise ValueError("rows_to_batch got no rows; a batch needs at least one sequence")
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
    batch = {"input_ids": pad_rows([r["input_ids"] for r in rows], length, pad_token_id, torch.long)}
    for key in ("action_mask", "attention_mask"):
        if key in keys:
            batch[key] = pad_rows([r[key] for r in rows], length, 0, torch.long)
    if "attention_mask" not in batch:
        batch["attention_mask"] = pad_rows([[1] * len(r["input_ids"]) for r in rows], length, 0, torch.long)
    batch["action_mask"] = batch["action_mask"] * batch["attention_mask"]
    batch["position_ids"] = exclusive_cumsum(batch["attention_mask"])
    for key in sorted(keys - set(batch)):
        batch[key] = pad_rows([r[key] for r in rows], length, 0.0, torch.float32)
    return batch



def grid_tokens(batch: dict[str, torch.Tensor]) -> int:
    """Token positions the model runs on for this micro-batch: the padded or the packed rows' size."""
    return (batch["packed_input_ids"] if "packed_index" in batch else batch["input_ids"]).numel()


def padding_fraction(batch: dict[str, torch.Tensor]) -> float:
    """Share of the grid the model runs on (the packed rows when packed) that is padding (wasted compute)."""
    if "packed_index" in batch:  # a shared prompt is one run of tokens however many sequences read it
        return 1.0 - (batch["packed_segment_ids"] >= 0).sum().item() / batch["packed_segment_ids"].numel()
    return 1.0 - batch["attention_mask"].sum().item() / batch["attention_mask"].numel()


# --------------------------------------------------------------------------- padding-free micro-batches


def pack(batch: dict[str, torch.Tensor], share_prompts: bool = False, one_row: bool = False,
         multiple: int = 1) -> dict[str, torch.Tensor]:
    """`batch` (from `rows_to_batch`) plus the layout the model then runs on: each row's real tokens
    back to back in as few rows as hold them (first fit, longest first, each row as long as the
    longest unit, so attention costs about what it did padded and only the padding goes).

    `one_row`: every sequence in a single row, no padding at all: the layout flash-attention's varlen
    kernel reads (`models.packs_into_one_row`); with a dense mask it would cost (all tokens)^2.
    `multiple`: the rows' length is padded to a multiple of it (a sequence-parallel group's size).

    A unit is one sequence, or with `share_prompts` every sequence of the micro-batch with the same
    prompt (its real tokens before the first action): the prompt once, then each sequence's rest,
    which attends to the shared prompt and to itself (a GRPO group's responses are computed on one
    copy of their prompt; exact, as the rest of a sequence only ever reads the prompt's keys and values).

    Adds `packed_input_ids`, `packed_position_ids` (each sequence's own positions, the same as the
    padded rows' `exclusive_cumsum`), `packed_segment_ids` (-1 for padding), `packed_context_ids` (the
    segment a position may read besides its own: the shared prompt's, else its own) and `packed_index`
    (where each padded position went, as a flat index into the packed rows; -1 for padding; a shared
    prompt's tokens are one place for all its sequences). The loss side keeps the padded `[b, T]`
    rows: `workers.forward.rows_about_tokens` brings outputs back to them.
    """
    if share_prompts and one_row:
        raise ValueError("a shared prompt is read by other sequences, which flash-attention's varlen kernel cannot "
                         "express; pack with share_prompts or one_row, not both")
    # Placement is planned per unit and row with plain integers, then every token is moved by one scatter: per-row
    # tensor ops (a few thousand for 256 rows) cost ~0.1 s of host time per micro-batch, which a GPU waits for.
    real = batch["attention_mask"].bool()
    lengths = real.sum(dim=1).tolist()
    group, prompt_length = prompt_groups(batch) if share_prompts else (list(range(len(lengths))), [0] * len(lengths))
    members: dict[int, list[int]] = {}
    for row, g in enumerate(group):
        members.setdefault(g, []).append(row)
    units = [(prompt_length[rows[0]], rows) for rows in members.values()]  # (shared prompt length, rows)
    sizes = [prompt + sum(lengths[row] - prompt for row in rows) for prompt, rows in units]
    longest = sum(sizes) if one_row else max(sizes)
    bins: list[list[int]] = []
    loads: list[int] = []
    for unit in sorted(range(len(units)), key=lambda u: -sizes[u]):  # first fit, longest first
        fits = next((b for b, load in enumerate(loads) if load + sizes[unit] <= longest), None)
        if fits is None:
            bins.append([unit])
            loads.append(sizes[unit])
        else:
            bins[fits].append(unit)
            loads[fits] += sizes[unit]
    width = -(-max(loads) // multiple) * multiple
    # Per row: where its prompt and its own tokens start (flat, in the packed rows), and their segments.
    n = len(lengths)
    prompt_start, own_start, prompt_segment, own_segment = [0] * n, [0] * n, [0] * n, [0] * n
    segment = 0
    for packed_row, bin_units in enumerate(bins):
        start = packed_row * width
        for unit in bin_units:
            prompt, rows = units[unit]
            shared_start, shared_segment = start, segment
            if prompt:  # the shared prompt, once
                start, segment = start + prompt, segment + 1
            for row in rows:
                prompt_start[row], prompt_segment[row] = shared_start, shared_segment
                own_start[row], own_segment[row] = start, segment
                start, segment = start + lengths[row] - prompt, segment + 1
    rows_of, columns_of = real.nonzero(as_tuple=True)
    rank = exclusive_cumsum(real)[rows_of, columns_of]  # a real token's place among its row's real tokens
    row_prompt = torch.tensor(prompt_length)[rows_of]
    in_prompt = rank < row_prompt
    where = torch.where(in_prompt, torch.tensor(prompt_start)[rows_of] + rank,
                        torch.tensor(own_start)[rows_of] + rank - row_prompt)
    token_segment = torch.where(in_prompt, torch.tensor(prompt_segment)[rows_of], torch.tensor(own_segment)[rows_of])
    shape = (len(bins), width)
    ids = torch.zeros(shape, dtype=torch.long)  # id 0 under padding (OpenAI detail, prepare_inputs)
    positions = torch.zeros(shape, dtype=torch.long)
    segments = torch.full(shape, -1, dtype=torch.long)
    contexts = torch.full(shape, -1, dtype=torch.long)
    ids.view(-1)[where] = batch["input_ids"][rows_of, columns_of]  # a shared prompt's rows write the same ids
    positions.view(-1)[where] = rank
    segments.view(-1)[where] = token_segment
    contexts.view(-1)[where] = torch.where(row_prompt > 0, torch.tensor(prompt_segment)[rows_of], token_segment)
    index = torch.full(real.shape, -1, dtype=torch.long)
    index[rows_of, columns_of] = where
    out = {**batch, "packed_input_ids": ids, "packed_position_ids": positions, "packed_segment_ids": segments,
           "packed_context_ids": contexts, "packed_index": index}
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


def laid_out(batch: dict[str, torch.Tensor], layout: str | None, share_prompts: bool = False,
             multiple: int = 1) -> dict[str, torch.Tensor]:
    """`batch` (from `rows_to_batch`) in the `packing_layout` the job runs (`multiple`: see `pack`)."""
    if layout is None:
        return batch
    return pack(batch, share_prompts=share_prompts, one_row=layout == "one_row", multiple=multiple)


def prompt_groups(batch: dict[str, torch.Tensor]) -> tuple[list[int], list[int]]:
    """Rows that share a prompt (their real tokens before their first action; a row without an action, or
    starting with one, has none): each row's group (numbered in order of first appearance) and the length of
    the prompt its group shares (0: a group of one, nothing shared). Packing and the balancing of shared
    prompts use it. Found with tensor ops over the whole batch, not a Python pass over each row's tokens."""
    real = batch["attention_mask"].bool()
    acting = batch["action_mask"].bool() & real
    rank = exclusive_cumsum(real)
    n = real.shape[0]
    # real tokens before the first action: the rank of the first action (0 when there is none: no prompt)
    first_action = torch.where(acting, rank, real.shape[1]).min(dim=1).values
    prompt = torch.where(acting.any(dim=1), first_action, 0)
    longest = int(prompt.max()) if n else 0
    keys = torch.full((n, longest + 1), -1, dtype=torch.long)
    keys[:, 0] = prompt
    in_prompt = real & (rank < prompt[:, None])
    rows, columns = in_prompt.nonzero(as_tuple=True)
    keys[rows, rank[rows, columns] + 1] = batch["input_ids"][rows, columns]
    _, key_of = torch.unique(keys, dim=0, return_inverse=True)
    alone = (prompt == 0).tolist()
    group_of_key: dict[int, int] = {}
    group, members = [], []
    for row, key in enumerate(key_of.tolist()):
        g = len(members) if alone[row] else group_of_key.setdefault(key, len(members))
        if g == len(members):
            members.append(0)
        members[g] += 1
        group.append(g)
    prompts = prompt.tolist()
    return group, [prompts[row] if members[g] > 1 else 0 for row, g in enumerate(group)]


def model_inputs(batch: dict[str, torch.Tensor], config=None) -> dict[str, Any]:
    """What the model (`config`: its transformers config) runs on: the padded rows (`prepare_inputs`;
    transformers builds the masks), or the packed rows with a block-diagonal causal mask (a token sees the
    earlier tokens of its own sequence and of its shared prompt; padding sees itself), exact with any kernel
    that takes a 4-D mask (sdpa, eager): `attention_masks` makes it in the form the model's kernel and layers read."""
    if "packed_index" not in batch:
        return padded_inputs(batch, config)
    if "packed_one_row" in batch:
        # No mask: transformers' flash path finds each sequence where position_ids restart (`cu_seqlens` for
        # the varlen kernel), and sdpa/eager build the same block-diagonal mask from them.
        return {"input_ids": batch["packed_input_ids"], "position_ids": batch["packed_position_ids"]}
    return {"input_ids": batch["packed_input_ids"], "attention_mask": attention_masks(batch, config),
            "position_ids": batch["packed_position_ids"]}


def host_view(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A micro-batch's tensors on the host (`workers.forward.MicroBatch.host`; itself when it has no host copy):
    its structure (which tokens are real or actions) is read from there, because a `nonzero`, `.all()` or
    `.item()` on the device waits until the device has finished all it was given."""
    host = getattr(batch, "host", None)
    return batch if host is None else host


def padded_inputs(batch: dict[str, torch.Tensor], config=None) -> dict[str, Any]:
    """`prepare_inputs` with the mask decided on the host: none when every token is real (the kernel's own causal
    mask), else the `[b, 1, T, T]` mask of `attention_masks` (a token sees the earlier real tokens of its row).
    Given the 2-D mask, transformers reads it back (`.all()`) at every forward to choose between the two: a
    device stall per forward on a GPU. Flash-attention takes the 2-D mask (its varlen kernel unpads by it)."""
    inputs = prepare_inputs(batch)
    if "flash" in str(getattr(config, "_attn_implementation", "")):
        return inputs
    real = host_view(batch)["attention_mask"].bool()
    if bool(real.all()):
        # Every token real: the model's own causal mask and positions 0..T-1 (given position ids, transformers
        # would search them for packed sequences: another read).
        return {"input_ids": inputs["input_ids"], "attention_mask": None, "position_ids": None}
    segments = torch.where(batch["attention_mask"].bool(), 0, -1)  # padding sees padding, never a real token
    inputs["attention_mask"] = attention_masks({"packed_segment_ids": segments,
                                                "packed_position_ids": batch["position_ids"]}, config)
    return inputs


def attention_masks(batch: dict[str, torch.Tensor], config=None) -> torch.Tensor | dict[str, torch.Tensor]:
    """The packed rows' `[n, 1, L, L]` mask as `config`'s model reads a mask it is given whole:

    - sliding-window layers see only the last `sliding_window` positions (transformers' rule, key position
      > query position - window), so a model with `layer_types` gets one mask per layer type and one with
      only `sliding_window` (Mistral, Phi3) the windowed mask;
    - given the model's `config`, the mask is additive: 0 / a large negative float. Eager attention *adds* its
      mask to the scores (a boolean mask added as 1/0 masks nothing: Gemma 2, eager by default, read other
      sequences' tokens), and sdpa turns a boolean mask into that form in every layer (`[n, 1, L, L]` twice
      per layer and step), so it is made once here. Without `config`: the boolean mask (True = may read)."""
    segments = batch["packed_segment_ids"]
    contexts = batch.get("packed_context_ids", segments)
    length = segments.shape[1]
    # In place, and the additive form by one `where`: the mask is [n, L, L] (16 x 448 x 448 at gpu86m's shape),
    # and the temporaries this once made cost 12 ms of a CPU per micro-batch (3 ms now).
    full = segments[:, :, None] == segments[:, None, :]
    full |= contexts[:, :, None] == segments[:, None, :]
    full &= torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    full = full[:, None]
    window = getattr(config, "sliding_window", None)
    if window:
        positions = batch["packed_position_ids"]
        sliding = full & (positions[:, None, None, :] > positions[:, None, :, None] - window)
    layer_types = set(getattr(config, "layer_types", None) or ())
    if layer_types:
        masks = {kind: sliding if window and kind == "sliding_attention" else full for kind in layer_types}
    else:
        masks = {"all": sliding if window else full}
    if config is not None:
        additive: dict[int, torch.Tensor] = {}  # one float mask per distinct boolean one (layer types share theirs)
        for mask in masks.values():
            if id(mask) not in additive:
                additive[id(mask)] = torch.where(mask, 0.0, torch.finfo(torch.float32).min)
        masks = {kind: additive[id(mask)] for kind, mask in masks.items()}
    return masks if layer_types else masks["all"]


def to_device(batch: dict[str, torch.Tensor], device: torch.device) -> dict[str, torch.Tensor]:
    """A collated micro-batch on `device`."""
    return {key: value.to(device, non_blocking=True) for key, value in batch.items()}
