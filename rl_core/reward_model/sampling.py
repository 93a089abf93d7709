"""Sampling from the reference policy for reward normalisation: queries, fixed-length responses,
OpenAI's period truncation, and each rank's share of the queries."""

from __future__ import annotations

import math

import torch

from rl_core.rewards.lm_human_preferences import truncated_ids
from rl_core.reward_model.config import NormalizeConfig
from workers.decode import DecodeSettings, decode
from workers.loading import single_token_id


def load_queries(path: str, text_key: str, tokenizer, query_length: int) -> list[list[int]]:
    """Token ids of each prompt in a prompt file (see rl_core.data), cut to ``query_length`` tokens."""
    from rl_core.data import ConfigKeys, load_prompt_dataset

    keys = ConfigKeys(path="normalize.prompts_path", text_key="normalize.text_key", on_malformed=None)
    texts = load_prompt_dataset(path, text_key=text_key, keys=keys).texts()
    ids = [row[:query_length] for row in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [row for row in ids if row]


@torch.no_grad()
def sample_responses(policy, tokenizer, queries: list[list[int]], response_length: int,
                     temperature: float, seed: int, batch_size: int = 64, desc: str | None = None) -> list[list[int]]:
    """Fixed-length continuations of each query from the reference policy, through the trainer's one decoder
    (`workers.decode`).

    OpenAI details: sampling with top_k=0 / top_p=1 at the given temperature, and exactly
    ``response_length`` tokens: EOS does not stop a sample. The draws come from a generator seeded with
    `seed`, so callers' random streams are untouched.
    `desc`: show a progress bar with that title (sampling thousands of queries takes minutes on a CPU).
    """
    from rl_core.logger import progress_bar

    settings = DecodeSettings(max_new_tokens=response_length, eos_token_id=None, temperature=temperature)
    device = next(policy.parameters()).device
    generator = torch.Generator().manual_seed(seed)
    responses: list[list[int]] = []
    starts = range(0, len(queries), batch_size)
    for start in progress_bar(starts, desc=desc or "", enabled=desc is not None, unit="batch"):
        responses.extend(decode(policy, queries[start:start + batch_size], settings, tokenizer.pad_token_id, device,
                                generator, batch_size))
    return responses


def sample_truncated(policy, tokenizer, queries: list[list[int]], cfg: NormalizeConfig,
                     seed: int, desc: str | None = None) -> tuple[list[list[int]], torch.Tensor]:
    """Reference-policy responses as the PPO job's reward model reads them, and which are scored.

    OpenAI rejection sampling: each response is cut through its first ``cfg.truncate_token`` at
    or after ``cfg.truncate_after``; a response without one keeps its full length and is marked
    not valid (PPO penalises it instead of scoring it).
    """
    responses = sample_responses(policy, tokenizer, queries, cfg.response_length, cfg.temperature, seed,
                                 cfg.batch_size, desc)
    if cfg.truncate_token is None:
        return responses, torch.ones(len(responses), dtype=torch.bool)
    token = single_token_id(tokenizer, cfg.truncate_token, "normalize.truncate_token")
    cut = [truncated_ids(response, token, cfg.truncate_after) for response in responses]
    valid = torch.tensor([c is not None for c in cut], dtype=torch.bool)
    return [c if c is not None else r for c, r in zip(cut, responses)], valid


def pick_queries(queries: list[list[int]], num: int, seed: int, rank: int, world_size: int) -> list[list[int]]:
    """This rank's share of ``num`` queries drawn (with repeats if needed) from the whole set.

    Every rank gets the same count, ``ceil(num / world_size)``, so forward passes line up.
    """
    per_rank = math.ceil(num / world_size)
    generator = torch.Generator().manual_seed(seed)
    rounds = math.ceil(per_rank * world_size / len(queries))
    order = torch.cat([torch.randperm(len(queries), generator=generator) for _ in range(rounds)])
    mine = order[rank * per_rank:(rank + 1) * per_rank]
    return [queries[i] for i in mine.tolist()]
