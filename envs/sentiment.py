"""The OpenAI stylistic continuation task (lm-human-preferences: sentiment, descriptiveness).

Single turn: the query is a fixed-length, left-padded window of token ids taken from a book
corpus; the policy writes a fixed-length continuation; a learned reward model scores
query + response. The env itself gives reward 0: the trainer applies the reward model after the
rollout, and the OpenAI truncation rule (cut at the first period after token 16, fixed -1 reward
when there is none) is applied by the trainer through `rl_core.algorithms`, since it changes
what the reward model reads, not what the engine sampled.

Samples carry `query_ids` (or `prompt_ids`), already tokenized by the data pipeline. When
`query_length` and `pad_token_id` are given, the env enforces the OpenAI layout itself: it keeps
the last `query_length` ids and left-pads shorter queries with the pad token (distinct from EOS).
"""

from __future__ import annotations

from envs.base import Action, Env, StepResult


class SentimentEnv(Env):
    """One fixed-length query in, one response out, reward 0 (the reward model comes later)."""

    def __init__(self, query_length: int | None = None, pad_token_id: int | None = None,
                 truncate_token_id: int | None = None, truncate_after: int = 16):
        if query_length is not None and (query_length < 1 or pad_token_id is None):
            raise ValueError("SentimentEnv: query_length must be >= 1 and needs pad_token_id to left-pad queries")
        self.query_length = query_length
        self.pad_token_id = pad_token_id
        self.truncate_token_id = truncate_token_id
        self.truncate_after = truncate_after

    async def reset(self, sample: dict) -> list[int]:
        ids = sample.get("query_ids", sample.get("prompt_ids"))
        if ids is None:
            raise KeyError(f"SentimentEnv needs 'query_ids' or 'prompt_ids' in each sample, got keys {sorted(sample)}")
        ids = [int(i) for i in ids]
        if self.query_length is not None:
            ids = ids[-self.query_length:]
            ids = [self.pad_token_id] * (self.query_length - len(ids)) + ids  # OpenAI: left-pad with [PAD], not EOS
        return ids

    async def step(self, action: Action) -> StepResult:
        return StepResult(observation=None, reward=0.0, done=True, info=self._flags(action))

    def _flags(self, action: Action) -> dict:
        """Facts the trainer may log; the truncation itself is the trainer's job."""
        info = {"response_tokens": len(action.token_ids), "engine_finish": action.finish_reason}
        if self.truncate_token_id is not None:
            tail = action.token_ids[self.truncate_after:]
            info["has_truncate_token"] = self.truncate_token_id in tail
        return info
