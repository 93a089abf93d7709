"""Offline assets of the arithmetic GRPO recipe: chat-formatted word problems and a tiny chat policy.

Built once and cached beside the sentiment assets (same locked, staged build as `assets.py`):

    arithmetic-sft/         the SFT rows (worked solutions) and the tiny tokenizer with a chat template
    tiny-arithmetic/        the tiny policy fine-tuned on those rows by the SFT job, with its recipe
                            (configs/sft_arithmetic.yaml), in Hugging Face format; build.json
    arithmetic/train.jsonl  {"messages": [{"role": "user", ...}], "answer": "12"} rows
    arithmetic/eval.jsonl   held-out problems (a different seed: other numbers, names and objects)

The story the recipe tells: supervised data with a systematic error, fixed by RL with a
verifiable reward. The policy starts from the tiny sentiment policy (`assets.py`) and is
fine-tuned on worked solutions ("7 + 5 = 12\n#### 12") written by a careless annotator: in
`slip_frac` of the subtraction solutions the final line repeats the amount given away
("9 - 4 = 5\n#### 4"). The fine-tuned policy does the sums but often reports the wrong number
for subtractions (held-out accuracy about 0.6); GRPO with an exact-answer reward teaches it to
report what it computed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offline.assets import (FORMAT_VERSION, _is_built, _quiet_transformers_progress,
                                 default_assets_root, ensure_tiny_assets, file_lock, init_tiny_gpt2, staged_directory,
                                 torch_threads)
from offline.corpus import NAMES_HE, NAMES_SHE

# A plain-text chat template: "User: ...\nAssistant: ...<eos>\n". The tiny tokenizer has no role
# tokens, and a template that renders as readable text keeps the samples table readable too.
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] }}{{ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' }}{{ message['content'] }}{{ '\\n' }}"
    "{%- else -%}{{ 'Assistant: ' }}{{ message['content'] }}{{ eos_token }}{{ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:' }}{%- endif -%}"
)
OBJECTS = ("apples", "books", "coins", "cups", "stones", "flowers", "candles", "keys", "shells", "cookies",
           "pencils", "boxes", "cards", "eggs", "kites", "bells")


@dataclass(frozen=True)
class ArithmeticSettings:
    """Everything that determines the built arithmetic assets; stored in build.json."""

    seed: int = 2024
    max_operand: int = 10
    sub_frac: float = 0.5  # subtraction problems ("gives b away"); the rest are additions
    slip_frac: float = 0.7  # fine-tuning subtraction solutions whose final line carries the annotator's slip
    train_problems: int = 4000
    eval_problems: int = 200
    sft_problems: int = 20000  # the fine-tuning corpus (seeds disjoint from train and eval)
    # The fine-tuning itself is the SFT recipe, SFT_RECIPE, with these `key=value` overrides.
    sft_overrides: tuple[str, ...] = ()
    # Start from the tiny sentiment policy; False = a fresh 2-layer model with room for whole problems
    # (the small test assets' policy has a 64-token context).
    from_base_policy: bool = True


SFT_RECIPE = "sft_arithmetic.yaml"  # configs/: the job that fine-tunes the policy
REAL_SETTINGS = ArithmeticSettings()
SMALL_SETTINGS = ArithmeticSettings(train_problems=64, eval_problems=16, sft_problems=256, from_base_policy=False,
                                    sft_overrides=("train.max_steps=10", "train.batch_size=8", "train.schedule=constant"))


@dataclass(frozen=True)
class ArithmeticPaths:
    root: Path
    model_dir: Path
    data_dir: Path
    train_file: Path
    eval_file: Path

    @classmethod
    def under(cls, root: str | Path) -> "ArithmeticPaths":
        root = Path(root)
        data = root / "arithmetic"
        return cls(root, root / "tiny-arithmetic", data, data / "train.jsonl", data / "eval.jsonl")


# --- problems ------------------------------------------------------------------------------------


def make_problem(rng: random.Random, max_operand: int, sub_frac: float = 0.5, slip_frac: float = 0.0) -> dict:
    """One word problem, subtraction with probability `sub_frac` (else addition): the chat prompt,
    the reference answer and a worked solution ("7 + 5 = 12\n#### 12"). With probability
    `slip_frac` a subtraction solution ends with the careless annotator's slip: its final line
    repeats the amount given away ("9 - 4 = 5\n#### 4")."""
    she = rng.random() < 0.5
    name = rng.choice(NAMES_SHE if she else NAMES_HE)
    pronoun = "She" if she else "He"
    things = rng.choice(OBJECTS)
    a, b = rng.randint(1, max_operand), rng.randint(1, max_operand)
    if rng.random() < sub_frac:
        a, b = max(a, b), min(a, b)
        question = f"{name} has {a} {things} and gives {b} away. How many {things} are left?"
        answer, work = a - b, f"{a} - {b} = {a - b}"
        if rng.random() < slip_frac:
            return {"messages": [{"role": "user", "content": question}], "answer": str(answer),
                    "solution": f"{work}\n#### {b}"}
    else:
        question = f"{name} has {a} {things}. {pronoun} gets {b} more. How many {things} does {name} have now?"
        answer, work = a + b, f"{a} + {b} = {a + b}"
    return {"messages": [{"role": "user", "content": question}], "answer": str(answer),
            "solution": f"{work}\n#### {answer}"}


def make_problems(count: int, seed: int, max_operand: int, sub_frac: float, slip_frac: float = 0.0) -> list[dict]:
    rng = random.Random(f"arithmetic:{seed}")
    return [make_problem(rng, max_operand, sub_frac, slip_frac) for _ in range(count)]


# --- the policy ----------------------------------------------------------------------------------


def chat_tokenizer(base_dir: Path):
    """The tiny sentiment tokenizer (digits are single tokens) with the chat template above."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def sft_recipe(settings: ArithmeticSettings):
    """`configs/sft_arithmetic.yaml` with the settings' overrides: the job that trains the policy."""
    from rl_core.config import load_config
    from rl_core.sft.config import SFTConfig, validate

    return load_config(SFT_RECIPE, settings.sft_overrides, SFTConfig, validate)


