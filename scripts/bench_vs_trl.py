"""The arithmetic GRPO recipe side by side with Hugging Face TRL's GRPOTrainer, in one run.

    python scripts/bench_vs_trl.py [--batches 60] [--eval-every 10] [--trl-position-ids off,on]
                                   [--nproc 1] [--project-overrides key=value ...]

Both sides train the same tiny chat policy (`tiny-arithmetic`) on the same prompts, with the
same reward functions (`rl_core.rewards.math`: exact answer 1.0 + `#### N` format 0.1) and the
recipe's hyper-parameters: 16 prompts x 8 completions per batch, 20 new tokens at temperature 1,
2 minibatches (2 optimizer steps per batch), one epoch, the recipe's lr (2e-4) constant, Adam eps 1e-5, no
gradient clipping, clip 0.2, k3 KL to the reference in the loss with coefficient 0.01, the
"seq-mean-token-mean" loss (TRL's `loss_type="grpo"`), group-normalised advantages. Each
evaluates greedy accuracy on the 200 held-out problems every `--eval-every` batches (not in the
batch times). The project runs the recipe as shipped: packed micro-batches holding each group's
prompt once (`algorithm.share_prompts`, exact; `--project-overrides algorithm.packing=false
algorithm.share_prompts=false` trains on padded rows as TRL does).

TRL runs from its own environment (`.venv-trl`, built by this script when absent: torch 2.13.0,
trl 1.16.0, and the transformers this project runs, so both use the same model code).
`--trl-position-ids`: stock TRL scores left-padded rows without position ids, which puts a
GPT-2 (absolute positions) prompt at the wrong positions; `on` adds position ids from the
attention mask to every full-sequence forward of TRL's models (what the project does, OpenAI's
detail), `off` runs TRL as shipped. Both are run by default and reported side by side.

Checked to do the same work: prompts, completions, generated tokens and optimizer steps are
counted on both sides (TRL's from what its reward functions receive). Reported per side:
median seconds per batch, wall time, held-out accuracy at each evaluation, training seconds
to reach 0.95, and the peak memory of the whole process tree (PSS: shared pages split between the
processes sharing them, so nine processes that share torch's libraries are not counted nine
times; RSS summed beside it). The project's phase split comes from its metrics. The last line is
one JSON object; `vs_trl_batches_per_s` and `vs_trl_peak_memory` compare with the TRL run with
position ids (the one that learns), or the stock one when only that ran.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TRL_VERSION = "1.16.0"
PHASES = ("perf/rollout_s", "perf/inference_s", "perf/train_s", "perf/sync_s")
TARGET_ACCURACY = 0.95


# ---------------------------------------------------------------------------------------------- memory

def _children(pid: int) -> list[int]:
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def _tree(pid: int) -> list[int]:
    pids, todo = [], [pid]
    while todo:
        p = todo.pop()
        pids.append(p)
        todo.extend(_children(p))
    return pids


def _memory_kb(pid: int) -> tuple[int, int]:
    """(PSS, RSS) of one process in kB, from the kernel's per-process summary; (0, 0) once it is gone."""
    pss = rss = 0
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    pss = int(line.split()[1])
                elif line.startswith("Rss:"):
                    rss = int(line.split()[1])
    except OSError:
        pass
    return pss, rss


class TreeMemory:
    """Samples the process tree under `pid` every `period` seconds; keeps the peaks of the sums."""

    def __init__(self, pid: int, period: float = 0.25):
        self.pid, self.period = pid, period
        self.peak_pss_kb = self.peak_rss_kb = self.peak_processes = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            pids = _tree(self.pid)
            sizes = [_memory_kb(p) for p in pids]
            self.peak_pss_kb = max(self.peak_pss_kb, sum(s[0] for s in sizes))
            self.peak_rss_kb = max(self.peak_rss_kb, sum(s[1] for s in sizes))
            self.peak_processes = max(self.peak_processes, sum(1 for s in sizes if s[1]))
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        return {"peak_pss_gb": self.peak_pss_kb / 2**20, "peak_rss_gb": self.peak_rss_kb / 2**20,
                "processes": self.peak_processes}


