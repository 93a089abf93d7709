"""`torchrun --nproc_per_node N -m rl_core.train_dpo --config dpo_sentiment.yaml [key=value ...]`: the DPO job (rl_core/dpo/job.py)."""

import sys

from workers.procs import follow_launcher

if __name__ == "__main__":
    follow_launcher()  # first, before seconds of imports: a torchrun killed meanwhile still stops this rank
    from rl_core.dpo.job import main
    from rl_core.offline_names import offline_resolver

    main(sys.argv[1:], prepare=offline_resolver("dpo"))
