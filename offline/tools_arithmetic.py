"""Offline assets of the tool-calling GRPO recipe: multiplications the tiny policy cannot do in its head,
a calculator tool it can call, and a chat policy that rarely calls it.

Shipped in `assets/` (scripts/bootstrap_assets.py); rebuilt, when missing or stale, beside the sentiment
assets (same locked, staged build as `arithmetic.py`):

    tools-arithmetic-sft/         the SFT rows (multi-turn demonstrations), held-out rows without tools, and
                                  the tokenizer: the tiny one plus `<tool_call>` `</tool_call>` tokens and
                                  a compact chat template that renders the tool list
    tiny-tools-arithmetic/        the arithmetic recipe's chat policy (`tiny-arithmetic`) fine-tuned on those
                                  rows by the SFT job (configs/sft_tools_arithmetic.yaml), in Hugging Face
                                  format; build.json
    tools-arithmetic/train.jsonl  {"messages": [{"role": "user", "content": "What is 37 * 48?"}], "answer": "1776"}
    tools-arithmetic/eval.jsonl   held-out problems: operand pairs (either order) that no other file holds

The story: an annotator who owns a calculator but seldom uses it. Two-digit multiplications are
out of reach of a 1M-parameter model's head, but the demonstrations answer most of them directly
("37 * 48 = 1776\\n#### 1776"); only `call_frac` of those whose prompt lists the tool call it
(`<tool_call>{"name": "calc", "arguments": {"expr": "37 * 48"}}</tool_call>`), read the result and
copy it ("#### 1776"). The fine-tuned policy can call the tool but mostly answers in its head; GRPO
with an exact-answer reward teaches it to call. Demonstrations whose prompt lists no tool always answer
directly, so the same policy evaluated without tools (`env.tools=[]`) measures what it can do in its head.

Fitting 128 positions: JSON calls are dear with the tiny tokenizer (61 tokens for a call of
`multiply(a, b)` spelt in full), so the call tags are single tokens (plain added tokens, not special
ones: decoding with `skip_special_tokens=True` keeps them, and the parser reads them), the tool is
`calc(expr)`, and the template is terse:

    Tools: calc(expr)
    User: What is 37 * 48?
    Assistant:
    <tool_call>{"name": "calc", "arguments": {"expr": "37 * 48"}}</tool_call><|endoftext|>
    Tool: 1776
    Assistant:
    #### 1776<|endoftext|>

about 110 tokens. The template is append-only (the generation prompt `Assistant:\\n` is exactly the start
of a rendered assistant turn, and nothing earlier is ever re-rendered), so a trajectory is one sequence.
The SFT job renders rows without a `tools` argument, so a demonstration carries the tool list as a
system message whose content is exactly the line the template writes for `tools=` (`tools_line`): the
same text, hence the same tokens, as the GRPO prompt.
"""

from __future__ import annotations

import contextlib
import json
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from offline.arithmetic import _LinesToLog, _recorded, recipe_settings, run_sft
from offline.assets import (_is_built, _quiet_transformers_progress, default_assets_root, ensure_tiny_assets,
                                 file_lock, init_tiny_gpt2, staged_directory, torch_threads)

TOOL_CALL_TOKENS = ("<tool_call>", "</tool_call>")  # hermes tags, one token each
TOOL_PATHS = ("envs.arithmetic_tools:calc",)  # the recipe's env.tools
CHAT_TEMPLATE = (
    "{%- if tools -%}{{ 'Tools:' }}"
    "{%- for tool in tools -%}"
    "{{ ' ' ~ tool.function.name ~ '(' ~ ((tool.function.parameters.properties or {}) | join(', ')) ~ ')' }}"
    "{%- endfor -%}{{ '\\n' }}{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'system' -%}{{ message['content'] ~ '\\n' }}"
    "{%- elif message['role'] == 'user' -%}{{ 'User: ' ~ message['content'] ~ '\\n' }}"
    "{%- elif message['role'] == 'tool' -%}{{ 'Tool: ' ~ message['content'] ~ '\\n' }}"
    "{%- else -%}{{ 'Assistant:\\n' ~ message['content'] ~ eos_token ~ '\\n' }}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}{{ 'Assistant:\\n' }}{%- endif -%}"
)