def recipe_settings(cfg) -> dict:
    """The part of the SFT config that determines the weights (paths and logging aside): recorded in
    build.json, so an edited recipe rebuilds the policy."""
    from rl_core.config import to_dict

    train = {key: value for key, value in to_dict(cfg.train).items() if key != "log_every"}
    return {"train": train, "lora": to_dict(cfg.model.lora), "max_length": cfg.data.max_length,
            "on_long": cfg.data.on_long, "seed": cfg.trainer.seed}


class _LinesToLog(io.TextIOBase):
    """The SFT job's console lines, each passed to the build's `log`: what a rank waiting for the
    build reports (`prepare_before_process_group`)."""

    def __init__(self, log: Callable[[str], None], stdout, label: str = "arithmetic policy"):
        self.log, self.stdout, self.label, self.pending = log, stdout, label, ""

    def write(self, text: str) -> int:
        self.pending += text
        *lines, self.pending = self.pending.split("\n")
        with contextlib.redirect_stdout(self.stdout):  # a `log` that prints must not write back here
            for line in filter(str.strip, lines):
                self.log(f"[offline] {self.label}: {line}")
        return len(text)


def starting_policy(settings: ArithmeticSettings, base_model_dir: Path, scratch: Path) -> Path:
    """The model the fine-tuning starts from: the tiny sentiment policy, or for the small test assets a
    fresh 2-layer model (written to `scratch`) with room for whole problems."""
    if settings.from_base_policy:
        return base_model_dir
    init_tiny_gpt2(chat_tokenizer(base_model_dir), n_layer=2, n_embd=32, n_head=2, n_positions=160,
                   seed=settings.seed).save_pretrained(scratch)
    return scratch


def _fine_tune(settings: ArithmeticSettings, base_model_dir: Path, sft_data: Path, out_dir: Path,
               log: Callable[[str], None]) -> dict:
    """Run the SFT job in this process on the SFT rows (no torch.distributed: safe before or inside
    any job's process group) and move its exported model into `out_dir`. Returns the facts to record."""
    import tempfile

    cfg = sft_recipe(settings)
    log(f"[offline] arithmetic policy: the SFT job ({SFT_RECIPE}: {cfg.train.max_steps} steps of "
        f"{cfg.train.batch_size} rows) in this process")
    with tempfile.TemporaryDirectory(prefix=".sft-run-", dir=out_dir.parent) as scratch, torch_threads(2), \
            _quiet_transformers_progress(), contextlib.redirect_stdout(_LinesToLog(log, sys.stdout)):
        start = starting_policy(settings, base_model_dir, Path(scratch) / "init")
        return run_sft(cfg, start, sft_data, out_dir, Path(scratch) / "run")


