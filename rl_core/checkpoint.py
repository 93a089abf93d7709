"""Sharded, atomic checkpoints for every job: models + optimizers + LR schedules
(torch.distributed.checkpoint), the job's own state (a KL controller, a data position: rank 0's
JSON) and every rank's RNG; and the final export in Hugging Face format.

A checkpoint is written to `step_N.tmp/` and renamed to `step_N/` only after every rank has
finished, so a run killed mid-save leaves the previous checkpoint as the latest complete one.
Before the rename rank 0 lists every file and its size in `manifest.json`; a resume verifies them,
so a truncated or missing shard is found before loading (`resume=auto` then takes the newest
checkpoint that verifies and says which it skipped). A write that fails (disk full, permissions)
removes the partial checkpoint and stops the job with one line, or with `on_error="continue"`
(`trainer.on_checkpoint_error`) says that line and lets it train on; older checkpoints are untouched.
Only the newest `keep_last` complete checkpoints are kept (0 keeps all): each one holds the
models and optimizer states, so unbounded they fill the disk.
"""

from __future__ import annotations

import errno
import json
import os
import random
import shutil
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException
from transformers import AutoTokenizer

from rl_core.config import LoraSettings
from rl_core.errors import JobError, PeerFailed
from rl_core.staging import staged_directory
from rl_core.model_builder import build_export_template
from workers.fsdp import full_state_dict

PREFIX = "step_"
MANIFEST = "manifest.json"


class CheckpointError(JobError):
    """A checkpoint that cannot be written or read; the message names the path and the cause."""


def write_manifest(directory: Path) -> None:
    """List every file of a finished checkpoint with its size (the shards of every rank are in by now)."""
    files = {str(path.relative_to(directory)): path.stat().st_size
             for path in sorted(directory.rglob("*")) if path.is_file() and path.name != MANIFEST}
    (directory / MANIFEST).write_text(json.dumps({"files": files}, indent=0))


def verify(directory: Path) -> str | None:
    """What is wrong with a checkpoint, or None. Sizes catch what an interrupted copy, a full disk or a
    damaged file leave: missing and truncated files (a checksum would cost a full read of every shard)."""
    manifest = directory / MANIFEST
    if not manifest.is_file():
        # Checkpoints from before manifests: complete if their trainer state is there, as then.
        return None if (directory / "trainer_state.json").is_file() else f"{manifest} is missing"
    try:
        files = json.loads(manifest.read_text())["files"]
    except (ValueError, KeyError, TypeError) as err:
        return f"{manifest} is unreadable ({type(err).__name__}: {err})"
    for name, size in files.items():
        path = directory / name
        if not path.is_file():
            return f"{path} is missing"
        if path.stat().st_size != size:
            return f"{path} has {path.stat().st_size} bytes, {size} were written"
    return None


def checkpoint_bytes(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.rglob("*") if path.is_file())


def _root_cause(err: BaseException) -> BaseException:
    """torch.distributed.checkpoint wraps each rank's error in a CheckpointException: the first one's cause."""
    failures = getattr(err, "failures", None)
    if isinstance(failures, dict) and failures:
        return failures[min(failures)][0]
    return err


def _os_error(err: BaseException, directory: Path, rank: int) -> BaseException:
    """The OS error behind a failed write. torch.save reports a full disk as 'unexpected pos ...' (a
    RuntimeError), so a small probe file written to the same directory recovers the errno it hid."""
    if isinstance(err, OSError):
        return err
    probe = directory / f".write_probe_rank{rank}"
    try:
        with open(probe, "wb") as handle:
            handle.write(bytes(1 << 20))
            handle.flush()
            os.fsync(handle.fileno())
    except OSError as hidden:
        return hidden
    finally:
        probe.unlink(missing_ok=True)
    return err


def _describe(err: BaseException) -> str:
    if isinstance(err, OSError) and err.errno is not None:
        name = errno.errorcode.get(err.errno, str(err.errno))
        where = f" ({err.filename})" if err.filename else ""
        return f"{err.strerror} [{name}]{where}"
    return f"{type(err).__name__}: {err}"