@dataclass(frozen=True)
class ToolsArithmeticSettings:
    """Everything that determines the built assets; stored in build.json."""

    seed: int = 3033
    min_operand: int = 10
    max_operand: int = 99
    tools_frac: float = 0.75  # demonstrations whose prompt lists the tool; the rest answer without one
    call_frac: float = 0.4  # of those, the ones that call it; the others answer in their head
    train_problems: int = 4000
    eval_problems: int = 200
    sft_problems: int = 20000
    # The fine-tuning itself is the SFT recipe, SFT_RECIPE, with these `key=value` overrides.
    sft_overrides: tuple[str, ...] = ()
    # Start from the arithmetic recipe's chat policy (offline/arithmetic.py: it already reads a question
    # and copies its numbers, "7 + 5 = 12"), its embeddings grown by the two tag tokens; False = a fresh
    # 2-layer model with room for whole conversations (the small test assets' policy has 64 positions).
    from_base_policy: bool = True


SFT_RECIPE = "sft_tools_arithmetic.yaml"
# Torch threads of the in-process fine-tuning. One: on two cores shared with other jobs, a second thread
# waits at every op for whichever of the two was preempted (steps of 64 rows took 3-9 s instead of 0.7).
SFT_THREADS = 1
REAL_SETTINGS = ToolsArithmeticSettings()
SMALL_SETTINGS = ToolsArithmeticSettings(train_problems=64, eval_problems=16, sft_problems=256,
                                         from_base_policy=False,
                                         sft_overrides=("train.max_steps=10", "train.batch_size=8",
                                                        "train.schedule=constant", "train.packing=false"))


@dataclass(frozen=True)
class ToolsArithmeticPaths:
    root: Path
    model_dir: Path
    data_dir: Path
    train_file: Path
    eval_file: Path
    sft_dir: Path

    @classmethod
    def under(cls, root: str | Path) -> "ToolsArithmeticPaths":
        root = Path(root)
        data = root / "tools-arithmetic"
        return cls(root, root / "tiny-tools-arithmetic", data, data / "train.jsonl", data / "eval.jsonl",
                   root / "tools-arithmetic-sft")


# --- the tokenizer and the tool line -------------------------------------------------------------


def chat_tokenizer(base_dir: Path):
    """The tiny tokenizer (digits are single tokens) with the call tags as tokens and the template above."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(base_dir))
    tokenizer.add_tokens(list(TOOL_CALL_TOKENS))  # plain added tokens: kept by skip_special_tokens
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def tool_schemas() -> list[dict]:
    from envs.tools import Toolbox

    return Toolbox.from_paths(list(TOOL_PATHS)).schemas


def tools_line(tokenizer, schemas: list[dict]) -> str:
    """The line the template writes for `tools=schemas`, as a system message's content renders it."""
    probe = [{"role": "user", "content": "?"}]
    with_tools = tokenizer.apply_chat_template(probe, tools=schemas, tokenize=False)
    without = tokenizer.apply_chat_template(probe, tokenize=False)
    if not with_tools.endswith(without) or not with_tools[:-len(without)].endswith("\n"):
        raise ValueError("the chat template must write the tool list as one line before the conversation")
    return with_tools[:-len(without)][:-1]


# --- problems ------------------------------------------------------------------------------------


def question(a: int, b: int) -> str:
    return f"What is {a} * {b}?"


def tool_call(a: int, b: int) -> str:
    payload = json.dumps({"name": "calc", "arguments": {"expr": f"{a} * {b}"}})
    return f"{TOOL_CALL_TOKENS[0]}{payload}{TOOL_CALL_TOKENS[1]}"


def prompt_row(a: int, b: int) -> dict:
    return {"messages": [{"role": "user", "content": question(a, b)}], "answer": str(a * b)}


