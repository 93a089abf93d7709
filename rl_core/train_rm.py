"""`torchrun --nproc_per_node N -m rl_core.train_rm --config rm_sentiment.yaml [key=value ...]`: the
reward-model job (rl_core/reward_model/job.py)."""

import sys

from workers.procs import follow_launcher

if __name__ == "__main__":
    follow_launcher()  # first, before seconds of imports: a torchrun killed meanwhile still stops this rank
    from rl_core.reward_model.job import main
    from rl_core.tiny.labeler import get_labeler
    from rl_core.tiny.prepare import resolve_rm_assets

    main(sys.argv[1:], prepare=resolve_rm_assets, get_labeler=get_labeler)
