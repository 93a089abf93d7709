"""The PPO job's configuration: one dataclass per YAML section, defaults = OpenAI's sentiment recipe.

Loaded by `rl_core.config.load_config`, which checks keys, types and allowed values; the
cross-field rules that would otherwise fail minutes into a run are in `rl_core/ppo/validation.py`. Below the
schema: the settings the job derives from it (sampling parameters, dtypes, the old-logprobs rule).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Optional

from rl_core.config import (DTYPES, LoraSettings, ModelRunConfig, OptimizerConfig, TrainerConfig, choice,
                            validate_checkpoint_keys)
from rl_core.data import LONG_PROMPT_POLICIES
from rl_core.ppo.algorithms import GROUP_KINDS, KL_KINDS, LOSS_AGG_MODES, ROLLOUT_CORRECTIONS
from rl_core.ppo.turns import TURN_ADVANTAGES
from rl_core.rollout.rollout import RolloutSettings
from rl_core.optim import OPTIMIZER_NAMES
from workers.router import POLICIES

RELEASE_CHOICES = ("auto", "always", "never", True, False)


@dataclass
class ModelConfig(ModelRunConfig):
    # "tiny" = the offline assets (assets/, rl_core/offline_names.py); otherwise any HF causal LM path or hub name.
    path: str = "tiny"
    tokenizer_path: Optional[str] = None  # null = model.path
    # LoRA for the actor (the critic trains every weight): the engines get the merged weights on each
    # push, the reference is the actor with its adapters off, export writes the merged model or the adapter.
    # Actor, reference, critic and reward model all run with the `ModelRunConfig` keys (attention kernel,
    # sequence parallelism): they run the same micro-batches.
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class RewardConfig:
    # "tiny" = the offline sentiment reward model; otherwise an AutoModelForSequenceClassification
    # checkpoint; null = no learned reward (the env's rewards only).
    model_path: Optional[str] = "tiny"
    # OpenAI rejection sampling: cut at the first truncate_token at/after truncate_after, else fixed penalty.
    truncate_token: Optional[str] = "."
    truncate_after: int = 16  # the first token index at which truncate_token may cut
    penalty: float = -1.0  # the fixed score of a response with no truncate_token at/after truncate_after
    # Reward functions by import path: {name: {fn: "pkg.module:callable", weight: 1.0, kwargs: {...}}};
    # each gets (completion text, dataset row), and the conversation if it declares messages / tool_calls,
    # and returns a number (see rl_core/rewards).
    fns: dict = field(default_factory=dict)
    fn_timeout_s: float = 30.0  # each reward function call's time limit; past it the trajectory fails
    # Worker processes for sync reward functions (each call on a main thread, where signal-based
    # timeouts such as math-verify's work); 0 = a thread pool in rank 0 (for functions that cannot pickle).
    fn_processes: int = 2
    # A response cut by the length limit (finish reason "length") gets this score instead; null = no penalty.
    truncated_penalty: Optional[float] = None


@dataclass
class DataConfig:
    # "tiny" = the offline prompt set; otherwise a local json/jsonl/csv/parquet file or hub name.
    train_path: str = "tiny"
    train_split: str = "train"  # hub datasets only
    hub_config: Optional[str] = None  # hub datasets only: the configuration, e.g. "main" for openai/gsm8k
    # Held-out prompts evaluated at step 0, every eval.every steps and at the end; null = no eval.
    eval_path: Optional[str] = None
    eval_split: str = "test"  # hub datasets only: the split of data.eval_path
    prompt_key: Optional[str] = None  # the prompt column; null = the first of messages, prompt, text
    # Chat messages always go through the tokenizer's chat template; true also wraps plain text as a user turn.
    apply_chat_template: Optional[bool] = None
    system_prompt: Optional[str] = None  # a system turn put before each prompt rendered with the chat template
    max_prompt_length: int = 256  # tokens
    # Longer prompts: skip (and count), error, or truncate (OpenAI's fixed-length queries, sentiment recipe).
    on_long_prompt: str = choice("skip", LONG_PROMPT_POLICIES)
    start_text: Optional[str] = None  # OpenAI query mode only (on_long_prompt=truncate)
    end_text: Optional[str] = None  # OpenAI query mode only: the query ends at this text
    # a malformed prompt row stops the job, or is skipped and counted
    on_malformed: str = choice("error", ("error", "skip"))


@dataclass
class RolloutConfig:
    engine: str = choice("embedded", ("embedded", "sglang"))  # the inference engine each rank runs (docs/engines.md)
    response_length: int = 24  # max new tokens per assistant turn
    temperature: float = 0.7  # sampling temperature; the trainer's logprobs use the same one
    top_k: int = 0  # 0 = no top-k cut
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    ignore_eos: bool = False  # true = OpenAI's fixed-length responses, sampling past EOS (sentiment recipe)
    stop_token_ids: list = field(default_factory=list)  # besides EOS
    max_turns: int = 1  # assistant turns per episode (multi-turn envs and tools)
    concurrency: int = 256  # trajectories in flight at once on rank 0
    router_policy: str = choice("cache_aware", POLICIES)  # sglang-router's load-balancing policy
    engine_timeout_s: float = 300.0  # each engine or router HTTP call's time limit
    # The embedded engine decodes at most this many requests together (SGLang sizes its own batches from
    # GPU memory): a batch's requests beyond it wait for a whole second wave of decode steps.
    engine_max_batch_size: int = 256
    dtype: Optional[str] = choice(None, (None, *DTYPES))  # engine weights; null = the training compute dtype
    # Sync mode: whether engines free their KV cache and weights while the trainer runs. auto: only when the
    # memory plan (workers/memory_plan.py) says trainer and engine do not fit on the device together (on CPU
    # the device is the machine's memory shared by the node's ranks); always / never (true / false, the
    # old boolean, still read as always / never).
    release_memory: Any = choice("auto", RELEASE_CHOICES)
    # The engine's KV pool in tokens (SGLang's max_total_tokens); null = the memory plan's: the rollout's
    # sequences in flight at their longest, capped by memory. The embedded engine sizes its cache per batch
    # (engine_max_batch_size) and ignores it.
    kv_tokens: Optional[int] = None
    # The memory one rank and its engine share, for the plan; null = the GPU's total, or on CPU the
    # machine's divided by the node's ranks. Set it when the device is shared with other work.
    device_memory_gb: Optional[float] = None
    weight_bucket_mb: int = 512  # weight push: tensors travel in flattened buckets of this size
    # After each push the engine's logprobs of a probe sequence must match the trainer's within this
    # mean absolute gap; null = by engine dtype (see workers/engines/weights.py).
    weight_check_tolerance: Optional[float] = None
    mem_fraction_static: float = 0.6  # SGLang KV/weights share of the GPU when colocated
    tp_size: int = 1  # GPUs per SGLang engine (tensor parallelism)
    sglang_args: dict = field(default_factory=dict)  # any further SGLang ServerArgs, e.g. {attention_backend: triton}
    # The Python that runs each SGLang server; null = the job's own. On CPU: .venv-sglang/bin/python
    # (scripts/setup_sglang_cpu.sh builds it), so the job's environment needs no sglang.
    sglang_python: Optional[str] = None
    multi_node_host: Optional[str] = None  # address engines bind to when nnodes > 1
    # Several nodes: a node whose engine answers no /health for this long is lost, and every node stops (a cut
    # link closes no connection that would say so). Shorter notices sooner; too short mistakes a busy node.
    node_timeout_s: float = 30.0
    # A sampling seed per sample, so a resumed run samples what the uninterrupted one would have; a seeded
    # sample is one /generate call, an unseeded group one call with n = group_size. null = where the engines
    # honour seeds: the embedded engine, SGLang only with enable_deterministic_inference (else it ignores them).
    seeded: Optional[bool] = None

    @property
    def samples_seeded(self) -> bool:
        if self.seeded is not None:
            return self.seeded
        return self.engine == "embedded" or bool(self.sglang_args.get("enable_deterministic_inference"))


@dataclass
class EnvConfig:
    cls: str = "envs.sentiment:SentimentEnv"  # the env class by import path (docs/envs.md)
    kwargs: dict = field(default_factory=dict)  # keyword arguments for the env class
    num_envs: int = 64  # size of the env pool; a trajectory leases one env while it runs
    step_timeout_s: float = 60.0  # each reset/step call's time limit; past it the trajectory fails
    max_failed_ratio: float = 0.1  # more failed trajectories than this share of a batch stop the job
    thread_pool_size: int = 4  # threads for blocking (SyncEnv) envs and tools
    # Conversation envs (envs/chat.py): tool functions by import path ("pkg.module:function") and MCP
    # servers ({mcp: {command: [...]}} or {mcp: {url: ...}}, envs/mcp_tools.py), the parser of the model's
    # calls (a format in envs/tool_parsers.py, "auto": the tokenizer's response template, or
    # "pkg.module:function"), and each call's time limit.
    tools: list = field(default_factory=list)
    tool_parser: str = "hermes"  # the model's tool calls from its text: a format, auto or "pkg.module:function"
    reasoning_parser: str = "none"  # none | think (<think>...</think>) | gpt_oss: calls in reasoning never run
    chat_template_kwargs: dict = field(default_factory=dict)  # to every rendering (dataset prompts too), e.g. {enable_thinking: false}
    tool_timeout_s: float = 30.0  # each tool call's time limit; keep it below env.step_timeout_s
    tool_concurrency: int = 8  # tool calls running at once in the whole job (each python call is a sandbox)
    max_result_tokens: Optional[int] = None  # each tool message cut to this many tokens (null: whole)


@dataclass
class KLConfig:
    init_coef: float = 0.15  # the KL coefficient (the adaptive controller's start); 0 = no reference model
    adaptive: bool = True  # OpenAI's adaptive KL controller, steering the KL towards target
    target: float = 6.0  # adaptive: the KL (nats per response) the controller steers to
    horizon: int = 10000  # adaptive: the controller's horizon in episodes
    estimator: str = choice("k1", KL_KINDS)  # Schulman's KL estimators; GRPO uses k3 in the loss
    # Where the KL to the reference goes: per-token in the reward (OpenAI, RLOO) or in the policy loss (GRPO, use k3).
    placement: str = choice("reward", ("reward", "loss"))


@dataclass
class RolloutCorrectionConfig:
    mode: str = choice("tis", ROLLOUT_CORRECTIONS)  # each token's loss weight for the engine gap (docs/walkthrough.md)
    is_cap: float = 2.0  # tis: min(pi_old / pi_behaviour, is_cap)
    mask_low: float = 0.5  # mis-*: keep tokens (rows) whose ratio is within [mask_low, mask_high]
    mask_high: float = 2.0  # mis-*: the band's upper bound


@dataclass
class AlgorithmConfig(OptimizerConfig):
    """The PPO family's algorithm; its optimizer keys are every job's (`rl_core.config.OptimizerConfig`), with
    OpenAI's defaults: Adam, epsilon 1e-5, no gradient clipping."""
    # gae = PPO with a critic; grpo, rloo, reinforce = group baselines, no critic
    advantage_estimator: str = choice("gae", ("gae", *GROUP_KINDS))
    group_size: int = 1  # responses per prompt (group baselines need > 1)
    # A group short of members (a failed or stale-dropped response): keep the rest (baseline from them,
    # a lone response gets advantage 0) or drop the whole group.
    incomplete_groups: str = choice("keep", ("keep", "drop"))
    normalize_group_std: bool = True  # GRPO's division by the group std; false = Dr. GRPO
    # Multi-turn credit (group estimators): trajectory = A on every turn; discounted = turn k of T gets turn_gamma^(T-1-k) A
    turn_advantage: str = choice("trajectory", TURN_ADVANTAGES)
    turn_gamma: float = 1.0  # turn_advantage=discounted: the factor per turn before the last, in (0, 1]
    whiten_advantages: bool = True  # OpenAI: whiten over the batch; GRPO-family recipes turn it off
    # DAPO dynamic sampling: drop groups whose rewards are all equal and sample more prompts until the
    # batch is full; at most filter_max_groups_factor x the groups a batch needs are launched per step.
    filter_zero_variance_groups: bool = False
    filter_max_groups_factor: float = 4.0  # dynamic sampling: groups launched per step, at most, x those needed
    batch_size: int = 64  # episodes per step
    nminibatches: int = 1  # minibatches per PPO epoch (one optimizer step each)
    noptepochs: int = 4  # PPO epochs over each batch
    max_tokens_per_device: int = 8192  # per micro-batch: its padded size, or with packing its real tokens
    # Padding-free micro-batches (workers.layout.pack): the model runs on the sequences' real tokens
    # back to back, attention kept inside each; the same losses and gradients as padded rows.
    packing: bool = False
    # With packing: the sequences of a micro-batch with the same prompt (a GRPO group) hold it once and
    # attend to that copy, so the prompt is computed once, not group_size times; the same losses and
    # gradients. Each group becomes one packed row as long as its prompt and all its responses, so
    # attention (quadratic in a row's length) grows with long responses: best for short ones.
    share_prompts: bool = False
    lr: float = 1.41e-5  # the actor's learning rate
    critic_lr: Optional[float] = None  # null = algorithm.lr
    optimizer: str = choice("adam", OPTIMIZER_NAMES)  # tf_adam = TensorFlow's epsilon placement (OpenAI's)
    adam_eps: float = 1e-5  # Adam epsilon
    max_grad_norm: Optional[float] = None  # gradient clipping; null = none
    anneal_lr: bool = True  # learning rate annealed linearly to zero over the run
    gamma: float = 1.0  # GAE discount
    lam: float = 0.95  # GAE lambda
    cliprange: float = 0.2  # PPO ratio clip range
    cliprange_low: Optional[float] = None  # ratio floor 1 - cliprange_low; null = cliprange
    cliprange_high: Optional[float] = None  # DAPO clip-higher: ratio ceiling 1 + cliprange_high; null = cliprange_low
    importance_ratio: str = choice("token", ("token", "sequence"))  # sequence = GSPO
    # DAPO overlong shaping: the last overlong_buffer tokens before rollout.response_length cost up to
    # overlong_penalty_factor reward, linearly; 0 = off.
    overlong_buffer: int = 0
    overlong_penalty_factor: float = 1.0  # the overlong penalty at rollout.response_length tokens
    cliprange_value: float = 0.2  # clip range of the value loss
    vf_coef: float = 0.1  # weight of the value loss
    entropy_coef: float = 0.0  # weight of the entropy bonus
    whiten_rewards: bool = True  # OpenAI: whiten rewards (without shifting the mean) before GAE
    loss_agg: str = choice("token-mean", LOSS_AGG_MODES)  # how token losses become a loss (docs/grpo.md)
    # Tokens are sampled by the engine (pi_behaviour) but the loss is taken against the trainer's pi_old:
    # stale engines (async) and different kernels or precision (sync too) make them differ. See docs/walkthrough.md.
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    # pi_old: "trainer" recomputes it (a forward pass over the batch); "engine" takes the engine's sampling
    # logprobs; "auto" takes the engine's in sync mode when the last push's probe gap (max over ranks) is at
    # most old_logprobs_max_gap, so the recomputation would only reproduce them, else recomputes.
    old_logprobs: str = choice("auto", ("auto", "trainer", "engine"))
    # Nats of mean probe gap; null = by the precision in use (OLD_LOGPROBS_MAX_GAP): 1e-3 where engine and
    # trainer both compute in float32, 1e-2 where either computes in bf16 or fp16, whose own rounding gives
    # gaps of that order between any two computations (a ratio error of 1%, far inside the clip range).
    old_logprobs_max_gap: Optional[float] = None
    kl: KLConfig = field(default_factory=KLConfig)