def run_measured(argv: list[str], log_path: Path, env: dict | None = None) -> tuple[float, dict]:
    """Run a command with its output in `log_path`; return (wall seconds, peak memory of its tree)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        memory = TreeMemory(proc.pid)
        try:
            code = proc.wait()
        except BaseException:
            os.killpg(proc.pid, 9)
            raise
        finally:
            peaks = memory.stop()
    if code != 0:
        raise SystemExit(f"{argv[0]} ... failed (exit {code}); the last lines of {log_path}:\n"
                         + "\n".join(log_path.read_text().splitlines()[-30:]))
    return time.perf_counter() - started, peaks


# ---------------------------------------------------------------------------------------------- TRL env

def ensure_trl_env(venv: Path) -> Path:
    """`venv`'s python with trl, torch 2.13.0 and this project's transformers; built on first use."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", f"import trl, math_verify; assert trl.__version__ == {TRL_VERSION!r}"]
    if python.exists() and subprocess.run(check, capture_output=True).returncode == 0:
        return python
    from importlib.metadata import version

    print(f"building {venv} (torch 2.13.0, trl {TRL_VERSION}, transformers {version('transformers')}; "
          "a few minutes, once)", flush=True)
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(python), "-m", "pip", "install", "-q"]
    subprocess.run(pip + ["torch==2.13.0"], check=True)  # the CPU wheel first: nothing pulls a CUDA build
    subprocess.run(pip + [f"trl=={TRL_VERSION}", f"transformers=={version('transformers')}",
                          f"math-verify=={version('math-verify')}"], check=True)
    subprocess.run(check, check=True)
    return python


# ---------------------------------------------------------------------------------------------- TRL side

