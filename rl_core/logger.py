"""Run outputs on rank 0: metrics.jsonl (one line per step), TensorBoard, optional wandb, sample
tables, the one-line console summary of a step (a step's phase times: `workers/trace.py:StepTimer`).

A resumed run continues the files of the run it resumes, which may have logged steps past its
last checkpoint before it stopped: those rows are dropped when the logger opens (and TensorBoard
purges them), so every step appears exactly once and matches the weights that produced it.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

from rl_core.config import save_config, to_dict


def open_run_logger(cfg, resume_step: int) -> "MetricsLogger":
    """Rank 0's logger of a job's run (`cfg.trainer`: run_dir, wandb), with the resolved config written beside
    its metrics. Rows after `resume_step` (written by an interrupted run) are dropped: each step once."""
    run_dir = Path(cfg.trainer.run_dir)
    logger = MetricsLogger(run_dir, to_dict(cfg), cfg.trainer.wandb, cfg.trainer.wandb_project, resume_step)
    save_config(cfg, run_dir / "config.yaml")
    return logger


class MetricsLogger:
    """`resume_step`: the step the job starts after (the checkpoint's; 0 for a fresh run): rows of
    later steps already in the run directory are dropped, so steps are logged exactly once."""

    def __init__(self, run_dir: str | Path, config_dict: dict, use_wandb: bool = False, wandb_project: str = "rl_core",
                 resume_step: int = 0):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        dropped = truncate_jsonl(self.run_dir / "metrics.jsonl", resume_step, one_per_step=True)
        for table in ("samples", "eval_samples"):
            truncate_jsonl(self.run_dir / f"{table}.jsonl", resume_step, one_per_step=False)
        if dropped:
            print(f"metrics.jsonl: dropped {dropped} rows logged after step {resume_step}, the step this run "
                  "continues from", flush=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.tables = {"samples": open(self.run_dir / "samples.jsonl", "a", buffering=1)}
        # TensorBoard hides events at or after purge_step written by the interrupted run.
        self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"), purge_step=resume_step + 1)
        self.wandb = None
        if use_wandb:
            try:
                import wandb
            except ImportError:
                print("trainer.wandb=true but wandb is not installed (pip install wandb); logging without it")
            else:
                self.wandb = wandb.init(project=wandb_project, config=config_dict, dir=str(self.run_dir))

    def log(self, step: int, metrics: dict[str, float]) -> None:
        clean = {k: float(v) for k, v in metrics.items() if v is not None and math.isfinite(float(v))}
        self.jsonl.write(json.dumps({"step": step, **clean}) + "\n")
        for key, value in clean.items():
            self.tensorboard.add_scalar(key, value, step)
        if self.wandb is not None:
            self.wandb.log(clean, step=step)

    def log_samples(self, step: int, rows: list[dict], table: str = "samples") -> None:
        """A table of (query, response, score, ...): `<table>.jsonl`, TensorBoard text, wandb table."""
        if not rows:
            return
        if table not in self.tables:
            self.tables[table] = open(self.run_dir / f"{table}.jsonl", "a", buffering=1)
        for row in rows:
            self.tables[table].write(json.dumps({"step": step, **row}) + "\n")
        columns = list(rows[0])
        text = "| " + " | ".join(columns) + " |\n|" + "---|" * len(columns) + "\n" + "\n".join(
            "| " + " | ".join(_cell(r.get(c)) for c in columns) + " |" for r in rows)
        self.tensorboard.add_text(table, text, step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({table: wandb.Table(columns=columns, data=[[r.get(c) for c in columns] for r in rows])},
                           step=step)

    def close(self) -> None:
        self.jsonl.close()
        for handle in self.tables.values():
            handle.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def truncate_jsonl(path: Path, last_step: int, one_per_step: bool) -> int:
    """Keep rows with ``step <= last_step`` (the last one of each step if `one_per_step`); return rows dropped.

    Unparseable lines (a write cut short by a kill) are dropped too. Rewritten atomically.
    """
    if not path.is_file():
        return 0
    rows, dropped = [], 0
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
            keep = int(row["step"]) <= last_step
        except (ValueError, KeyError, TypeError):
            keep = False
        if keep:
            rows.append(row)
        else:
            dropped += 1
    if one_per_step:
        latest = {int(row["step"]): row for row in rows}
        dropped += len(rows) - len(latest)
        rows = [latest[step] for step in sorted(latest)]
    if dropped:
        staging = path.with_name(path.name + ".tmp")
        staging.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
        os.replace(staging, path)
    return dropped


def _cell(value) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


def progress_bar(iterable=None, *, total: int | None = None, desc: str, enabled: bool = True, unit: str = "it",
                 initial: int = 0):
    """A tqdm bar (rate and ETA) for a phase that takes more than a few seconds.

    On a terminal it redraws in place; in a log file (torchrun piping, nohup) it writes a line
    every 30 s instead of filling the file with redraws.
    """
    import sys

    from tqdm.auto import tqdm

    interactive = sys.stderr.isatty()
    return tqdm(iterable, total=total, desc=desc, unit=unit, disable=not enabled, dynamic_ncols=interactive,
                mininterval=0.5 if interactive else 30.0, file=sys.stderr, initial=initial)


def step_line(step: int, total: int, metrics: dict[str, float], shown: tuple[str, ...], prefix: str = "") -> str:
    """Every job's console line of a step: `step N/total`, then each of the `shown` metrics the step has."""
    return f"{prefix}step {step}/{total}  " + "  ".join(f"{k}={metrics[k]:.4g}" for k in shown if k in metrics)
