"""Offline assets of the arithmetic GRPO recipe: chat-formatted word problems and a tiny chat policy.

Built once and cached beside the sentiment assets (same locked, staged build as `assets.py`):

    tiny-arithmetic/        the tiny tokenizer with a chat template + the tiny policy fine-tuned on
                            solved problems (Hugging Face format), build.json
    arithmetic/train.jsonl  {"messages": [{"role": "user", ...}], "answer": "12"} rows
    arithmetic/eval.jsonl   held-out problems (a different seed: other numbers, names and objects)

The story the recipe tells: supervised data with a systematic error, fixed by RL with a
verifiable reward. The policy starts from the tiny sentiment policy (`assets.py`) and is
fine-tuned on worked solutions ("7 + 5 = 12\n#### 12") written by a careless annotator: in
`slip_frac` of the subtraction solutions the final line repeats the amount given away
("9 - 4 = 5\n#### 4"). The fine-tuned policy does the sums but often reports the wrong number
for subtractions (held-out accuracy about 0.5); GRPO with an exact-answer reward teaches it to
report what it computed.
"""

from __future__ import annotations

import dataclasses
import json
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from rl_core.tiny.assets import (FORMAT_VERSION, _is_built, _quiet_transformers_progress,
                                 default_assets_root, ensure_tiny_assets, file_lock, init_tiny_gpt2, staged_directory,
                                 torch_threads)
from rl_core.tiny.corpus import NAMES_HE, NAMES_SHE

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
    steps: int = 2400
    batch_size: int = 32
    lr: float = 3e-3
    # Start from the tiny sentiment policy; False = a fresh 2-layer model with room for whole problems
    # (the small test assets' policy has a 64-token context).
    from_base_policy: bool = True


REAL_SETTINGS = ArithmeticSettings()
SMALL_SETTINGS = ArithmeticSettings(train_problems=64, eval_problems=16, sft_problems=256, steps=10, batch_size=8,
                                    from_base_policy=False)


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