def trl_side(args) -> None:
    """Runs inside the TRL environment: GRPOTrainer on the recipe, results as JSON in `args.out`."""
    sys.path.insert(0, str(REPO))  # for rl_core.rewards.math only (stdlib + math-verify)
    import torch
    from datasets import load_dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rl_core.rewards.math import answer_reward, format_reward

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
    train = load_dataset("json", data_files=args.train, split="train").rename_column("messages", "prompt")
    held_out = [json.loads(line) for line in Path(args.eval).read_text().splitlines()]
    work = {"completions": 0, "tokens": 0, "prompts": 0}

    def correct(prompts, completions, completion_ids, answer, **kwargs):
        work["completions"] += len(completions)
        work["tokens"] += sum(len(ids) for ids in completion_ids)
        work["prompts"] += len({json.dumps(p) for p in prompts})
        return [answer_reward(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    def formatted(prompts, completions, **kwargs):
        return [format_reward(c[0]["content"], {}, style="hash") for c in completions]

    def add_position_ids(module, positional, kwargs):
        """Position ids from the attention mask on full-sequence forwards (scoring); generation passes its own."""
        ids, mask = kwargs.get("input_ids"), kwargs.get("attention_mask")
        if kwargs.get("position_ids") is None and ids is not None and mask is not None and mask.shape == ids.shape:
            kwargs["position_ids"] = (mask.long().cumsum(-1) - 1).clamp(min=0)
        return positional, kwargs

    timeline = {"step_end": [], "eval": [], "eval_s": []}  # (optimizer step, seconds since train start)

    def evaluate(model) -> float:
        was_training = model.training
        model.eval()
        tokenizer.padding_side = "left"
        texts = [tokenizer.apply_chat_template(r["messages"], add_generation_prompt=True, tokenize=False)
                 for r in held_out]
        batch = tokenizer(texts, return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, max_new_tokens=args.response_length, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        model.train(was_training)
        return sum(answer_reward(c, r) for c, r in zip(completions, held_out)) / len(held_out)

    class Timeline(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kwargs):
            self._log_eval(0, model)
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            timeline["step_end"].append(time.perf_counter() - self.start)
            batch, per_batch = divmod(state.global_step, args.minibatches)
            if per_batch == 0 and (batch % args.eval_every == 0 or batch == args.batches):
                started = time.perf_counter()
                self._log_eval(batch, model)
                self.start += time.perf_counter() - started  # evaluation is not training time

        @staticmethod
        def _log_eval(batch, model):
            accuracy = evaluate(model)
            timeline["eval"].append((batch, accuracy))
            print(f"trl eval at batch {batch}: accuracy {accuracy:.3f}", flush=True)

    batch_size = args.prompts * args.group_size
    config = GRPOConfig(
        output_dir=args.workdir, use_cpu=True, seed=args.seed, report_to="none", save_strategy="no",
        bf16=False, gradient_checkpointing=False,  # the project trains in float32 without checkpointing
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        num_generations=args.group_size, per_device_train_batch_size=batch_size // args.minibatches,
        generation_batch_size=batch_size, gradient_accumulation_steps=1, num_iterations=1,
        max_steps=args.batches * args.minibatches, max_completion_length=args.response_length,
        temperature=1.0, top_p=1.0, top_k=0, learning_rate=args.lr, lr_scheduler_type="constant",
        warmup_steps=0, adam_epsilon=1e-5, weight_decay=0.0, max_grad_norm=0.0, beta=0.01, epsilon=0.2,
        loss_type="grpo", scale_rewards="group", reward_weights=[1.0, 0.1], mask_truncated_completions=False,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=[correct, formatted], args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Timeline()])
    if args.position_ids == "on":
        for scored in (trainer.model, trainer.ref_model):
            if scored is not None:
                scored.register_forward_pre_hook(add_position_ids, with_kwargs=True)
    trainer.train()
    ends = timeline["step_end"][args.minibatches - 1::args.minibatches]
    batch_s = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    Path(args.out).write_text(json.dumps({"batch_s": batch_s, "evals": timeline["eval"], **work,
                                          "optimizer_steps": trainer.state.global_step}))


# ---------------------------------------------------------------------------------------------- project side

def project_side(args, paths, workdir: Path) -> dict:
    run_dir = workdir / "project"
    overrides = [f"model.path={paths.model_dir}", f"data.train_path={paths.train_file}",
                 f"data.eval_path={paths.eval_file}", f"trainer.run_dir={run_dir}",
                 f"trainer.total_episodes={args.batches * args.prompts * args.group_size}",
                 f"trainer.eval_every={args.eval_every}", f"trainer.seed={args.seed}",
                 "trainer.progress=false", "trainer.export_hf=false", "trainer.log_samples_every=0",
                 *args.project_overrides]
    argv = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train", "--config", "grpo_arithmetic.yaml", *overrides]
    print(f"project: {' '.join(argv[1:])}", flush=True)
    wall_s, memory = run_measured(argv, workdir / "project.log")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    step_s = [r["perf/step_s"] for r in steps]
    phases = {k.split("/")[1][:-2]: sum(r[k] for r in steps) / sum(step_s) for k in PHASES}
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"batch_s": step_s, "evals": evals, "wall_s": wall_s, **memory, "phases": phases,
            "completions": sum(r["rollout/trajectories"] for r in steps),
            "tokens": sum(r["rollout/generated_tokens"] for r in steps),
            "prompts": sum(r["groups/count"] for r in steps),
            "optimizer_steps": sum(r["policy/optimizer_steps"] for r in steps)}


def trl_run(args, python: Path, paths, workdir: Path, position_ids: str) -> dict:
    out = workdir / f"trl-{position_ids}.json"
    argv = [str(python), str(Path(__file__).resolve()), "--side", "trl", "--model", str(paths.model_dir),
            "--train", str(paths.train_file), "--eval", str(paths.eval_file), "--out", str(out),
            "--workdir", str(workdir / f"trl-{position_ids}"), "--position-ids", position_ids,
            "--batches", str(args.batches), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
            "--threads", str(args.threads), "--lr", str(args.lr)]
    print(f"trl (position ids {position_ids}): {' '.join(argv[2:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": str(args.threads),
           "TOKENIZERS_PARALLELISM": "false"}
    wall_s, memory = run_measured(argv, workdir / f"trl-{position_ids}.log", env)
    return {**json.loads(out.read_text()), "wall_s": wall_s, **memory}


# ---------------------------------------------------------------------------------------------- report

def time_to_accuracy(result: dict) -> float | None:
    """Training seconds until the first evaluation at or above TARGET_ACCURACY (None: never)."""
    for batch, accuracy in result["evals"]:
        if accuracy >= TARGET_ACCURACY:
            return sum(result["batch_s"][:batch])
    return None


def summary(result: dict) -> dict:
    return {"median_batch_s": statistics.median(result["batch_s"]), "wall_s": result["wall_s"],
            "accuracy": {str(b): a for b, a in result["evals"]},
            "time_to_0.95_s": time_to_accuracy(result), "peak_pss_gb": result["peak_pss_gb"],
            "peak_rss_gb": result["peak_rss_gb"], "processes": result["processes"],
            "work": {k: result[k] for k in ("prompts", "completions", "tokens", "optimizer_steps")}}


def print_table(sides: dict[str, dict]) -> None:
    names = list(sides)
    rows = [("median s per batch", lambda s: f"{s['median_batch_s']:.2f}"),
            ("wall time (s)", lambda s: f"{s['wall_s']:.0f}"),
            ("held-out accuracy by batch", lambda s: " / ".join(f"{a:.3f}" for a in s["accuracy"].values())),
            ("training s to 0.95", lambda s: "never" if s["time_to_0.95_s"] is None else f"{s['time_to_0.95_s']:.0f}"),
            ("peak memory PSS / RSS (GB)", lambda s: f"{s['peak_pss_gb']:.2f} / {s['peak_rss_gb']:.2f} "
                                                    f"({s['processes']} proc)"),
            ("prompts/completions/tokens/opt steps", lambda s: "{prompts}/{completions}/{tokens}/{optimizer_steps}"
             .format(**s["work"]))]
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}} | " + " | ".join(names))
    for label, cell in rows:
        print(f"{label:{width}} | " + " | ".join(cell(sides[n]) for n in names))


