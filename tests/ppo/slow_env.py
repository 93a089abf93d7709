"""A single-turn env whose step takes `delay_s`: rollouts and evaluations long enough to be interrupted."""

import asyncio

from envs.base import Action, StepResult
from envs.single_turn import SingleTurnEnv


class SlowSingleTurnEnv(SingleTurnEnv):
    def __init__(self, delay_s: float = 1.5):
        self.delay_s = delay_s

    async def step(self, action: Action) -> StepResult:
        await asyncio.sleep(self.delay_s)
        return await super().step(action)
