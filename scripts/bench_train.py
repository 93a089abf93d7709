"""Step time of the PPO job against its bare-update floor, measured in one run; sync and async.

    python scripts/bench_train.py [--setting cpu|sentiment|gpu86m] [--engine embedded|sglang] [--nproc 1]
                                  [--steps 12] [--warmup 2] [--modes sync,async,sync+packed]

Settings:
- `cpu` (default): a ~0.6M-parameter GPT-2 policy (2 layers, width 128) with a critic and a
  random-init reward model, 32 episodes per step, 8-token queries, 16-token responses, 4 PPO
  epochs, float32.
- `sentiment`: the default sentiment recipe's shapes on the `cpu` policy: 64 episodes of
  left-padded 64-token queries (the prompts are 12 to 71 tokens) and 24-token responses, GAE, 4 epochs.
- `gpu86m`: the 86M GPT-2 (12 layers, width 768, the tiny tokenizer) with the tiny sentiment
  reward model, 32 prompts x 8 samples = 256 episodes, 64-token prompts, 48 sampled tokens at
  T=0.7, GRPO with one epoch and a KL reference, bf16 mixed precision. Meant for one GPU with
  `--engine sglang` (SGLang flags for this model via `--sglang-args`, defaults from the GPU
  check of SGLang 0.5.17).

The job runs for real (`torchrun -m rl_core.train`) in each mode (`sync+packed`: sync with
padding-free micro-batches, `algorithm.packing=true`, next to the padded `sync`); figures are averages over the
steps after `--warmup`. The floor is the bare update in plain PyTorch on the same shapes
(`update_floor_s`), measured in this process with the job's thread count, before and after the
jobs. `episodes_per_s` is the sync job's, `floor_episodes_per_s` = episodes / floor seconds;
`vs_floor` is their ratio. Prints the step-time split (rollout / inference / train / sync);
the last line is one JSON object.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
SPLIT = ("perf/rollout_s", "perf/inference_s", "perf/train_s", "perf/sync_s", "perf/step_s")
# SGLang 0.5.17 with the tiny-tokenizer GPT-2 (the GPU check of issue 10).
SGLANG_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch", "cuda_graph_backend_decode": "disabled",
               "cuda_graph_backend_prefill": "disabled", "mm_feature_transport": "cpu", "max_total_tokens": 65536}


@dataclasses.dataclass
class Setting:
    layers: int
    width: int
    heads: int
    episodes: int
    group_size: int
    query_length: int
    response_length: int
    epochs: int
    estimator: str  # gae (with a critic) or a group baseline
    mixed_precision: str | None
    reward_model: str  # "random": random-init on the policy; "tiny": the tiny sentiment reward model
    overrides: tuple[str, ...] = ()


SETTINGS = {
    "cpu": Setting(2, 128, 4, episodes=32, group_size=1, query_length=8, response_length=16, epochs=4,
                   estimator="gae", mixed_precision=None, reward_model="random",
                   overrides=("reward.truncate_after=4",)),
    "sentiment": Setting(2, 128, 4, episodes=64, group_size=1, query_length=64, response_length=24, epochs=4,
                         estimator="gae", mixed_precision=None, reward_model="random"),
    "gpu86m": Setting(12, 768, 12, episodes=256, group_size=8, query_length=64, response_length=48, epochs=1,
                      estimator="grpo", mixed_precision="bf16", reward_model="tiny",
                      overrides=("rollout.temperature=0.7",)),
}


def build_models(setting: Setting, workdir: Path) -> tuple[Path, str, Path]:
    """The bench policy (and a random-init reward model) on the tiny assets' tokenizer."""
    sys.path.insert(0, str(REPO))
    from offline.assets import count_parameters, ensure_tiny_assets, init_tiny_gpt2
    from workers.loading import init_reward_model, load_tokenizer

    paths = ensure_tiny_assets()
    tokenizer = load_tokenizer(str(paths.model_dir))
    policy_dir = workdir / "policy"
    context = max(64, setting.query_length + setting.response_length)
    policy = init_tiny_gpt2(tokenizer, n_layer=setting.layers, n_embd=setting.width, n_head=setting.heads,
                            n_positions=context)
    print(f"bench policy: {count_parameters(policy) / 1e6:.2f}M parameters, vocab {len(tokenizer)}")
    policy.save_pretrained(policy_dir)
    tokenizer.save_pretrained(policy_dir)
    if setting.reward_model == "tiny":
        return policy_dir, "tiny", paths.train_prompts
    rm_dir = workdir / "rm"
    init_reward_model(str(policy_dir), pad_token_id=tokenizer.pad_token_id).save_pretrained(rm_dir)
    tokenizer.save_pretrained(rm_dir)
    return policy_dir, str(rm_dir), paths.train_prompts