def check_same_work(sides: dict[str, dict], batches: int, batch_size: int) -> None:
    for name, side in sides.items():
        work = side["work"]
        if work["completions"] != batches * batch_size:
            raise SystemExit(f"{name} generated {work['completions']} completions, not {batches * batch_size}: "
                             "the sides did not do the same work")
    steps = {name: side["work"]["optimizer_steps"] for name, side in sides.items()}
    if len(set(steps.values())) != 1:
        raise SystemExit(f"optimizer steps differ between the sides: {steps}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, default=60)
    parser.add_argument("--eval-every", type=int, default=10)
    parser.add_argument("--trl-position-ids", default="off,on", help="TRL runs: off (as shipped), on (patched)")
    # One rank by default: on 2 cores one trainer and one engine with 2 threads each do the same work as two
    # of each with 1 thread (sync mode runs them in turn), and the tree holds one torch process pair fewer.
    parser.add_argument("--nproc", type=int, default=1, help="the project's ranks (torchrun --nproc_per_node)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="TRL's torch threads")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--trl-venv", default=str(REPO / ".venv-trl"))
    parser.add_argument("--workdir", default=None, help="keep logs and runs here (default: a temporary directory)")
    parser.add_argument("--project-overrides", nargs="*", default=[], help="extra key=value for the project's job")
    parser.add_argument("--skip-project", action="store_true", help=argparse.SUPPRESS)
    # The TRL side, run by this script inside the TRL environment.
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    for name in ("--model", "--train", "--eval", "--out", "--position-ids"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    parser.add_argument("--prompts", type=int, default=16, help=argparse.SUPPRESS)
    parser.add_argument("--group-size", type=int, default=8, help=argparse.SUPPRESS)
    parser.add_argument("--minibatches", type=int, default=2, help=argparse.SUPPRESS)
    parser.add_argument("--response-length", type=int, default=20, help=argparse.SUPPRESS)
    parser.add_argument("--lr", type=float, default=None, help=argparse.SUPPRESS)  # None: the recipe's
    args = parser.parse_args()
    if args.side == "trl":
        return trl_side(args)

    sys.path.insert(0, str(REPO))
    from rl_core.config import load_config
    from rl_core.ppo.config import PPOConfig
    from rl_core.tiny.arithmetic import ensure_arithmetic_assets

    if args.lr is None:  # TRL's learning rate is the one the project side runs with
        args.lr = load_config("grpo_arithmetic.yaml", [], PPOConfig).algorithm.lr
    paths = ensure_arithmetic_assets(log=print)
    python = ensure_trl_env(Path(args.trl_venv))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    batch_size = args.prompts * args.group_size
    sides, project = {}, None
    for flag in [f for f in args.trl_position_ids.split(",") if f]:
        sides[f"TRL {TRL_VERSION} position ids {flag}"] = summary(trl_run(args, python, paths, workdir, flag))
    if not args.skip_project:
        project = project_side(args, paths, workdir)
        sides = {"this project": summary(project), **sides}
    check_same_work(sides, args.batches, batch_size)
    print_table(sides)
    if project is not None:
        print("project phase split: " + ", ".join(f"{k} {v:.0%}" for k, v in project["phases"].items()))
    reference = sides.get(f"TRL {TRL_VERSION} position ids on") or sides.get(f"TRL {TRL_VERSION} position ids off")
    out = {"sides": sides, "workdir": str(workdir)}
    if project is not None and reference is not None:
        mine = sides["this project"]
        final = str(args.batches)
        out.update({"vs_trl_batches_per_s": reference["median_batch_s"] / mine["median_batch_s"],
                    "vs_trl_peak_memory": mine["peak_pss_gb"] / reference["peak_pss_gb"],
                    "accuracy_final": mine["accuracy"].get(final), "trl_accuracy_final": reference["accuracy"].get(final),
                    "phases": project["phases"]})
    print(json.dumps(out))


if __name__ == "__main__":
    main()
