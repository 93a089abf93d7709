"""Learning curves of a run: `rl-core plot RUN_DIR [--out FILE.png]` (or `python scripts/plot_metrics.py ...`).

Reads RUN_DIR/metrics.jsonl (one JSON object per step, written by rl_core.train) and draws the
curves a PPO run is judged by: reward-model score, KL and its coefficient, entropy, value loss
and step time.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

PANELS = [
    ("reward/score_mean", "RM score (normalised)"),
    ("reward/total_mean", "total reward (score - KL penalty)"),
    ("kl/mean", "KL(policy || reference) per episode"),
    ("kl/coef", "KL coefficient (adaptive)"),
    ("policy/entropy", "policy entropy"),
    ("value/loss", "value loss"),
    ("policy/clipfrac", "policy clip fraction"),
    ("perf/step_s", "step time (s)"),
]


def load_metrics(run_dir: Path) -> list[dict]:
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        raise SystemExit(f"{path} not found: pass the trainer.run_dir of a run")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not rows:
        raise SystemExit(f"{path} is empty: the run has not finished a step yet")
    # A resumed run appends again from its checkpoint step: keep the latest value per step.
    by_step = {row["step"]: row for row in rows}
    return [by_step[step] for step in sorted(by_step)]


def plot(rows: list[dict], out: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(key, label) for key, label in PANELS if any(key in row for row in rows)]
    cols = 2
    fig, axes = plt.subplots((len(panels) + cols - 1) // cols, cols, figsize=(11, 2.6 * len(panels) / cols + 1))
    for ax, (key, label) in zip(axes.flat, panels):
        points = [(row["step"], row[key]) for row in rows if key in row]
        ax.plot(*zip(*points), marker="." if len(points) < 50 else None)
        ax.set_title(label, fontsize=10)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
    for ax in list(axes.flat)[len(panels):]:
        ax.axis("off")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(out, dpi=110)
    print(f"wrote {out}")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--out", type=Path, default=None, help="PNG path (default: RUN_DIR/learning_curves.png)")
    args = parser.parse_args(argv)
    rows = load_metrics(args.run_dir)
    plot(rows, args.out or args.run_dir / "learning_curves.png", str(args.run_dir))


if __name__ == "__main__":
    main()
