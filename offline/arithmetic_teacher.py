"""Offline asset of on-policy distillation: a teacher for the arithmetic recipe's policy.

    tiny-arithmetic-teacher/   the arithmetic recipe's policy (`tiny-arithmetic`, offline/arithmetic.py) fine-tuned
                               further by the same SFT job (configs/sft_arithmetic.yaml with SFT_OVERRIDES) on
                               worked solutions without the careless annotator's slip; Hugging Face format, its
                               tokenizer files byte for byte the student's; build.json (settings, losses, and
                               the teacher's greedy accuracy on the 200 held-out problems)

The student (`tiny-arithmetic`) reports the amount given away instead of what it computed on most
subtractions (greedy held-out accuracy 0.605); a few hundred steps on correct final lines teach the
teacher to report what it computed. Distillation then trains the student to match the teacher's
per-token logprobs, on the student's own samples: the teacher must read the student's tokens, hence
the same tokenizer. Built like the other offline assets: under a file lock, in a staged directory
renamed into place with its build.json, rebuilt when its settings, the SFT recipe or the student's
recorded settings change.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offline import ARITHMETIC_TEACHER
from offline.arithmetic import (SFT_RECIPE, _LinesToLog, ensure_arithmetic_assets, make_problems, recipe_settings,
                                run_sft)
from offline.arithmetic import REAL_SETTINGS as STUDENT_REAL
from offline.arithmetic import SMALL_SETTINGS as STUDENT_SMALL
from offline.assets import (FORMAT_VERSION, _is_built, _quiet_transformers_progress, default_assets_root, file_lock,
                            staged_directory, torch_threads)

TEACHER_DIR = "tiny-arithmetic-teacher"  # under the assets root
# The files that make up a Hugging Face tokenizer: copied from the student, so the teacher's are the same bytes.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "special_tokens_map.json",
                   "added_tokens.json", "vocab.json", "merges.txt")
# Torch threads of the fine-tuning: one split of every reduction, so a rebuild gives the same bytes whatever
# the machine's load (see offline/tools_arithmetic.py's SFT_THREADS).
SFT_THREADS = 1


@dataclass(frozen=True)
class TeacherSettings:
    """Everything that determines the teacher (beside the student and the SFT recipe); stored in build.json."""

    # The slip-free problems' seed: not the student's corpus (seed 2024), nor the GRPO train (2025) or
    # held-out (2026) problems. Operands and the share of subtractions are the student's settings.
    seed: int = 4049
    problems: int = 9600  # worked solutions, every final line right
    # The SFT recipe (configs/sft_arithmetic.yaml) with these `key=value` overrides: a short, gentle
    # continuation of the student's training rather than its 2400 steps at 3e-3.
    sft_overrides: tuple[str, ...] = ("train.max_steps=300", "train.epochs=1", "train.lr=1.0e-3",
                                      "train.warmup_steps=10")
    eval_max_new_tokens: int = 20  # greedy tokens per held-out problem for the recorded accuracy (the GRPO eval's)


REAL_SETTINGS = TeacherSettings()
# Seconds: the small student (a fresh 2-layer model) fine-tuned 10 steps further.
SMALL_SETTINGS = TeacherSettings(problems=64, sft_overrides=("train.max_steps=10", "train.batch_size=8",
                                                             "train.schedule=constant"))


def _settings(small: bool) -> TeacherSettings:
    return SMALL_SETTINGS if small else REAL_SETTINGS


def sft_recipe(settings: TeacherSettings):
    """`configs/sft_arithmetic.yaml` with the teacher's overrides."""
    from rl_core.config import load_config
    from rl_core.sft.config import SFTConfig, validate

    return load_config(SFT_RECIPE, settings.sft_overrides, SFTConfig, validate)


def expected_settings(settings: TeacherSettings, student_model_dir: Path, small: bool) -> dict:
    """What the teacher's build.json records: its settings, the recipe's weight-determining part, and the
    student's own recorded settings (a rebuilt student rebuilds the teacher)."""
    student = json.loads((student_model_dir / "build.json").read_text())["settings"]
    return json.loads(json.dumps({"format": FORMAT_VERSION, "component": "arithmetic-teacher", "small": small,
                                  **dataclasses.asdict(settings),
                                  "sft_recipe": recipe_settings(sft_recipe(settings)), "student": student}))


def slip_free_rows(settings: TeacherSettings, small: bool) -> list[dict]:
    """The fine-tuning rows: chats ending in a worked solution whose final line is always right."""
    student = STUDENT_SMALL if small else STUDENT_REAL
    problems = make_problems(settings.problems, settings.seed, student.max_operand, student.sub_frac, slip_frac=0.0)
    return [{"messages": p["messages"] + [{"role": "assistant", "content": p["solution"]}], "answer": p["answer"]}
            for p in problems]


