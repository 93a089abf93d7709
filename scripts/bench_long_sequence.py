"""Peak memory of one training step on a long response, LM-head chunks on against off, side by side.

    python scripts/bench_long_sequence.py [--tokens 8192] [--vocab 32000] [--chunk 1024] [--bound-gb 1.0]

A tiny rotary model (Llama: 2 layers, hidden 64, `--tokens` positions, a `--vocab` vocabulary, random
weights from its transformers config) trains one GRPO-style step (policy gradient with an entropy bonus,
through the job's one worker, FSDP2 and the optimizer) on one sequence of a 64-token prompt and a response
filling the rest of `--tokens`. Each setting runs in a fresh process, which reports its peak resident
memory (`ru_maxrss`) and how much the step added to what the loaded model held before it. At this size the
logits dominate: float32 `[tokens, vocabulary]` are 1.05 GB for 8192 x 32000, and the loss's backward holds
several such tensors unless the head runs in chunks recomputed in backward (`model.logits_chunk`).
The last line is one JSON object with both runs and the ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))


def rss_gb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def one_step(tokens: int, vocab: int, chunk: int, checkpointing: bool) -> dict:
    """Build the model, train one step, report memory (run in a fresh process)."""
    import time

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from rl_core.distributed import init_distributed
    from workers.forward import ForwardSettings, token_logprobs_and_entropy
    from workers.fsdp import shard_model
    from workers.trainable import TrainableModel
    from workers.layout import rows_to_batch
    from workers.loading import enable_gradient_checkpointing
    from workers.worker import BatchWorker

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=os.environ.get("BENCH_PORT", "29533"), RANK="0",
                      WORLD_SIZE="1", LOCAL_RANK="0")
    init_distributed(timeout_s=600)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=tokens)
    model = LlamaForCausalLM(config)
    if checkpointing:
        enable_gradient_checkpointing(model)
    trainable = TrainableModel(shard_model(model), lambda m: torch.optim.AdamW(m.parameters(), lr=1e-4))
    prompt = 64
    ids = torch.randint(0, vocab, (tokens,), generator=torch.Generator().manual_seed(1)).tolist()
    batch = rows_to_batch([{"input_ids": ids, "action_mask": [0] * prompt + [1] * (tokens - prompt)}], 0)
    batch["advantages"] = torch.ones(batch["input_ids"].shape)
    worker = BatchWorker(0, 1, torch.device("cpu"), tokens, settings=ForwardSettings(logits_chunk=chunk))

    def loss_fn(model, micro):
        logprobs, entropy = token_logprobs_and_entropy(model, micro, actions_only=True)
        mask = micro["action_mask"].float()
        return ((-logprobs * micro["advantages"] - 0.01 * entropy) * mask).sum(), {}

    before = rss_gb()
    started = time.perf_counter()
    metrics, _ = worker.forward_backward(trainable, batch, loss_fn, float(batch["action_mask"].sum()))
    trainable.step()
    return {"chunk": chunk, "peak_rss_gb": round(rss_gb(), 3), "step_added_gb": round(rss_gb() - before, 3),
            "step_s": round(time.perf_counter() - started, 2), "loss": metrics["loss"][0]}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--vocab", type=int, default=32000)
    parser.add_argument("--chunk", type=int, default=1024)
    parser.add_argument("--checkpointing", action="store_true", help="activation checkpointing of the blocks too")
    parser.add_argument("--bound-gb", type=float, default=1.0, help="the stated bound on what the chunked step adds")
    parser.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)  # the child process: one chunk size
    args = parser.parse_args()
    if args.one is not None:
        print(json.dumps(one_step(args.tokens, args.vocab, args.one, args.checkpointing)))
        return
    runs = []
    for chunk in (args.chunk, 0):
        argv = [sys.executable, __file__, "--tokens", str(args.tokens), "--vocab", str(args.vocab), "--one", str(chunk)]
        argv += ["--checkpointing"] if args.checkpointing else []
        done = subprocess.run(argv, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        if done.returncode != 0:
            sys.exit(f"the step with chunk={chunk} failed:\n{done.stdout[-3000:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"logits_chunk={chunk or 'off':>5}: peak RSS {runs[-1]['peak_rss_gb']:.2f} GB, the step added "
              f"{runs[-1]['step_added_gb']:.2f} GB, {runs[-1]['step_s']:.1f} s, loss {runs[-1]['loss']:.6f}", flush=True)
    chunked, whole = runs
    within = chunked["step_added_gb"] <= args.bound_gb
    print(f"{args.tokens} tokens x {args.vocab} vocabulary: chunks of {args.chunk} add "
          f"{whole['step_added_gb'] / max(chunked['step_added_gb'], 1e-3):.1f}x less memory to the step "
          f"({chunked['step_added_gb']:.2f} vs {whole['step_added_gb']:.2f} GB; bound {args.bound_gb} GB: "
          f"{'within' if within else 'OVER'}); the same loss: {abs(chunked['loss'] - whole['loss']) < 1e-4}")
    print(json.dumps({"tokens": args.tokens, "vocab": args.vocab, "runs": runs, "bound_gb": args.bound_gb,
                      "within_bound": within,
                      "memory_ratio": round(whole["step_added_gb"] / max(chunked["step_added_gb"], 1e-3), 2)}))
    if not within:
        sys.exit(1)


if __name__ == "__main__":
    main()