class Checkpointer:
    def __init__(self, root: str | Path, rank: int, keep_last: int = 0, on_error: str = "stop"):
        if keep_last < 0:
            raise ValueError(f"keep_last must be >= 0 (0 keeps every checkpoint), got {keep_last}")
        if on_error not in ("stop", "continue"):
            raise ValueError(f"on_error must be 'stop' or 'continue', got {on_error!r}")
        self.root = Path(root)
        self.rank = rank
        self.keep_last = keep_last
        self.on_error = on_error

    @classmethod
    def for_run(cls, trainer, rank: int) -> "Checkpointer":
        """Every job's checkpointer: `<trainer.run_dir>/checkpoints`, with its `keep_last` and
        `on_checkpoint_error` keys."""
        return cls(Path(trainer.run_dir) / "checkpoints", rank, keep_last=trainer.keep_last,
                   on_error=trainer.on_checkpoint_error)

    def complete(self) -> list[Path]:
        if not self.root.is_dir():
            return []
        done = [p for p in self.root.iterdir() if p.is_dir() and p.name.startswith(PREFIX) and not p.name.endswith(".tmp")]
        return sorted(done, key=lambda p: int(p.name[len(PREFIX):]))

    def save(self, step: int, models: dict, state: dict | None) -> Path | None:
        """Collective. `models`: name -> TrainableModel; `state`: rank 0's JSON-able job state. The
        checkpoint's directory; None when it could not be written and `on_error` is "continue"."""
        final = self.root / f"{PREFIX}{step:08d}"
        tmp = final.with_name(final.name + ".tmp")
        try:
            return self._write(step, models, state, final, tmp)
        except BaseException:
            if self.rank == 0:  # stopped mid-save (a stop signal, a peer gone): leave no half-written checkpoint
                shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _write(self, step: int, models: dict, state: dict | None, final: Path, tmp: Path) -> Path | None:
        problem = None
        if self.rank == 0:
            shutil.rmtree(tmp, ignore_errors=True)
            try:
                tmp.mkdir(parents=True)
            except OSError as err:
                problem = _describe(err)
        problem = self._agree(problem)
        if problem is None:
            try:
                for name, model in models.items():
                    model.save_checkpoint(str(tmp / name))
                torch.save({"torch": torch.get_rng_state(), "python": random.getstate(),
                            "numpy": np.random.get_state(),
                            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None},
                           tmp / f"rng_rank{self.rank}.pt")
                if self.rank == 0:
                    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **(state or {})}))
            except (OSError, RuntimeError, CheckpointException) as err:  # the latter is a BaseException
                cause = _os_error(_root_cause(err), tmp, self.rank)
                if not isinstance(cause, OSError):  # a peer stopped or died mid-save: not a storage problem
                    raise
                problem = _describe(cause)
            problem = self._agree(problem)  # every rank has written (or failed) before the manifest lists files
        if problem is None and self.rank == 0:
            try:
                write_manifest(tmp)
                tmp.rename(final)
            except OSError as err:
                problem = _describe(err)
        problem = self._agree(problem)
        if problem is not None:
            self._fail_save(final, tmp, problem)
            return None  # on_error="continue": said, cleaned up, no checkpoint this time
        if self.rank == 0:
            print(f"checkpoint saved: {final}", flush=True)
            self._prune()
        dist.barrier()
        return final

    def _agree(self, problem: str | None) -> str | None:
        """Collective: the first rank's problem, on every rank (None when all went well)."""
        problems: list = [None] * dist.get_world_size()
        dist.all_gather_object(problems, problem)
        return next((p for p in problems if p is not None), None)

    def _fail_save(self, final: Path, tmp: Path, problem: str) -> None:
        """Remove the partial checkpoint and stop with one line (rank 0 says it; the others follow), or
        with `on_error="continue"` print that line (rank 0) and return."""
        if self.rank != 0:
            dist.barrier()
            if self.on_error == "continue":
                return
            raise PeerFailed(f"checkpoint {final.name} could not be written (rank 0 says why)")
        written = checkpoint_bytes(tmp) if tmp.is_dir() else 0
        free = shutil.disk_usage(self.root).free if self.root.exists() else 0  # at the failure, before clean-up
        shutil.rmtree(tmp, ignore_errors=True)
        dist.barrier()
        previous = self.complete()
        need = (f"a checkpoint takes about {checkpoint_bytes(previous[-1])} bytes ({previous[-1].name})" if previous
                else f"{written} bytes were written before it failed")
        kept = f"; {len(previous)} older checkpoints are untouched" if previous else ""
        line = (f"checkpoint {final.name} could not be written to {self.root}: {problem}; {need}, {free} bytes were "
                f"free there; the partial checkpoint was removed{kept}. ")
        if self.on_error == "continue":
            print(line + "Training goes on without it (trainer.on_checkpoint_error=continue); free space or fix "
                  "the directory's permissions for the next one", flush=True)
            return
        raise CheckpointError(line + "Free space or fix the directory's permissions, then resume (or set "
                              "trainer.on_checkpoint_error=continue to train on without checkpoints that fail)")

    def _prune(self) -> None:
        """Delete all but the newest `keep_last` complete checkpoints (rank 0, after a save), and any
        `.tmp` directory a stopped or killed run left mid-save or mid-delete: this save is renamed
        already and the run directory's lock keeps other jobs out, so every `.tmp` here is stale."""
        for old in self.complete()[:-self.keep_last] if self.keep_last else []:
            old.rename(old.with_name(old.name + ".tmp"))  # renamed first: a half-deleted one never looks complete
        for stale in self.root.glob(f"{PREFIX}*.tmp"):
            shutil.rmtree(stale, ignore_errors=True)

    def resume_path(self, mode: str) -> Path | None:
        """The checkpoint `maybe_resume(mode)` starts from unless it fails to load: for `auto` the newest
        that verifies, else `mode` itself; None when the run starts fresh (no loading: read before engines)."""
        if mode == "never":
            return None
        if mode == "auto":
            return next((path for path in reversed(self.complete()) if verify(path) is None), None)
        path = Path(mode)
        if not path.is_dir():
            raise CheckpointError(f"trainer.resume={mode}: no such checkpoint directory; use 'auto' or a "
                                  f"{PREFIX}N directory")
        return path

    def maybe_resume(self, mode: str, models: dict) -> tuple[int, dict]:
        """Load the checkpoint `mode` asks for into `models`; returns (the step to continue from, the
        job state saved with it); (0, {}) when starting fresh. `auto` takes the newest checkpoint that
        verifies and loads, saying which it skipped; an explicit path must verify and load."""
        if mode == "never":
            return 0, {}
        if mode != "auto":
            path = self.resume_path(mode)
            problem = verify(path) or self._load(path, models)
            if problem is not None and self.rank != 0:
                raise PeerFailed(f"trainer.resume={mode} is damaged (rank 0 says how)")
            if problem is not None:
                raise CheckpointError(f"trainer.resume={mode}: the checkpoint is damaged: {problem}; resume from "
                                      "another one (or 'auto', which takes the newest one that verifies)")
            return self._state(path)
        for path in reversed(self.complete()):
            problem = verify(path) or self._load(path, models)
            if problem is None:
                return self._state(path)
            if self.rank == 0:
                print(f"skipping checkpoint {path}: {problem}", flush=True)
        return 0, {}

    def _load(self, path: Path, models: dict) -> str | None:
        """Collective: load every model's shards; the problem if loading failed on any rank."""
        try:
            for name, model in models.items():
                model.load_checkpoint(str(path / name))
        except (OSError, RuntimeError, ValueError, CheckpointException) as err:
            return f"loading it failed: {_describe(_root_cause(err))}"
        return None

    def _state(self, path: Path) -> tuple[int, dict]:
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


