"""Run outputs on rank 0: metrics.jsonl (one line per step), TensorBoard, optional wandb, sample tables."""

from __future__ import annotations

import json
import math
from pathlib import Path


class MetricsLogger:
    def __init__(self, run_dir: str | Path, config_dict: dict, use_wandb: bool = False, wandb_project: str = "rl_core"):
        from torch.utils.tensorboard import SummaryWriter

        self.run_dir = Path(run_dir)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
        self.samples = open(self.run_dir / "samples.jsonl", "a", buffering=1)
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

    def log_samples(self, step: int, rows: list[dict]) -> None:
        """A table of (query, response, score): samples.jsonl, TensorBoard text, wandb table."""
        for row in rows:
            self.samples.write(json.dumps({"step": step, **row}) + "\n")
        table = "| query | response | score |\n|---|---|---|\n" + "\n".join(
            f"| {_cell(r['query'])} | {_cell(r['response'])} | {r['score']:.3f} |" for r in rows)
        self.tensorboard.add_text("samples", table, step)
        if self.wandb is not None:
            import wandb

            self.wandb.log({"samples": wandb.Table(columns=list(rows[0]), data=[list(r.values()) for r in rows])}, step=step)

    def close(self) -> None:
        self.jsonl.close()
        self.samples.close()
        self.tensorboard.close()
        if self.wandb is not None:
            self.wandb.finish()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")
