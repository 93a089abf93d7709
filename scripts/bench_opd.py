"""On-policy distillation against GRPO from the same start, side by side in one run.

    python scripts/bench_opd.py                  # both recipes on 2 ranks, evaluations every 2 steps
    python scripts/bench_opd.py --steps 30 --every 5

Runs `configs/grpo_arithmetic.yaml` and `configs/opd_arithmetic.yaml` (the same start policy, prompts and
held-out problems; the second distils `tiny-arithmetic-teacher` into it) one after the other, each for at most
`--steps` steps, and prints both held-out accuracy curves, the step at which each first reaches `--target`, and
the ratio of those steps (and of the wall-clock seconds to get there).
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RECIPES = {"grpo": "grpo_arithmetic.yaml", "opd": "opd_arithmetic.yaml"}


def run_recipe(config: str, run_dir: Path, args) -> tuple[list[tuple[int, float]], float]:
    """The recipe on `args.nproc` ranks; its held-out accuracy by step and the job's wall-clock seconds."""
    episodes = args.steps * 128  # both recipes: 16 prompts x 8 responses a step
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train", "--config", config, f"trainer.run_dir={run_dir}",
            f"trainer.total_episodes={episodes}", f"eval.every={args.every}", "trainer.progress=false",
            "trainer.save_every=0", "trainer.export_hf=false"]
    started = time.perf_counter()
    with open(run_dir.parent / f"{run_dir.name}.log", "w") as log:
        done = subprocess.run(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
    seconds = time.perf_counter() - started
    if done.returncode != 0:
        sys.exit(f"{config} failed (exit {done.returncode}); its output is in {run_dir.parent / run_dir.name}.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [(row["step"], row["eval/accuracy"]) for row in rows if "eval/accuracy" in row], seconds


def first_at(curve: list[tuple[int, float]], target: float) -> int | None:
    return next((step for step, accuracy in curve if accuracy >= target), None)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=24, help="steps of each recipe at most (default: %(default)s)")
    parser.add_argument("--every", type=int, default=2, help="steps between evaluations (default: %(default)s)")
    parser.add_argument("--target", type=float, default=0.9, help="held-out accuracy to reach (default: %(default)s)")
    parser.add_argument("--nproc", type=int, default=2, help="ranks (default: %(default)s)")
    parser.add_argument("--keep", action="store_true", help="keep the run directories (printed)")
    args = parser.parse_args()

    workdir = Path(tempfile.mkdtemp(prefix="bench_opd_"))
    curves, seconds = {}, {}
    for name, config in RECIPES.items():
        curves[name], seconds[name] = run_recipe(config, workdir / name, args)
    steps = sorted({step for curve in curves.values() for step, _ in curve})
    print(f"held-out accuracy (greedy, 200 problems), {args.nproc} ranks")
    print(f"{'step':>5} " + " ".join(f"{name:>6}" for name in curves))
    for step in steps:
        cells = [dict(curve).get(step) for curve in curves.values()]
        print(f"{step:>5} " + " ".join(f"{cell:6.3f}" if cell is not None else f"{'':>6}" for cell in cells))
    reached = {name: first_at(curve, args.target) for name, curve in curves.items()}
    summary = {"target": args.target, "steps_to_target": reached,
               "job_seconds": {name: round(s, 1) for name, s in seconds.items()}}  # start-up and evaluations included
    if all(reached.values()):
        summary["step_ratio_opd_to_grpo"] = round(reached["opd"] / reached["grpo"], 3)
    print(json.dumps(summary))
    if args.keep:
        print(f"run directories under {workdir}")
    else:
        shutil.rmtree(workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
