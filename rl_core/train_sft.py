"""`torchrun --nproc_per_node N -m rl_core.train_sft --config sft_arithmetic.yaml [key=value ...]`: the SFT job (rl_core/sft/job.py)."""

import sys

from workers.procs import follow_launcher

if __name__ == "__main__":
    follow_launcher()  # first, before seconds of imports: a torchrun killed meanwhile still stops this rank
    from rl_core.sft.job import main
    from rl_core.tiny.prepare import resolve_sft_assets

    main(sys.argv[1:], prepare=resolve_sft_assets)
