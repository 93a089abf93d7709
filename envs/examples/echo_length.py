"""docs/envs.md example: a custom env in a few lines, plugged in by import path.

    env:
      cls: envs.examples.echo_length:TargetLengthEnv
      kwargs: {target_words: 8}

Single turn: the prompt is the sample's `text`; the reward is 1 for a response of exactly
`target_words` words and falls off linearly with the distance from it.
"""

from envs.base import Action, Env, StepResult


class TargetLengthEnv(Env):
    def __init__(self, target_words: int = 8):
        self.target_words = target_words

    async def reset(self, sample: dict) -> str:
        return sample["text"]  # text is fine: the framework tokenizes it on its own

    async def step(self, action: Action) -> StepResult:
        words = len(action.text.split())
        reward = max(0.0, 1.0 - abs(words - self.target_words) / self.target_words)
        return StepResult(observation=None, reward=reward, done=True, info={"words": words})