def held_out_pairs(settings: ToolsArithmeticSettings) -> list[tuple[int, int]]:
    """The eval problems' operand pairs, distinct; neither order of any is used anywhere else."""
    rng = random.Random(f"tools-arithmetic:eval:{settings.seed}")
    pairs: list[tuple[int, int]] = []
    seen: set[frozenset] = set()
    while len(pairs) < settings.eval_problems:
        a, b = rng.randint(settings.min_operand, settings.max_operand), rng.randint(settings.min_operand,
                                                                                    settings.max_operand)
        if frozenset((a, b)) not in seen:
            seen.add(frozenset((a, b)))
            pairs.append((a, b))
    return pairs


def sample_pairs(settings: ToolsArithmeticSettings, count: int, stream: str) -> list[tuple[int, int]]:
    """`count` operand pairs (repeats allowed) outside the held-out ones, from the seeded `stream`."""
    excluded = {frozenset(pair) for pair in held_out_pairs(settings)}
    rng = random.Random(f"tools-arithmetic:{stream}:{settings.seed}")
    pairs = []
    while len(pairs) < count:
        a, b = rng.randint(settings.min_operand, settings.max_operand), rng.randint(settings.min_operand,
                                                                                    settings.max_operand)
        if frozenset((a, b)) not in excluded:
            pairs.append((a, b))
    return pairs


def demonstration(a: int, b: int, tools: str | None, call: bool) -> dict:
    """One SFT row: with the tool line `tools` (None: no tool listed) and, when `call`, a call of it."""
    messages = [{"role": "system", "content": tools}] if tools is not None else []
    messages.append({"role": "user", "content": question(a, b)})
    answer = str(a * b)
    if call:
        if tools is None:
            raise ValueError("a demonstration can only call a tool its prompt lists")
        messages += [{"role": "assistant", "content": tool_call(a, b)},
                     {"role": "tool", "name": "calc", "content": answer},
                     {"role": "assistant", "content": f"#### {answer}"}]
    else:  # worked in the head, as the arithmetic recipe's solutions are ("7 + 5 = 12")
        messages.append({"role": "assistant", "content": f"{a} * {b} = {answer}\n#### {answer}"})
    return {"messages": messages, "answer": answer, "calls": int(call)}


def demonstrations(settings: ToolsArithmeticSettings, tools: str) -> list[dict]:
    rng = random.Random(f"tools-arithmetic:demos:{settings.seed}")
    rows = []
    for a, b in sample_pairs(settings, settings.sft_problems, "sft"):
        listed = rng.random() < settings.tools_frac
        rows.append(demonstration(a, b, tools if listed else None, listed and rng.random() < settings.call_frac))
    return rows


# --- building ------------------------------------------------------------------------------------


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for row in rows:
            handle.write(json.dumps(row) + "\n")


def _settings(small: bool) -> ToolsArithmeticSettings:
    return SMALL_SETTINGS if small else REAL_SETTINGS


