"""`rl-core`: the jobs without spelling out torchrun, and the learning curves of a run.

    rl-core train --config ppo_sentiment.yaml [--nproc N] [key=value ...]   # PPO / GRPO (rl_core.train)
    rl-core sft|dpo|rm --config FILE [--nproc N] [key=value ...]           # the other jobs
    rl-core plot RUN_DIR [--out FILE.png]
    rl-core export RUN_DIR|CHECKPOINT OUT_DIR                                # a checkpoint as a Hugging Face model

A job command becomes `python -m torch.distributed.run --standalone --nproc_per_node N -m <module> --config
FILE key=value ...`, which then takes this process's place (signals and exit status are torchrun's, as if it
had been typed). Several nodes, or any other torchrun option: call torchrun yourself, as before.

`export` writes the policy of a checkpoint (`<run_dir>/checkpoints/step_N`, or a run directory's newest
complete one) as the job's own end-of-run export does (`rl_core.checkpoint.export_hf`: model and tokenizer,
LoRA merged or not as `model.lora.export` says), in this process; the run's `config.yaml` names the base model.
"""

from __future__ import annotations

import argparse
import os
import sys
import warnings
from pathlib import Path

JOBS = {"train": "rl_core.train", "sft": "rl_core.train_sft", "dpo": "rl_core.train_dpo", "rm": "rl_core.train_rm"}
POLICIES = ("actor", "model", "policy")  # the trained policy's name in a PPO/GRPO, an SFT and a DPO checkpoint
WHAT_TO_GIVE = "give a run directory (trainer.run_dir) or one of its checkpoints/step_N directories"


class ExportError(Exception):
    """What is wrong with `rl-core export`'s input, and how to fix it: said in one line, exit status 2."""


def torchrun_command(job: str, config: str, nproc: int, overrides: list[str]) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(nproc),
            "-m", JOBS[job], "--config", config, *overrides]


def find_checkpoint(source: Path) -> tuple[Path, Path]:
    """(the checkpoint to export, its run directory) for `source`: a checkpoint, or a run directory whose newest
    complete checkpoint is taken."""
    from rl_core.checkpoint import Checkpointer, verify

    if not source.is_dir():
        raise ExportError(f"{source} {'is not a directory' if source.exists() else 'does not exist'}; {WHAT_TO_GIVE}")
    if (source / "trainer_state.json").is_file():  # <run_dir>/checkpoints/step_N
        problem = verify(source)
        if problem is not None:
            raise ExportError(f"{source} is damaged: {problem}; export another checkpoint of the run")
        return source, source.parent.parent
    if not (source / "config.yaml").is_file():
        raise ExportError(f"{source} is neither a run directory (no config.yaml) nor a checkpoint (no "
                          f"trainer_state.json); {WHAT_TO_GIVE}")
    newest = Checkpointer(source / "checkpoints", rank=0).resume_path("auto")
    if newest is None:
        raise ExportError(f"{source} has no complete checkpoint in checkpoints/: a job writes one every "
                          "trainer.save_every steps (0 = none); a finished run's model is in its final/")
    return newest, source


def export_checkpoint(source: Path, out: Path) -> None:
    """`rl-core export`: the policy of a checkpoint written to `out` in Hugging Face format."""
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        raise ExportError(f"{out} exists and is not an empty directory; give a new output directory")
    checkpoint, run_dir = find_checkpoint(source)
    name = next((n for n in POLICIES if (checkpoint / n).is_dir()), None)
    if name is None:
        held = ", ".join(sorted(p.name for p in checkpoint.iterdir() if p.is_dir())) or "no model"
        raise ExportError(f"{checkpoint} holds {held}, not a policy ({'/'.join(POLICIES)}): rl-core export writes "
                          "the causal LMs of the PPO/GRPO, SFT and DPO jobs (the reward-model job's export is its "
                          "trainer.output_dir)")
    config = run_dir / "config.yaml"
    if not config.is_file():
        raise ExportError(f"{config} is missing, and with it the run's model.path; {WHAT_TO_GIVE}")

    import torch.distributed.checkpoint as dcp
    from omegaconf import OmegaConf
    from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

    from rl_core.checkpoint import export_hf, saved_step
    from rl_core.config import LoraSettings
    from workers import loading
    from rl_core.model_builder import build_export_template

    model_cfg = OmegaConf.to_container(OmegaConf.load(config))["model"]
    base, lora = model_cfg["path"], LoraSettings(**model_cfg.get("lora", {}))
    try:
        loading.check_model_path(base, f"model.path in {config}")
    except loading.ModelPathError as err:
        raise ExportError(f"{err} (the checkpoint holds the trained weights, the export starts from the base "
                          "model's files)") from None
    shapes = dcp.FileSystemReader(str(checkpoint / name)).read_metadata().state_dict_metadata

    def trained_rows(model) -> int:  # the job may have grown the vocabulary (SFT's added tokens)
        embedding = next(n for n, p in model.named_parameters() if p is model.get_input_embeddings().weight)
        return next(meta.size[0] for key, meta in shapes.items() if key.endswith(embedding))

    model = build_export_template(base, lora, trained_rows)
    state = {"model": get_model_state_dict(model)}  # the names the job saved under (TrainableModel.state_dict)
    with warnings.catch_warnings():  # torch warns that it loads in one process, which is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(state, checkpoint_id=str(checkpoint / name), no_dist=True)  # resharded from any number of ranks
    set_model_state_dict(model, state["model"])
    tokenizer = loading.load_tokenizer(model_cfg.get("tokenizer_path") or base)
    export_hf(model, tokenizer, base, out, rank=0, lora=lora)
    print(f"exported {checkpoint} (step {saved_step(checkpoint)}) to {out}", flush=True)


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
    export = commands.add_parser("export", help="a checkpoint as a Hugging Face model directory")
    export.add_argument("source", help="a run directory (its newest complete checkpoint) or a checkpoints/step_N")
    export.add_argument("out", help="the new directory (model and tokenizer), for from_pretrained")
    args = parser.parse_args(argv)
    if args.command == "export":
        try:
            export_checkpoint(Path(args.source), Path(args.out))
        except ExportError as err:
            print(f"rl-core export: error: {err}", file=sys.stderr)
            sys.exit(2)
        return
    if args.command == "plot":
        from rl_core.plot import main as plot_main

        plot_main([args.run_dir] + (["--out", args.out] if args.out else []))
        return
    if args.nproc < 1:
        parser.error(f"--nproc must be >= 1, got {args.nproc}")
    command = torchrun_command(args.command, args.config, args.nproc, args.overrides)
    sys.stdout.flush()
    os.execv(command[0], command)
