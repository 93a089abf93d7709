"""`rl-core`: the jobs without spelling out torchrun, and the learning curves of a run.

    rl-core train --config ppo_sentiment.yaml [--nproc N] [key=value ...]   # PPO / GRPO (rl_core.train)
    rl-core sft|dpo|rm --config FILE [--nproc N] [key=value ...]           # the other jobs
    rl-core plot RUN_DIR [--out FILE.png]

A job command becomes `python -m torch.distributed.run --standalone --nproc_per_node N -m <module> --config
FILE key=value ...`, which then takes this process's place (signals and exit status are torchrun's, as if it
had been typed). Several nodes, or any other torchrun option: call torchrun yourself, as before.
"""

from __future__ import annotations

import argparse
import os
import sys

JOBS = {"train": "rl_core.train", "sft": "rl_core.train_sft", "dpo": "rl_core.train_dpo", "rm": "rl_core.train_rm"}


def torchrun_command(job: str, config: str, nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", JOBS[job], "--config", config, *overrides]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="rl-core", description=__doc__.splitlines()[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    for job, module in JOBS.items():
        command = commands.add_parser(job, help=f"torchrun -m {module} on this machine")
        command.add_argument("--config", required=True, help="a file under configs/ or a path")
        command.add_argument("--nproc", type=int, default=1, help="ranks on this machine (torchrun's --nproc_per_node)")
        command.add_argument("overrides", nargs="*", help="config overrides, key=value")
    plot = commands.add_parser("plot", help="the learning curves of a run directory")
    plot.add_argument("run_dir")
    plot.add_argument("--out", default=None)
    args = parser.parse_args(argv)
    if args.command == "plot":
        from rl_core.plot import main as plot_main

        plot_main([args.run_dir] + (["--out", args.out] if args.out else []))
        return
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    command = torchrun_command(args.command, args.config, args.nproc, args.overrides)
    sys.stdout.flush()
    os.execv(command[0], command)
