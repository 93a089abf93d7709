"""The PPO job: `torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`."""

from __future__ import annotations

import sys

from rl_core.cli import parse_job_config


def main(argv: list[str] | None = None) -> None:
    cfg = parse_job_config(argv, __doc__, "ppo_sentiment.yaml")
    raise SystemExit("the training loop is not wired yet")


if __name__ == "__main__":
    main(sys.argv[1:])