def run_mode(mode: str, args, setting: Setting, policy: Path, rm: str, prompts: Path, workdir: Path) -> dict:
    run_dir = workdir / mode
    episodes = setting.episodes * (args.steps + args.warmup)
    mode, _, packed = mode.partition("+")
    overrides = [f"model.path={policy}", f"reward.model_path={rm}", f"data.train_path={prompts}",
                 f"trainer.run_dir={run_dir}", f"trainer.total_episodes={episodes}", f"trainer.mode={mode}",
                 f"algorithm.batch_size={setting.episodes}", f"algorithm.noptepochs={setting.epochs}",
                 f"algorithm.advantage_estimator={setting.estimator}", f"algorithm.group_size={setting.group_size}",
                 f"data.max_prompt_length={setting.query_length}", f"rollout.response_length={setting.response_length}",
                 f"rollout.engine={args.engine}", "trainer.progress=false", "trainer.export_hf=false",
                 "trainer.log_samples_every=0", f"algorithm.packing={str(packed == 'packed').lower()}",
                 *setting.overrides]
    if setting.mixed_precision:
        overrides.append(f"model.mixed_precision={setting.mixed_precision}")
    if args.engine == "sglang":
        overrides += [f"rollout.sglang_args.{k}={v}" for k, v in json.loads(args.sglang_args).items()]
    argv = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train", "--config", "ppo_sentiment.yaml", *overrides]
    if args.cpus:  # the job (trainer and engine) on the same cores as the floor
        argv = ["taskset", "-c", args.cpus, *argv]
    proc = subprocess.run(argv, cwd=REPO, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][args.warmup:]
    return {key: sum(r[key] for r in rows) / len(rows) for key in rows[0] if isinstance(rows[0][key], float)}