def copy_tokenizer(source: Path, target: Path) -> list[str]:
    """The tokenizer files of the model at `source` copied into `target` (replacing any there); their names."""
    target.mkdir(parents=True, exist_ok=True)
    names = [name for name in TOKENIZER_FILES if (source / name).is_file()]
    for name in names:
        shutil.copyfile(source / name, target / name)
    return names


def held_out_accuracy(model_dir: str | Path, eval_file: str | Path, max_new_tokens: int = 20) -> float:
    """Greedy accuracy of the model at `model_dir` on `eval_file`'s problems ({"messages", "answer"} rows), as
    the GRPO recipe's evaluation scores it: each prompt rendered with the chat template and its generation
    prompt, `max_new_tokens` greedy tokens (`workers.decode`, left-padded with position ids), the completion
    up to EOS scored by `rl_core.rewards.math:answer_reward` (> 0 is correct)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from rl_core.rewards.math import answer_reward
    from workers.decode import DecodeSettings, decode

    tokenizer = AutoTokenizer.from_pretrained(str(model_dir))
    with _quiet_transformers_progress():
        model = AutoModelForCausalLM.from_pretrained(str(model_dir)).eval()
    rows = [json.loads(line) for line in Path(eval_file).read_text().splitlines() if line.strip()]
    prompts = [tokenizer(tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False),
                         add_special_tokens=False)["input_ids"] for row in rows]
    completions = decode(model, prompts, DecodeSettings(max_new_tokens, tokenizer.eos_token_id), tokenizer.pad_token_id,
                         torch.device("cpu"))
    correct = sum(answer_reward(tokenizer.decode(ids, skip_special_tokens=True), row) > 0
                  for row, ids in zip(rows, completions))
    return correct / len(rows)


def _fine_tune(settings: TeacherSettings, student_dir: Path, out_dir: Path, small: bool,
               log: Callable[[str], None]) -> dict:
    """The SFT job in this process (no torch.distributed) from the student on the slip-free rows, its exported
    model in `out_dir` with the student's tokenizer files. Returns the facts to record."""
    cfg = sft_recipe(settings)
    label = "arithmetic teacher"
    log(f"[offline] {label}: the SFT job ({SFT_RECIPE} with {' '.join(settings.sft_overrides)}: "
        f"{cfg.train.max_steps} steps of {cfg.train.batch_size} rows) from the student, in this process")
    with tempfile.TemporaryDirectory(prefix=".teacher-run-", dir=out_dir.parent) as scratch, \
            torch_threads(SFT_THREADS), _quiet_transformers_progress(), \
            contextlib.redirect_stdout(_LinesToLog(log, sys.stdout, label)):
        data = Path(scratch) / "data"
        copy_tokenizer(student_dir, data / "tokenizer")
        with (data / "train.jsonl").open("w", encoding="utf-8") as handle:
            for row in slip_free_rows(settings, small):
                handle.write(json.dumps(row) + "\n")
        facts = run_sft(cfg, student_dir, data, out_dir, Path(scratch) / "run")
    copy_tokenizer(student_dir, out_dir)  # the exported tokenizer is the same one; these are its very bytes
    return facts


def ensure_arithmetic_teacher(root: str | Path | None = None, *, small: bool = False,
                              log: Callable[[str], None] = print) -> Path:
    """`<root>/tiny-arithmetic-teacher/`, built if missing or stale (after the student it starts from); its path.

    Safe from every rank at once (file lock). The first build fine-tunes the student (about a minute on a
    CPU; `small`: seconds) and measures the teacher's held-out accuracy; later calls return at once."""
    settings = _settings(small)
    root = Path(root) if root is not None else default_assets_root()
    directory = root / TEACHER_DIR
    student = ensure_arithmetic_assets(root, small=small, log=log)
    expected = expected_settings(settings, student.model_dir, small)
    if _is_built(directory, expected):
        return directory
    with file_lock(root / ".arithmetic-teacher.lock"):
        if _is_built(directory, expected):
            return directory
        started = time.perf_counter()
        log(f"[offline] building the arithmetic teacher ({ARITHMETIC_TEACHER}) under {root}; cached for later runs")
        with staged_directory(directory) as staging:
            facts = _fine_tune(settings, student.model_dir, staging, small, log)
            facts["heldout_accuracy"] = held_out_accuracy(staging, student.eval_file, settings.eval_max_new_tokens)
            facts["seconds"] = round(time.perf_counter() - started, 1)
            (staging / "build.json").write_text(json.dumps({"settings": expected, **facts}, indent=2))
        log(f"[offline] arithmetic teacher built in {facts['seconds']:.0f} s: greedy held-out accuracy "
            f"{facts['heldout_accuracy']:.3f}")
    return directory
