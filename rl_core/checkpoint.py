"""Sharded, atomic checkpoints for every job: models + optimizers + LR schedules
(torch.distributed.checkpoint), the job's own state (a KL controller, a data position: rank 0's
JSON) and every rank's RNG; and the final export in Hugging Face format.

A checkpoint is written to `step_N.tmp/` and renamed to `step_N/` only after every rank has
finished, so a run killed mid-save leaves the previous checkpoint as the latest complete one.
Only the newest `keep_last` complete checkpoints are kept (0 keeps all): each one holds the
models and optimizer states, so unbounded they fill the disk.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from rl_core.config import LoraSettings
from workers import loading
from workers.fsdp import full_state_dict
from workers.lora import with_lora

PREFIX = "step_"


class Checkpointer:
    def __init__(self, root: str | Path, rank: int, keep_last: int = 0):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
        self.root = Path(root)
        self.rank = rank
        self.keep_last = keep_last

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
        return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))

    def save(self, step: int, models: dict, state: dict | None) -> Path:
        """Collective. `models`: name -> TrainableModel; `state`: rank 0's JSON-able job state."""
        final = self.root / f"{PREFIX}{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        dist.barrier()
        for name, model in models.items():
            model.save_checkpoint(str(tmp / name))
        torch.save({"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state(),
                    "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                   tmp / f"rng_rank{self.rank}.pt")
        if self.rank == 0:
            (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(state or {})}))
        dist.barrier()
        if self.rank == 0:
            tmp.rename(final)
            print(f"checkpoint saved: {final}", flush=True)
            self._prune()
        dist.barrier()
        return final

    def _prune(self) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (rank 0, after a save)."""
        if not self.keep_last:
            return
        for old in self.complete()[:-self.keep_last]:
            doomed = old.with_name(old.name + ".tmp")  # renamed first: a half-deleted one never looks complete
            old.rename(doomed)
            shutil.rmtree(doomed, ignore_errors=True)

    def resume_path(self, mode: str) -> Path | None:
        """The checkpoint `maybe_resume(mode)` loads; None when the run starts fresh."""
        if mode == "never":
            return None
        if mode == "auto":
            found = self.complete()
            return found[-1] if found else None
        path = Path(mode)
        if not (path / "trainer_state.json").is_file():
            raise FileNotFoundError(f"trainer.resume={mode}: {path} is not a complete checkpoint "
                                    f"(no trainer_state.json); use 'auto' or a {PREFIX}N directory")
        return path

    def maybe_resume(self, mode: str, models: dict) -> tuple[int, dict]:
        """Load the checkpoint `mode` asks for into `models`; returns (the step to continue from, the
        job state saved with it); (0, {}) when starting fresh."""
        path = self.resume_path(mode)
        if path is None:
            return 0, {}
        for name, model in models.items():
            model.load_checkpoint(str(path / name))
        state = json.loads((path / "trainer_state.json").read_text())
        rng_file = path / f"rng_rank{self.rank}.pt"
        if rng_file.is_file():
            rng = torch.load(rng_file, weights_only=False)
            torch.set_rng_state(rng["torch"])
            random.setstate(rng["python"])
            np.random.set_state(rng["numpy"])
            if rng.get("cuda") is not None and torch.cuda.is_available():
                torch.cuda.set_rng_state_all(rng["cuda"])
        if self.rank == 0:
            print(f"resumed from {path} at step {state['step']}{_world_size_change(path)}", flush=True)
        return int(state.pop("step")), state


def saved_step(path: Path) -> int:
    """The step a complete checkpoint was written at."""
    return int(json.loads((path / "trainer_state.json").read_text())["step"])


def _world_size_change(path: Path) -> str:
    """What a resume on another number of ranks keeps, or "" on the same number (each rank saved its RNG)."""
    saved = len(list(path.glob("rng_rank*.pt")))
    now = dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1
    if not saved or saved == now:
        return ""
    return (f", written by {saved} ranks, on {now} now: the model and optimizer states are resharded and the "
            f"data order goes on where it stopped (it does not depend on the ranks); the random state of "
            f"rank{'s 0 to' if min(saved, now) > 1 else ''} {min(saved, now) - 1} only is restored")


def export_hf(model, tokenizer, base_path: str, out_dir: Path, rank: int, lora: LoraSettings) -> None:
    """The trained model in Hugging Face format with its tokenizer (chat template included); with LoRA
    the adapters merged into the base weights, or the adapter alone (`model.lora.export`)."""
    state = full_state_dict(model)  # collective: every rank gathers
    if rank != 0:
        return
    plain = loading.load_causal_lm(base_path)
    if len(tokenizer) > plain.get_input_embeddings().num_embeddings:
        plain.resize_token_embeddings(len(tokenizer))
    plain = with_lora(plain, lora)
    plain.load_state_dict(state)
    if lora.rank and lora.export == "merged":
        plain = plain.merge_and_unload()
    plain.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    print(f"final model saved to {out_dir}", flush=True)