@dataclass
class EvalConfig:
    """Sampling on the held-out prompts (data.eval_path): greedy once per prompt by default."""
    every: int = 0  # steps between evaluations (besides step 0 and the end); 0 = only those two
    n: int = 1  # samples per prompt; pass@k for k = 1, 2, 4, ... <= n
    temperature: float = 0.0  # 0 = greedy
    top_p: float = 1.0  # nucleus sampling; 1.0 = off
    response_length: Optional[int] = None  # null = rollout.response_length
    max_prompts: Optional[int] = None  # null = every eval prompt
    # The reward function whose value > 0 marks a correct answer (eval/accuracy); null = the first in reward.fns.
    accuracy_fn: Optional[str] = None
    log_samples: int = 8  # rows of the eval samples table


@dataclass
class AsyncConfig:
    max_staleness: int = 1  # async: a trajectory is used only while the policy is at most this many versions newer
    # async: engines pause in place for a push and their requests continue on the new weights
    partial_rollout: bool = False
    queue_batches: int = 2  # async: generated batches waiting for the trainer, at most
    # async: batches generating at once. 2 keeps the engines decoding two batches in one batch where a decode
    # step costs less than twice one batch's (small models on GPUs); each still starts within max_staleness,
    # and env.num_envs and rollout.concurrency bound the sequences in flight.
    batches_in_flight: int = 1
    # async: rank 0's rollout (its HTTP client, envs and reward functions) runs in a process of its own, so its
    # Python does not take turns with the trainer's on one GIL; false runs it in a thread of rank 0
    rollout_process: bool = True


