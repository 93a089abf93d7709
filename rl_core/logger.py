"""Run outputs on rank 0: metrics.jsonl (one line per step), TensorBoard, optional wandb, sample
tables, the one-line console summary of a step, and the step timer."""

from __future__ import annotations

import contextlib
import json
import math
import time
from pathlib import Path
from typing import Iterator


class MetricsLogger:
    def __init__(self, run_dir: str | Path, config_dict: dict, use_wandb: bool = False, wandb_project: str = "rl_core"):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.tables = {"samples": open(self.run_dir / "samples.jsonl", "a", buffering=1)}
        self.tensorboard = SummaryWriter(str(self.run_dir / "tensorboard"))
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


def _cell(value) -> str:
    text = f"{value:.3f}" if isinstance(value, float) else str(value)
    return text.replace("|", "\\|").replace("\n", " ")


class StepTimer:
    """Wall time of each phase of one step: ``with timer("rollout"): ...``, then ``timer.metrics()``."""

    def __init__(self):
        self.started = time.perf_counter()
        self.seconds: dict[str, float] = {}

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            self.seconds[phase] = self.seconds.get(phase, 0.0) + time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        """``perf/<phase>_s`` for every phase, and ``perf/step_s`` from the timer's creation."""
        out = {f"perf/{phase}_s": seconds for phase, seconds in self.seconds.items()}
        out["perf/step_s"] = time.perf_counter() - self.started
        return out


def print_step(step: int, total: int, metrics: dict[str, float]) -> None:
    """One console line per step with the numbers a glance needs."""
    keys = ("reward/score_mean", "reward/fn_total_mean", "kl/mean", "kl/coef", "policy/entropy", "value/loss",
            "perf/step_s")
    shown = "  ".join(f"{k.split('/')[-1]}={metrics[k]:.3f}" for k in keys if k in metrics)
    print(f"step {step}/{total}  {shown}", flush=True)
