"""`torchrun ... -m tests.ppo.slow_prepare SECONDS --config ... [key=value ...]`: the PPO job whose
preparation (standing in for a first-use asset build) takes SECONDS on each node's first rank; the node's
other ranks, which prepare after it, find the work done, as they find a real build's assets."""

import os
import sys
import time

from rl_core.ppo.job import main


def slow_prepare(seconds: float):
    def prepare(cfg, log):
        if os.environ.get("LOCAL_RANK", "0") != "0":
            return cfg
        steps = 4
        for step in range(steps):
            log(f"building: step {step + 1} of {steps}")  # as a builder says what it starts
            time.sleep(seconds / steps)
        return cfg
    return prepare


if __name__ == "__main__":
    main(sys.argv[2:], prepare=slow_prepare(float(sys.argv[1])))