def finished_run(trainer, total_steps: int, limits: str, train_on: str, export: Path | None = None) -> str | None:
    """The line to end with when the checkpoint `trainer.resume` starts from is at the last step and the
    final model is exported (`export`; by default `<run_dir>/final` when `trainer.export_hf`): a finished run,
    which must not load models or start engines and rewrite its export for nothing. None: train. `limits`: the
    keys that set `total_steps`; `train_on`: how to train further. Reads files only (every rank reads the same)."""
    path = Checkpointer(Path(trainer.run_dir) / "checkpoints", rank=0).resume_path(trainer.resume)
    if export is None and getattr(trainer, "export_hf", False):
        export = Path(trainer.run_dir) / "final"
    if path is None or verify(path) is not None:  # a damaged explicit one: its resume says so in one line
        return None
    if saved_step(path) < total_steps or (export is not None and not export.is_dir()):
        return None  # (a run stopped between its last checkpoint and the export resumes to write it)
    return (f"nothing left to train: {path} is at step {saved_step(path)}, the last one ({limits})"
            + (f", and {export} holds the model" if export is not None else "")
            + f"; {train_on}, or give a new trainer.run_dir")


def end_if_finished(trainer, total_steps: int, limits: str, train_on: str, rank: int,
                    export: Path | None = None) -> bool:
    """Whether the run already ended (`finished_run`); then rank 0 says so in one line. Every job asks before
    it loads a model or starts an engine; every rank reads the same run directory, so all end here or none."""
    done = finished_run(trainer, total_steps, limits, train_on, export)
    if done is not None and rank == 0:
        print(done, flush=True)
    return done is not None


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
    plain = build_export_template(base_path, lora, lambda base: _embedding_rows(state, base))
    trained_rows = plain.get_input_embeddings().num_embeddings
    plain.load_state_dict(state)
    if lora.rank and lora.export == "merged":
        plain = plain.merge_and_unload()
    if len(tokenizer) > trained_rows:
        # Tokens the job added and never fed the model (the [PAD] of a tokenizer that padded with EOS, see
        # loading.load_tokenizer): exported as the user gave it, so the export's ids all fit its embeddings.
        tokenizer = AutoTokenizer.from_pretrained(tokenizer.name_or_path)
    save_model_directory(plain, tokenizer, out_dir, base_path)  # a resume takes an existing final/ as finished
    print(f"final model saved to {out_dir}", flush=True)