def encode_solved(tokenizer, problem: dict) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids + EOS) tokenized the way the RL job sees them: the rendered
    prompt on its own, the response as the engine would sample it."""
    prompt = tokenizer.apply_chat_template(problem["messages"], add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    response_ids = tokenizer(" " + problem["solution"], add_special_tokens=False)["input_ids"]
    return prompt_ids, response_ids + [tokenizer.eos_token_id]


def finetune(model, tokenizer, problems: list[dict], settings: ArithmeticSettings,
             log: Callable[[str], None] = print, num_threads: int = 2) -> list[float]:
    """Plain PyTorch supervised fine-tuning on solved problems, loss on the response tokens only.

    Linear warmup then a constant learning rate: the first k steps of a longer build are exactly
    a k-step build (the batches come from the same seeded stream), so `steps` is one knob."""
    import torch

    examples = [encode_solved(tokenizer, p) for p in problems]
    generator = torch.Generator().manual_seed(settings.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=settings.lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = 30
    log_every = max(1, settings.steps // 10)
    losses = []
    started = time.perf_counter()
    model.train()
    with torch_threads(num_threads):
        for step in range(settings.steps):
            for group in optimizer.param_groups:
                group["lr"] = settings.lr * min(1.0, (step + 1) / warmup)
            picks = torch.randint(0, len(examples), (settings.batch_size,), generator=generator).tolist()
            rows = [examples[i][0] + examples[i][1] for i in picks]
            width = max(len(r) for r in rows)
            input_ids = torch.full((len(rows), width), tokenizer.pad_token_id)
            labels = torch.full((len(rows), width), -100)
            attention = torch.zeros((len(rows), width), dtype=torch.long)
            for j, i in enumerate(picks):
                prompt, response = examples[i]
                n = len(prompt) + len(response)
                input_ids[j, :n] = torch.tensor(prompt + response)
                labels[j, len(prompt):n] = torch.tensor(response)
                attention[j, :n] = 1
            loss = model(input_ids=input_ids, attention_mask=attention, labels=labels).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            if (step + 1) % log_every == 0:
                elapsed = time.perf_counter() - started
                log(f"[rl_core.tiny] arithmetic policy: step {step + 1}/{settings.steps} "
                    f"loss {sum(losses[-log_every:]) / log_every:.3f} "
                    f"({elapsed:.0f} s, about {elapsed * (settings.steps / (step + 1) - 1):.0f} s left)")
    model.eval()
    return losses


def _write_jsonl(path: Path, problems: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for problem in problems:
            handle.write(json.dumps({"messages": problem["messages"], "answer": problem["answer"]}) + "\n")


def ensure_arithmetic_assets(root: str | Path | None = None, *, small: bool = False,
                             log: Callable[[str], None] = print) -> ArithmeticPaths:
    """Build the arithmetic policy and problem files if missing or stale; return where they are.

    Safe from every rank at once (file lock). The first build fine-tunes for `steps` steps,
    logging its progress; later calls return at once.
    """
    settings = SMALL_SETTINGS if small else REAL_SETTINGS
    paths = ArithmeticPaths.under(Path(root) if root is not None else default_assets_root())
    expected = {"format": FORMAT_VERSION, "component": "arithmetic", "small": small, **dataclasses.asdict(settings)}
    if _is_built(paths.model_dir, expected) and _is_built(paths.data_dir, expected):
        return paths
    base = ensure_tiny_assets(paths.root, small=small, log=log)  # the tokenizer and policy to start from
    with file_lock(paths.root / ".arithmetic.lock"):
        if _is_built(paths.model_dir, expected) and _is_built(paths.data_dir, expected):
            return paths
        started = time.perf_counter()
        log(f"[rl_core.tiny] building the arithmetic recipe's policy and problems under {paths.root} "
            f"({settings.steps} fine-tuning steps); cached for later runs")
        with staged_directory(paths.data_dir) as staging:
            for path, count, seed in ((paths.train_file, settings.train_problems, settings.seed + 1),
                                      (paths.eval_file, settings.eval_problems, settings.seed + 2)):
                problems = make_problems(count, seed, settings.max_operand, settings.sub_frac)
                _write_jsonl(staging / path.name, problems)
            (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
        with staged_directory(paths.model_dir) as staging:
            import torch
            from transformers import AutoModelForCausalLM

            tokenizer = chat_tokenizer(base.model_dir)
            torch.manual_seed(settings.seed)
            if settings.from_base_policy:
                model = AutoModelForCausalLM.from_pretrained(str(base.model_dir))
            else:
                model = init_tiny_gpt2(tokenizer, n_layer=2, n_embd=32, n_head=2, n_positions=160, seed=settings.seed)
            corpus = make_problems(settings.sft_problems, settings.seed, settings.max_operand, settings.sub_frac,
                                   settings.slip_frac)
            losses = finetune(model, tokenizer, corpus, settings, log=log)
            with _quiet_transformers_progress():
                model.save_pretrained(staging)
            tokenizer.save_pretrained(staging)
            tail = losses[-max(1, len(losses) // 10):]
            facts = {"first_loss": losses[0], "final_loss": sum(tail) / len(tail),
                     "seconds": round(time.perf_counter() - started, 1)}
            (staging / "build.json").write_text(json.dumps({"settings": expected, **facts}, indent=2))
        log(f"[rl_core.tiny] arithmetic assets built in {time.perf_counter() - started:.0f} s")
    return paths


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
    expected = {"format": FORMAT_VERSION, "component": "arithmetic-sft", "small": small, **dataclasses.asdict(settings)}
    if _is_built(directory, expected):
        return directory
    base = ensure_tiny_assets(paths.root, small=small, log=log)
    with file_lock(paths.root / ".arithmetic-sft.lock"):
        if _is_built(directory, expected):
            return directory
        log(f"[rl_core.tiny] writing the arithmetic SFT rows under {directory}")
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
