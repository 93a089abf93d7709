"""A blocking env whose step never returns (a stuck sandbox or a synchronous call without a timeout)."""

import threading

from envs.base import Action, StepResult, SyncEnv


class NeverReturningEnv(SyncEnv):
    def reset(self, sample: dict):
        return None  # the sample's prompt

    def step(self, action: Action) -> StepResult:
        threading.Event().wait()  # blocks forever, as a hung subprocess or socket read would
        raise AssertionError("unreachable")