@dataclass
class DistillConfig:
    """On-policy distillation (docs/algorithms.md): a frozen teacher scores every sampled token, and each
    token's advantage gets `coef * (log pi_teacher - log pi_student)`, the negative reverse-KL estimate."""
    # The teacher, any model path the job accepts (a local teacher, FSDP2-sharded like the reference on
    # every rank); null with teacher_url null = no distillation.
    teacher_path: Optional[str] = None
    # Or a server the user runs (SGLang's HTTP API) serving the teacher, too big to sit beside the trainer:
    # rank 0 asks it for the prompt logprobs of every sequence (`/generate`, max_new_tokens 0).
    teacher_url: Optional[str] = None
    coef: float = 1.0  # weight of the per-token term
    reward_coef: float = 1.0  # weight of the task reward's advantage; 0 = pure distillation
    teacher_timeout_s: float = 300.0  # teacher_url: each request's time limit

    @property
    def enabled(self) -> bool:
        return self.teacher_path is not None or self.teacher_url is not None


@dataclass
class PPOTrainerConfig(TrainerConfig):
    run_dir: str = "runs/ppo_sentiment"
    mode: str = choice("sync", ("sync", "async"))  # sync = on-policy; async = generation overlaps training (async.*)
    total_episodes: int = 4096  # episodes of the run; steps = total_episodes / algorithm.batch_size
    save_every: int = 0  # steps between checkpoints; 0 = none
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 keeps all
    resume: str = "never"  # never | auto | <checkpoint dir>
    # A checkpoint that cannot be written (disk full, permissions): stop the job, or say so and train on.
    on_checkpoint_error: str = choice("stop", ("stop", "continue"))
    log_samples_every: int = 10  # steps between sample tables in samples.jsonl; 0 = none
    export_hf: bool = True  # <run_dir>/final in Hugging Face format
    # Steps (as logged, 1..total) traced by torch.profiler into <run_dir>/profile/step_N/rankR.pt.trace.json
    # (rl_core/profiling.py): CPU (and CUDA) activity, the phases and engine HTTP calls as named ranges.
    profile_steps: list = field(default_factory=list)

    def validate(self) -> None:
        super().validate()
        validate_checkpoint_keys(self.save_every, self.keep_last)


