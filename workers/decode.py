"""Greedy or sampled decoding with a sharded model on every rank, for the jobs' evaluations and the
reward model's normalisation samples (the PPO job generates through its engines instead: the jobs on fixed data
start no engine, and their few hundred short samples would not repay starting one).

Written here rather than through transformers' `generate`: the draws come from the caller's seeded generator
(the same samples whatever else used the global random stream, on every resume), EOS ends nothing (OpenAI's
fixed-length samples), and every batch runs exactly `max_new_tokens` forwards, so a sharded model's collectives
line up on every rank without `generate`'s per-token agreement between ranks."""

from __future__ import annotations

import dataclasses

import torch

from workers.layout import exclusive_cumsum
from workers.loading import cache_keyword


@dataclasses.dataclass(frozen=True)
class DecodeSettings:
    """What `decode` generates: how many tokens, where a completion ends, greedy or sampled."""
    max_new_tokens: int
    eos_token_id: int | None  # tokens after it are dropped; None keeps them all (fixed length)
    temperature: float = 0.0  # 0: greedy


@torch.no_grad()
def decode(model, prompts: list[list[int]], settings: DecodeSettings, pad_token_id: int, device: torch.device,
           generator: torch.Generator | None = None, batch_size: int = 64) -> list[list[int]]:
    """Greedy (`settings.temperature` 0) or sampled continuations, with a KV cache and exactly
    `settings.max_new_tokens` forwards per batch (no early stop), so a sharded model on every rank
    runs the same collectives; tokens after `settings.eos_token_id` are dropped (None keeps them
    all: fixed length). Prompts are left-padded with position ids counted from the first real token
    (GPT-2's absolute positions, OpenAI's detail)."""
    completions = []
    keyword = cache_keyword(model)
    for start in range(0, len(prompts), batch_size):
        rows = prompts[start:start + batch_size]
        width = max(len(r) for r in rows)
        input_ids = torch.tensor([[pad_token_id] * (width - len(r)) + r for r in rows], device=device)
        attention = torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in rows], device=device)
        positions = exclusive_cumsum(attention)
        out = model(input_ids=input_ids.masked_fill(attention == 0, 0), attention_mask=attention,
                    position_ids=positions, use_cache=True)
        generated = []
        for _ in range(settings.max_new_tokens):
            logits = out.logits[:, -1].float()
            if settings.temperature > 0:
                probs = torch.softmax(logits / settings.temperature, dim=-1)
                next_ids = torch.multinomial(probs.cpu(), 1, generator=generator).to(device)
            else:
                next_ids = logits.argmax(-1, keepdim=True)
            generated.append(next_ids)
            attention = torch.cat([attention, torch.ones_like(next_ids)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=next_ids, attention_mask=attention, position_ids=positions,
                        use_cache=True, **{keyword: getattr(out, keyword)})
        for row in torch.cat(generated, dim=1).tolist():
            completions.append(row[:row.index(settings.eos_token_id)] if settings.eos_token_id in row else row)
    return completions