def run_sft(cfg, start: Path, sft_data: Path, out_dir: Path, run_dir: Path) -> dict:
    """The SFT job `cfg` in this process (no torch.distributed) from the model at `start` on `sft_data`'s rows
    and tokenizer, its exported model moved into `out_dir`; the first and final loss, for the build record."""
    import shutil

    from rl_core.distributed import DataParallel
    from rl_core.sft.job import train

    cfg.model.path, cfg.model.tokenizer_path = str(start), str(sft_data / "tokenizer")
    cfg.data.train_path, cfg.data.eval_path = str(sft_data / "train.jsonl"), None  # GRPO's step 0 evaluates it
    cfg.eval.every, cfg.trainer.save_every, cfg.trainer.export_hf = 0, 0, True
    cfg.trainer.run_dir = str(run_dir)
    train(cfg, DataParallel())
    metrics = run_dir / "metrics.jsonl"
    losses = [row["train/loss"] for row in map(json.loads, metrics.read_text().splitlines()) if "train/loss" in row]
    for item in (run_dir / "final").iterdir():
        shutil.move(str(item), out_dir / item.name)
    tail = losses[-max(1, len(losses) // 10):]
    return {"first_loss": losses[0], "final_loss": sum(tail) / len(tail)}


def _write_jsonl(path: Path, problems: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for problem in problems:
            handle.write(json.dumps({"messages": problem["messages"], "answer": problem["answer"]}) + "\n")


def ensure_arithmetic_assets(root: str | Path | None = None, *, small: bool = False,
                             log: Callable[[str], None] = print) -> ArithmeticPaths:
    """Build the arithmetic policy and problem files if missing or stale; return where they are.

    Safe from every rank at once (file lock). The first build runs the SFT recipe (minutes),
    logging its progress; later calls return at once. An edited recipe rebuilds the policy.
    """
    settings = SMALL_SETTINGS if small else REAL_SETTINGS
    paths = ArithmeticPaths.under(Path(root) if root is not None else default_assets_root())
    expected = _recorded(settings, "arithmetic", small)
    expected_policy = _recorded(settings, "arithmetic", small, sft_recipe=recipe_settings(sft_recipe(settings)))
    if _is_built(paths.model_dir, expected_policy) and _is_built(paths.data_dir, expected):
        return paths
    base = ensure_tiny_assets(paths.root, small=small, log=log)  # the tokenizer and policy to start from
    sft_data = ensure_arithmetic_sft_data(paths.root, small=small, log=log)  # the rows it is fine-tuned on
    with file_lock(paths.root / ".arithmetic.lock"):
        if _is_built(paths.model_dir, expected_policy) and _is_built(paths.data_dir, expected):
            return paths
        started = time.perf_counter()
        log(f"[offline] building the arithmetic recipe's policy and problems under {paths.root}; "
            f"cached for later runs")
        with staged_directory(paths.data_dir) as staging:
            for path, count, seed in ((paths.train_file, settings.train_problems, settings.seed + 1),
                                      (paths.eval_file, settings.eval_problems, settings.seed + 2)):
                problems = make_problems(count, seed, settings.max_operand, settings.sub_frac)
                _write_jsonl(staging / path.name, problems)
            (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
        if not _is_built(paths.model_dir, expected_policy):
            with staged_directory(paths.model_dir) as staging:
                facts = _fine_tune(settings, base.model_dir, sft_data, staging, log)
                facts["seconds"] = round(time.perf_counter() - started, 1)
                (staging / "build.json").write_text(json.dumps({"settings": expected_policy, **facts}, indent=2))
        log(f"[offline] arithmetic assets built in {time.perf_counter() - started:.0f} s")
    return paths


def _recorded(settings: ArithmeticSettings, component: str, small: bool, **extra) -> dict:
    """What a build.json records of the settings (and `extra`), as JSON reads it back (tuples become lists)."""
    return json.loads(json.dumps({"format": FORMAT_VERSION, "component": component, "small": small,
                                  **dataclasses.asdict(settings), **extra}))


# --- the SFT recipe's data ----------------------------------------------------------------------

ARITHMETIC_SFT = "tiny-arithmetic-sft"  # config value naming the SFT recipe's offline data


def ensure_arithmetic_sft_data(root: str | Path | None = None, *, small: bool = False,
                               log: Callable[[str], None] = print) -> Path:
    """`<root>/arithmetic-sft/`: the chat tokenizer, and chat rows for `rl_core.train_sft`:
    `train.jsonl` is the fine-tuning corpus the recipe's policy is trained on (the careless
    annotator's slips included), `eval.jsonl` the held-out problems of the GRPO recipe with correct
    solutions and their `answer`. Seconds to build: no training."""
    settings = SMALL_SETTINGS if small else REAL_SETTINGS
    paths = ArithmeticPaths.under(Path(root) if root is not None else default_assets_root())
    directory = paths.root / "arithmetic-sft"
    expected = _recorded(settings, "arithmetic-sft", small)
    if _is_built(directory, expected):
        return directory
    base = ensure_tiny_assets(paths.root, small=small, log=log)
    with file_lock(paths.root / ".arithmetic-sft.lock"):
        if _is_built(directory, expected):
            return directory
        log(f"[offline] writing the arithmetic SFT rows under {directory}")
        with staged_directory(directory) as staging:
            chat_tokenizer(base.model_dir).save_pretrained(staging / "tokenizer")
            corpus = make_problems(settings.sft_problems, settings.seed, settings.max_operand, settings.sub_frac,
                                   settings.slip_frac)
            held_out = make_problems(settings.eval_problems, settings.seed + 2, settings.max_operand, settings.sub_frac)
            for name, problems in (("train.jsonl", corpus), ("eval.jsonl", held_out)):
                with (staging / name).open("w", encoding="utf-8") as handle:
                    for problem in problems:
                        chat = problem["messages"] + [{"role": "assistant", "content": problem["solution"]}]
                        handle.write(json.dumps({"messages": chat, "answer": problem["answer"]}) + "\n")
            (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
    return directory
