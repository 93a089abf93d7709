"""`torchrun --nproc_per_node N -m rl_core.train_rm --config rm_sentiment.yaml [key=value ...]`: the
reward-model job (rl_core/reward_model/job.py)."""

import sys

from rl_core.reward_model.job import main

if __name__ == "__main__":
    main(sys.argv[1:])
