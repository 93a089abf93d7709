"""Build (or reuse) the offline tiny assets and show what the pretrained policy writes.

    python scripts/bootstrap_assets.py [--root DIR] [--small] [--force]
"""

from __future__ import annotations

import argparse
import os
import resource
import time

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", default=None, help="assets directory (default: $RL_CORE_ASSETS or <repo>/assets)")
    parser.add_argument("--small", action="store_true", help="a tiny build for tests (seconds)")
    parser.add_argument("--force", action="store_true", help="rebuild even if cached")
    parser.add_argument("--seed", type=int, default=None, help="override the build seed")
    args = parser.parse_args()

    from rl_core.tiny.assets import count_parameters, ensure_tiny_assets, read_build_facts
    from rl_core.data import load_prompt_dataset
    from rl_core.reward_model.sampling import sample_responses
    from workers.models import load_causal_lm, load_tokenizer

    started = time.perf_counter()
    paths = ensure_tiny_assets(args.root, small=args.small, force=args.force, seed=args.seed)
    elapsed = time.perf_counter() - started
    usage = resource.getrusage(resource.RUSAGE_SELF)
    state = f"built {', '.join(paths.built)}" if paths.built else "cached, nothing built"
    print(f"assets: {paths.root} ({state}) in {elapsed:.1f}s wall, "
          f"{usage.ru_utime + usage.ru_stime:.1f}s CPU")

    facts = read_build_facts(paths)
    tokenizer = load_tokenizer(str(paths.model_dir))
    model = load_causal_lm(str(paths.model_dir), vocab_size=len(tokenizer)).eval()
    print(f"policy: {paths.model_dir}  parameters={count_parameters(model):,}  "
          f"vocab={len(tokenizer)}  final_loss={facts['final_loss']:.3f}  "
          f"(first {facts['first_loss']:.3f}; policy build {facts['seconds']}s)")
    prompts = load_prompt_dataset(str(paths.test_prompts))
    print(f"prompts: {paths.train_prompts} / {paths.test_prompts} ({len(prompts)} test rows)")

    samples = [prompts[i]["text"] for i in range(3)]
    queries = [tokenizer.encode(text, add_special_tokens=False) for text in samples]
    for temperature in (1.0, 0.7):
        responses = sample_responses(model, tokenizer, queries, response_length=32, temperature=temperature, seed=0)
        for prompt, response in zip(samples, responses):
            print(f"[T={temperature}] {prompt} ||| {tokenizer.decode(response)}")


if __name__ == "__main__":
    main()