def ensure_tools_arithmetic_sft_data(root: str | Path | None = None, *, small: bool = False,
                                     log: Callable[[str], None] = print) -> Path:
    """`<root>/tools-arithmetic-sft/`: the tokenizer, `train.jsonl` (the demonstrations) and `eval.jsonl`
    (the held-out problems answered directly, no tool listed: the SFT job's greedy eval/accuracy is the
    policy's in-head accuracy). Seconds to build: no training."""
    settings = _settings(small)
    paths = ToolsArithmeticPaths.under(Path(root) if root is not None else default_assets_root())
    expected = _recorded(settings, "tools-arithmetic-sft", small)
    if _is_built(paths.sft_dir, expected):
        return paths.sft_dir
    base = ensure_tiny_assets(paths.root, small=small, log=log)
    with file_lock(paths.root / ".tools-arithmetic-sft.lock"):
        if _is_built(paths.sft_dir, expected):
            return paths.sft_dir
        log(f"[offline] writing the tool-calling SFT rows under {paths.sft_dir}")
        with staged_directory(paths.sft_dir) as staging:
            tokenizer = chat_tokenizer(base.model_dir)
            tokenizer.save_pretrained(staging / "tokenizer")
            _write_jsonl(staging / "train.jsonl", demonstrations(settings, tools_line(tokenizer, tool_schemas())))
            _write_jsonl(staging / "eval.jsonl", [demonstration(a, b, None, False)
                                                  for a, b in held_out_pairs(settings)])
            (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
    return paths.sft_dir


def sft_recipe(settings: ToolsArithmeticSettings):
    from rl_core.config import load_config
    from rl_core.sft.config import SFTConfig, validate

    return load_config(SFT_RECIPE, settings.sft_overrides, SFTConfig, validate)


def _fine_tune(settings: ToolsArithmeticSettings, base_model_dir: Path, sft_data: Path, out_dir: Path,
               log: Callable[[str], None]) -> dict:
    """The SFT job in this process (no torch.distributed) from `base_model_dir` (the arithmetic policy; with
    `from_base_policy=False` only its tokenizer is used), its exported model moved into `out_dir`."""
    import tempfile

    cfg = sft_recipe(settings)
    log(f"[offline] tool-calling policy: the SFT job ({SFT_RECIPE}: {cfg.train.max_steps} steps of "
        f"{cfg.train.batch_size} rows) in this process")
    with tempfile.TemporaryDirectory(prefix=".sft-run-", dir=out_dir.parent) as scratch, torch_threads(SFT_THREADS), \
            _quiet_transformers_progress(), contextlib.redirect_stdout(_LinesToLog(log, sys.stdout, "tool-calling policy")):
        start = base_model_dir
        if not settings.from_base_policy:
            start = Path(scratch) / "init"
            init_tiny_gpt2(chat_tokenizer(base_model_dir), n_layer=2, n_embd=32, n_head=2, n_positions=128,
                           seed=settings.seed).save_pretrained(start)
        return run_sft(cfg, start, sft_data, out_dir, Path(scratch) / "run")


def ensure_tools_arithmetic_assets(root: str | Path | None = None, *, small: bool = False,
                                   log: Callable[[str], None] = print) -> ToolsArithmeticPaths:
    """Build the tool-calling policy and the problem files if missing or stale; return where they are.
    Safe from every rank at once (file lock); the first build runs the SFT recipe (minutes)."""
    settings = _settings(small)
    paths = ToolsArithmeticPaths.under(Path(root) if root is not None else default_assets_root())
    expected = _recorded(settings, "tools-arithmetic", small)
    expected_policy = _recorded(settings, "tools-arithmetic", small, sft_recipe=recipe_settings(sft_recipe(settings)))
    if _is_built(paths.model_dir, expected_policy) and _is_built(paths.data_dir, expected):
        return paths
    base = ensure_tiny_assets(paths.root, small=small, log=log)
    start = base.model_dir  # the tokenizer's source; a fresh model when not from_base_policy
    if settings.from_base_policy:
        from offline.arithmetic import ensure_arithmetic_assets

        start = ensure_arithmetic_assets(paths.root, small=small, log=log).model_dir
    sft_data = ensure_tools_arithmetic_sft_data(paths.root, small=small, log=log)
    with file_lock(paths.root / ".tools-arithmetic.lock"):
        if _is_built(paths.model_dir, expected_policy) and _is_built(paths.data_dir, expected):
            return paths
        started = time.perf_counter()
        log(f"[offline] building the tool-calling recipe's policy and problems under {paths.root}; "
            "cached for later runs")
        with staged_directory(paths.data_dir) as staging:
            _write_jsonl(staging / paths.train_file.name,
                         [prompt_row(a, b) for a, b in sample_pairs(settings, settings.train_problems, "train")])
            _write_jsonl(staging / paths.eval_file.name, [prompt_row(a, b) for a, b in held_out_pairs(settings)])
            (staging / "build.json").write_text(json.dumps({"settings": expected}, indent=2))
        if not _is_built(paths.model_dir, expected_policy):
            with staged_directory(paths.model_dir) as staging:
                facts = _fine_tune(settings, start, sft_data, staging, log)
                facts["seconds"] = round(time.perf_counter() - started, 1)
                (staging / "build.json").write_text(json.dumps({"settings": expected_policy, **facts}, indent=2))
        log(f"[offline] tool-calling assets built in {time.perf_counter() - started:.0f} s")
    return paths
