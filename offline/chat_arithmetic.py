"""Two-digit addition and subtraction asked as plain chat questions, for the released-model GRPO recipe
(configs/grpo_smollm2_arithmetic.yaml): `chat-arithmetic/` under the assets root.

    train.jsonl      {"messages": [{"role": "user", "content": "What is 48 + 37?"}], "answer": "85"}
    eval.jsonl       held-out questions: no operand pair of train.jsonl, asked the same way
    phrasings.jsonl  the held-out pairs asked in other words ("How much is 48 plus 37?"), to check that a
                     trained model's gain is more than one phrasing
    build.json       the settings they were made with

Data only (the model is the released SmolLM2-135M-Instruct), made in milliseconds, so a missing or stale
directory is simply written again.
"""

from __future__ import annotations

import dataclasses
import json
import random
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offline import CHAT_ARITHMETIC
from offline.assets import default_assets_root, file_lock, settings_match, staged_directory

PHRASINGS = ("How much is {a} {word} {b}?", "Compute {a} {sign} {b}.", "Calculate {a} {sign} {b}.",
             "What do you get from {a} {word} {b}?")
WORDS = {"+": "plus", "-": "minus"}


@dataclass(frozen=True)
class ChatArithmeticSettings:
    seed: int = 7
    train_questions: int = 4000
    eval_questions: int = 200
    low: int = 10  # operands are two-digit numbers
    high: int = 99
    sub_frac: float = 0.5  # subtractions (never below zero); the rest additions


@dataclass(frozen=True)
class ChatArithmeticPaths:
    data_dir: Path

    @property
    def train_file(self) -> Path:
        return self.data_dir / "train.jsonl"

    @property
    def eval_file(self) -> Path:
        return self.data_dir / "eval.jsonl"

    @property
    def phrasings_file(self) -> Path:
        return self.data_dir / "phrasings.jsonl"


def _pairs(settings: ChatArithmeticSettings) -> list[tuple[int, str, int]]:
    """Every distinct question (a, op, b), shuffled once by the seed."""
    questions = [(a, op, b) for a in range(settings.low, settings.high + 1)
                 for b in range(settings.low, settings.high + 1) for op in "+-" if op == "+" or a >= b]
    rng = random.Random(settings.seed)
    rng.shuffle(questions)
    adds = [q for q in questions if q[1] == "+"]
    subs = [q for q in questions if q[1] == "-"]
    total = settings.train_questions + settings.eval_questions
    n_sub = round(total * settings.sub_frac)
    chosen = subs[:n_sub] + adds[:total - n_sub]
    rng.shuffle(chosen)
    return chosen


def _row(a: int, op: str, b: int, text: str) -> dict:
    answer = a + b if op == "+" else a - b
    return {"messages": [{"role": "user", "content": text}], "answer": str(answer)}


def build_rows(settings: ChatArithmeticSettings) -> dict[str, list[dict]]:
    questions = _pairs(settings)
    held_out, train = questions[:settings.eval_questions], questions[settings.eval_questions:]
    rng = random.Random(settings.seed + 1)
    phrased = [_row(a, op, b, rng.choice(PHRASINGS).format(a=a, b=b, sign=op, word=WORDS[op]))
               for a, op, b in held_out]
    return {"train.jsonl": [_row(a, op, b, f"What is {a} {op} {b}?") for a, op, b in train],
            "eval.jsonl": [_row(a, op, b, f"What is {a} {op} {b}?") for a, op, b in held_out],
            "phrasings.jsonl": phrased}


def ensure_chat_arithmetic(root: str | Path | None = None, log: Callable[[str], None] = print) -> ChatArithmeticPaths:
    """The question files under the assets root, written if missing or made with other settings."""
    settings = ChatArithmeticSettings()
    expected = json.loads(json.dumps({"component": CHAT_ARITHMETIC, **dataclasses.asdict(settings)}))
    paths = ChatArithmeticPaths(Path(root if root is not None else default_assets_root()) / CHAT_ARITHMETIC)
    if settings_match(paths.data_dir / "build.json", expected):
        return paths
    with file_lock(paths.data_dir.parent / f".{CHAT_ARITHMETIC}.lock"):
        if not settings_match(paths.data_dir / "build.json", expected):
            log(f"[offline] writing the chat arithmetic questions under {paths.data_dir}")
            with staged_directory(paths.data_dir) as staging:
                for name, rows in build_rows(settings).items():
                    (staging / name).write_text("".join(json.dumps(row) + "\n" for row in rows))
                (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
    return paths