@dataclass
class PPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    distill: DistillConfig = field(default_factory=DistillConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)


def sampling_params(ro: RolloutConfig, **overrides) -> dict:
    """SGLang `sampling_params` of the rollout section (training); evaluation overrides a few keys."""
    params = {"max_new_tokens": ro.response_length, "temperature": ro.temperature, "top_p": ro.top_p,
              "top_k": ro.top_k if ro.top_k > 0 else -1, "ignore_eos": ro.ignore_eos}
    if ro.stop_token_ids:
        params["stop_token_ids"] = [int(t) for t in ro.stop_token_ids]
    return {**params, **overrides}


def rollout_settings(ro: RolloutConfig, max_positions: int | None, progress: bool) -> RolloutSettings:
    """The rollout section as the rollout's frozen settings; `max_positions`: the policy's context."""
    return RolloutSettings(sampling_params(ro), max_turns=ro.max_turns, concurrency=ro.concurrency,
                           max_total_tokens=max_positions, progress=progress, engine_timeout_s=ro.engine_timeout_s)


def release_mode(ro: RolloutConfig) -> str:
    """rollout.release_memory as auto | always | never (the old booleans: true = always, false = never)."""
    value = ro.release_memory
    return value if isinstance(value, str) else ("always" if value else "never")


