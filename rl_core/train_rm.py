"""`torchrun --nproc_per_node N -m rl_core.train_rm --config rm_sentiment.yaml [key=value ...]`: the
reward-model job (rl_core/reward_model/job.py)."""

import sys

from workers.procs import follow_launcher

if __name__ == "__main__":
    follow_launcher()  # first, before seconds of imports: a torchrun killed meanwhile still stops this rank
    from rl_core.reward_model.job import main
    from rl_core.offline_names import offline_labeler, offline_resolver

    main(sys.argv[1:], prepare=offline_resolver("rm"), get_labeler=offline_labeler)
