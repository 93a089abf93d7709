"""The OpenAI stylistic continuation task (lm-human-preferences: sentiment, descriptiveness).

Single turn: the query is a window of token ids taken from a book corpus; the policy writes a
fixed-length continuation; a learned reward model scores query + response. The env itself gives
reward 0: the trainer applies the reward model after the rollout, and the OpenAI truncation rule
(cut at the first period after token 16, fixed -1 reward when there is none) is applied by the
trainer (`rl_core.rewards.lm_human_preferences`), since it changes what the reward model reads,
not what the engine sampled.

Samples carry `query_ids` (or `prompt_ids`), already tokenized and cut to length by the data
pipeline (OpenAI's query mode, `data.on_long_prompt=truncate`); they are used as they are.
"""

from __future__ import annotations

from envs.base import Action, Env, StepResult


class SentimentEnv(Env):
    """One query in, one response out, reward 0 (the reward model comes later)."""

    async def reset(self, sample: dict) -> list[int]:
        ids = sample.get("query_ids", sample.get("prompt_ids"))
        if ids is None:
            raise KeyError(f"SentimentEnv needs 'query_ids' or 'prompt_ids' in each sample, got keys {sorted(sample)}")
        return [int(i) for i in ids]

    async def step(self, action: Action) -> StepResult:
        # Facts the trainer may log; the truncation itself is the trainer's job.
        info = {"response_tokens": len(action.token_ids), "engine_finish": action.finish_reason}
        return StepResult(observation=None, reward=0.0, done=True, info=info)