OLD_LOGPROBS_MAX_GAP = {"float32": 1e-3, "bfloat16": 1e-2, "float16": 1e-2}


def engine_old_logprobs_max_gap(cfg: PPOConfig) -> float:
    """`algorithm.old_logprobs` as a bound on the last push's probe gap (max over ranks): at or under it, a
    step's pi_old is the engine's sampling logprobs (inf: always, -inf: never). In sync mode the batch was
    sampled by the weights just pushed, so when the probe shows engine and trainer agree, recomputing pi_old is
    a forward pass that reproduces the engine's numbers; otherwise (async: stale engines; a gap from precision
    or kernels) the trainer recomputes and rollout_correction weighs the gap."""
    algo = cfg.algorithm
    if algo.old_logprobs == "auto":
        return old_logprobs_max_gap(cfg) if cfg.trainer.mode == "sync" else -math.inf
    return math.inf if algo.old_logprobs == "engine" else -math.inf


def old_logprobs_max_gap(cfg: PPOConfig) -> float:
    """`algorithm.old_logprobs_max_gap`, or the gap the coarser of the engine's and the trainer's compute
    precisions allows."""
    if cfg.algorithm.old_logprobs_max_gap is not None:
        return cfg.algorithm.old_logprobs_max_gap
    return max(OLD_LOGPROBS_MAX_GAP[dtype] for dtype in (engine_dtype(cfg), trainer_compute_dtype(cfg)))


def trainer_compute_dtype(cfg: PPOConfig) -> str:
    """The dtype the trainer's forward runs in: the mixed-precision one, else the weights'."""
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.model.mixed_precision, cfg.model.dtype)


def engine_dtype(cfg: PPOConfig) -> str:
    """The dtype engines hold weights in: rollout.dtype, else the training compute dtype."""
    return cfg.rollout.dtype if cfg.rollout.dtype is not None else trainer_compute_dtype(cfg)


def max_sequence_length(cfg: PPOConfig) -> int:
    """The longest query + responses one sequence can reach."""
    response_length = max(cfg.rollout.response_length, cfg.eval.response_length or 0)
    return cfg.data.max_prompt_length + response_length * cfg.rollout.max_turns