def export_final(cfg, model, tokenizer, rank: int) -> None:
    """Every causal-LM job's export (PPO, SFT, DPO): the Hugging Face model in `<run_dir>/final` when
    `trainer.export_hf` (collective when sharded)."""
    if cfg.trainer.export_hf:
        export_hf(model, tokenizer, cfg.model.path, Path(cfg.trainer.run_dir) / "final", rank, cfg.model.lora)


# A vision-language model's processor besides its tokenizer: the image (and video) sizing an engine serving the
# export must expand image pads by, as the trainer did.
PROCESSOR_FILES = ("preprocessor_config.json", "processor_config.json", "video_preprocessor_config.json")


def save_model_directory(model, tokenizer, out_dir: Path, base_path: str | None = None) -> None:
    """Every job's export: `model` and `tokenizer` saved in Hugging Face format into `out_dir`, with the
    processor's files of the local model directory `base_path` where it has them, whole or not at all (written
    beside it, then renamed over it: `rl_core.staging.staged_directory`)."""
    with staged_directory(out_dir) as staging:
        model.save_pretrained(staging)
        tokenizer.save_pretrained(staging)
        for name in PROCESSOR_FILES:
            if base_path is not None and (Path(base_path) / name).is_file():
                shutil.copyfile(Path(base_path) / name, Path(staging) / name)


def _embedding_rows(state: dict, model) -> int:
    """The vocabulary size the trained `state` has: the rows of `model`'s input embedding as `state` holds it
    (its key may carry a wrapper's prefix, e.g. peft's `base_model.model.`)."""
    embedding = model.get_input_embeddings().weight
    name = next(name for name, param in model.named_parameters() if param is embedding)
    return next((tensor.shape[0] for key, tensor in state.items() if key.endswith(name)), embedding.shape[0])
