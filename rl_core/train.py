"""`torchrun --nproc_per_node N -m rl_core.train --config ppo_sentiment.yaml [key=value ...]`: the PPO job (rl_core/ppo/job.py)."""

import sys

from rl_core.ppo.job import main

if __name__ == "__main__":
    main(sys.argv[1:])