def update_floor_s(policy_dir: Path, setting: Setting, device: str, max_tokens: int = 8192,
                   repeats: int = 5) -> list[float]:
    """Seconds of the bare update, `repeats` times: `epochs` passes over one [episodes, tokens]
    batch, in micro-batches of at most `max_tokens` tokens (as the job's default), each a
    forward, backward and Adam step of the actor (and of a critic for GAE), plain PyTorch modules,
    no framework, the job's mixed precision.

    No implementation of this update can beat it on this machine, so it bounds episodes/s from
    above even with rollout, inference and weight sync for free.
    """
    import torch

    from workers.loading import ValueModel, load_causal_lm

    tokens = setting.query_length + setting.response_length
    models = [load_causal_lm(str(policy_dir)).to(device)]
    if setting.estimator == "gae":
        models.append(ValueModel.from_pretrained(str(policy_dir)).to(device))
    optimizers = [torch.optim.Adam(m.parameters(), lr=1e-5, foreach=True) for m in models]
    ids = torch.randint(0, models[0].config.vocab_size, (setting.episodes, tokens), device=device)
    mask, positions = torch.ones_like(ids), torch.arange(tokens, device=device).expand_as(ids)
    rows = max(1, max_tokens // tokens)
    autocast = torch.autocast(device_type=torch.device(device).type, dtype=torch.bfloat16,
                              enabled=setting.mixed_precision == "bf16")
    sync = torch.cuda.synchronize if device.startswith("cuda") else (lambda: None)

    def one_update() -> None:
        for _ in range(setting.epochs):
            for model, optimizer in zip(models, optimizers):
                for start in range(0, setting.episodes, rows):
                    batch = slice(start, start + rows)
                    with autocast:
                        out = model(input_ids=ids[batch], attention_mask=mask[batch], position_ids=positions[batch])
                        out = out.logits if hasattr(out, "logits") else out
                        loss = (torch.log_softmax(out.float(), -1).mean() if out.dim() == 3 else out.float().square().mean())
                    loss.backward()
                optimizer.step()
                optimizer.zero_grad(set_to_none=True)

    one_update()  # warm-up
    times = []
    for _ in range(repeats):
        sync()
        started = time.perf_counter()
        one_update()
        sync()
        times.append(time.perf_counter() - started)
    return times


def _cpu_range(part: str) -> range:
    first, _, last = part.partition("-")
    return range(int(first), int(last or first) + 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--setting", default="cpu", choices=sorted(SETTINGS))
    parser.add_argument("--engine", default="embedded", choices=["embedded", "sglang"])
    parser.add_argument("--sglang-args", default=json.dumps(SGLANG_ARGS), help="JSON object: rollout.sglang_args")
    parser.add_argument("--nproc", type=int, default=1, help="ranks (each with its own engine)")
    parser.add_argument("--steps", type=int, default=12, help="measured steps per mode")
    parser.add_argument("--warmup", type=int, default=2, help="steps left out of the averages")
    parser.add_argument("--modes", default="sync,async,sync+packed")
    parser.add_argument("--cpus", default=None,
                        help="run the job and the floor on these cores only (taskset list, e.g. 0): on a "
                             "machine shared with other work, one core each side is steadier than two")
    args = parser.parse_args()
    if args.cpus:
        os.sched_setaffinity(0, {int(c) for part in args.cpus.split(",") for c in _cpu_range(part)})
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    setting = SETTINGS[args.setting]
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    # The job's trainer thread count on CPU: its cores split between the ranks (rl_core.ppo.threads).
    torch.set_num_threads(max(1, len(os.sched_getaffinity(0)) // args.nproc))
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores (this run: {args.cpus or 'all'}); "
          f"setting {args.setting}, "
          f"engine {args.engine}, {args.nproc} rank(s), {device}, {torch.get_num_threads()} trainer thread(s)")
    modes = args.modes.split(",")
    with tempfile.TemporaryDirectory(prefix="bench_train_") as tmp:
        workdir = Path(tmp)
        policy, rm, prompts = build_models(setting, workdir)
        floor = update_floor_s(policy, setting, device)
        results = {mode: run_mode(mode, args, setting, policy, rm, prompts, workdir) for mode in modes}
        floor += update_floor_s(policy, setting, device)
    floor_s = statistics.median(floor)
    print(f"\n{'':>22} " + " ".join(f"{mode:>12}" for mode in modes))
    for key in SPLIT + ("perf/episodes_per_s", "perf/tokens_per_s", "perf/padding_fraction"):
        print(f"{key:>22} " + " ".join(f"{results[m].get(key, float('nan')):>12.3f}" for m in modes))
    main_mode = "sync" if "sync" in results else modes[0]
    episodes_per_s = results[main_mode]["perf/episodes_per_s"]
    floor_eps = setting.episodes / floor_s
    if {"sync", "async"} <= set(results):
        print(f"async/sync steps per second: {results['sync']['perf/step_s'] / results['async']['perf/step_s']:.2f}x")
    print(f"bare update floor (plain PyTorch, same shapes, this machine, {len(floor)} runs around the jobs): "
          f"{floor_s:.3f} s per step (min {min(floor):.3f}, max {max(floor):.3f}), at most {floor_eps:.1f} episodes/s")
    print(f"{main_mode} job: {episodes_per_s:.1f} episodes/s = {episodes_per_s / floor_eps:.2f}x the floor; its update "
          f"alone takes {results[main_mode]['perf/train_s'] / floor_s:.2f}x the floor")
    summary = {
        "setting": args.setting, "engine": args.engine, "nproc": args.nproc, "device": device, "cpus": args.cpus,
        "episodes_per_s": round(episodes_per_s, 2), "floor_episodes_per_s": round(floor_eps, 1),
        "vs_floor": round(episodes_per_s / floor_eps, 3), "update_floor_s": round(floor_s, 4),
        "train_vs_floor": round(results[main_mode]["perf/train_s"] / floor_s, 3),
        "padding_fraction": round(results[main_mode]["perf/padding_fraction"], 4),
        **{f"{mode.replace('+', '_')}_{k.split('/')[1]}": round(results[mode][k], 4) for mode in modes for k in SPLIT},
        "load_average": round(os.getloadavg()[0], 2),
    }
    if {"sync", "sync+packed"} <= set(results):
        padded, packed = results["sync"], results["sync+packed"]
        print(f"padding-free micro-batches: padding {padded['perf/padding_fraction']:.1%} -> "
              f"{packed['perf/padding_fraction']:.1%} of the training grid, train phase "
              f"{padded['perf/train_s'] / packed['perf/train_s']:.2f}x, inference phase "
              f"{padded['perf/inference_s'] / packed['perf/inference_s']:.2f}x faster")
        summary["packed_padding_fraction"] = round(packed["perf/padding_fraction"], 4)
        summary["packed_train_speedup"] = round(padded["perf/train_s"] / packed["perf/train_s"], 3)
    if "async" in results:
        summary["async_episodes_per_s"] = round(results["async"]["perf/episodes_per_s"], 2)
    print(json.dumps(summary))


if __name__ == "__main__":
    main()
