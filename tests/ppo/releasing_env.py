"""A test environment that releases every engine's memory before its first episode, as a job bug would."""

import json
from pathlib import Path

import aiohttp

from envs.base import Action, Env, StepResult


class ReleaseEnginesEnv(Env):
    def __init__(self, run_dir: str):
        self.run_dir = Path(run_dir)
        self.released = False

    async def reset(self, sample: dict):
        if not self.released:
            workers = json.loads((self.run_dir / "logs" / "engines.json").read_text())["workers"]
            async with aiohttp.ClientSession() as session:
                for worker in workers:
                    body = {"tags": ["kv_cache", "weights"]}
                    async with session.post(f"{worker['url']}/release_memory_occupation", json=body) as response:
                        assert response.status == 200, await response.text()
            self.released = True
        return None  # the sample's prompt

    async def step(self, action: Action) -> StepResult:
        return StepResult(observation=None, reward=0.0, done=True)
