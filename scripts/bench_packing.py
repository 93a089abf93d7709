"""Padded against packed micro-batches in the SFT job, measured side by side in one run.

    python scripts/bench_packing.py [--nproc 2] [--steps 30] [--warmup 5] [--rows 2048]

Rows of lognormal length (a median of ~30 words, a long tail cut at the tiny policy's 128 tokens: the shape of chat data)
are cut from the tiny corpus into prompt/response pairs; the SFT job trains the tiny policy on
them through torchrun twice, `train.packing=false` then `true`, with the same seed, batch and
`train.max_tokens_per_device`. Reported per mode: the median step time after `--warmup`, the
padding share of the micro-batch grid, the micro-batches per step, and the first losses (the
two modes must agree). The last line is one JSON object with `packed_speedup`.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def make_rows(path: Path, count: int, seed: int) -> None:
    from offline.corpus import generate_paragraphs

    rng = random.Random(seed)
    words = " ".join(generate_paragraphs(4000, seed=seed)).split()
    with path.open("w") as handle:
        for _ in range(count):
            length = min(120, max(8, int(rng.lognormvariate(3.3, 0.6))))  # words; the tiny policy holds 128 tokens
            start = rng.randrange(0, len(words) - length - 1)
            cut = max(2, length // 4)
            handle.write(json.dumps({"prompt": " ".join(words[start:start + cut]),
                                     "response": " " + " ".join(words[start + cut:start + length])}) + "\n")


def run(mode_packed: bool, args, rows: Path, model: Path, workdir: Path) -> dict:
    run_dir = workdir / ("packed" if mode_packed else "padded")
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train_sft", f"model.path={model}", "model.tokenizer_path=null",
            f"data.train_path={rows}", "data.eval_path=null", "data.max_length=128", "data.on_long=truncate", "eval.every=0",
            f"train.packing={str(mode_packed).lower()}", "train.batch_size=64", f"train.max_steps={args.steps}",
            "train.lr=1e-3", "train.schedule=constant", "train.max_tokens_per_device=2048", "eval.reward_fn=null",
            "trainer.export_hf=false", "trainer.progress=false", f"trainer.run_dir={run_dir}"]
    done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    if done.returncode != 0:
        sys.exit(f"the {'packed' if mode_packed else 'padded'} SFT run failed:\n{done.stdout[-4000:]}")
    rows_ = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    measured = rows_[1 + args.warmup:]
    return {"step_s": statistics.median(r["perf/step_s"] for r in measured),
            "padding_fraction": statistics.mean(r["perf/padding_fraction"] for r in measured),
            "first_losses": [round(r["train/loss"], 5) for r in rows_[1:4]]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--rows", type=int, default=2048)
    args = parser.parse_args()
    from offline.assets import ensure_tiny_assets

    model = ensure_tiny_assets(log=lambda *_: None).model_dir
    with tempfile.TemporaryDirectory(prefix="bench_packing_") as tmp:
        workdir = Path(tmp)
        rows = workdir / "rows.jsonl"
        make_rows(rows, args.rows, seed=0)
        padded = run(False, args, rows, model, workdir)
        packed = run(True, args, rows, model, workdir)
    for name, result in (("padded", padded), ("packed", packed)):
        print(f"{name:7s} step {result['step_s']:.3f} s  padding {result['padding_fraction']:.1%}  "
              f"first losses {result['first_losses']}")
    print(json.dumps({"padded_step_s": round(padded["step_s"], 4), "packed_step_s": round(packed["step_s"], 4),
                      "padded_padding_fraction": round(padded["padding_fraction"], 4),
                      "packed_padding_fraction": round(packed["padding_fraction"], 4),
                      "packed_speedup": round(padded["step_s"] / packed["step_s"], 3),
                      "losses_agree": padded["first_losses"] == packed["first_losses"]}))


if __name__ == "__main__":
    main()
