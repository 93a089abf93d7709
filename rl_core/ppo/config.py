"""The PPO job's configuration: one dataclass per YAML section, defaults = OpenAI's sentiment recipe.

Loaded by `rl_core.config.load_config`, which checks keys, types and allowed values; the
cross-field rules that would otherwise fail minutes into a run are in `validate`.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_core.config import TrainerConfig, choice, require
from rl_core.ppo.algorithms import GROUP_KINDS, KL_KINDS, LOSS_AGG_MODES
from rl_core.optim import OPTIMIZER_NAMES
from workers.router import POLICIES

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ModelConfig:
    # "tiny" = the offline assets (rl_core/tiny); otherwise any HF causal LM path or hub name.
    path: str = "tiny"
    tokenizer_path: Optional[str] = None
    dtype: str = choice("float32", DTYPES)  # master weights; under mixed precision they stay fp32
    mixed_precision: Optional[str] = choice(None, (None, "bf16", "fp16"))  # GPU only
    cpu_offload: bool = False  # FSDP2 parameter/optimizer offload (GPU only)
    gradient_checkpointing: bool = False


@dataclass
class RewardConfig:
    # "tiny" = the offline sentiment reward model; otherwise an AutoModelForSequenceClassification
    # checkpoint; null = no learned reward (the env's rewards only).
    model_path: Optional[str] = "tiny"
    # OpenAI rejection sampling: cut at the first truncate_token at/after truncate_after, else fixed penalty.
    truncate_token: Optional[str] = "."
    truncate_after: int = 16
    penalty: float = -1.0


@dataclass
class DataConfig:
    # "tiny" = the offline prompt set; otherwise a local json/jsonl/csv/parquet file or hub name.
    train_path: str = "tiny"
    text_key: str = "text"
    query_length: int = 64
    start_text: Optional[str] = None
    end_text: Optional[str] = None
    on_malformed: str = choice("error", ("error", "skip"))


@dataclass
class RolloutConfig:
    engine: str = choice("embedded", ("embedded", "sglang"))
    response_length: int = 24
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = True  # OpenAI: fixed-length responses, keep sampling past EOS
    max_turns: int = 1
    concurrency: int = 256
    router_policy: str = choice("cache_aware", POLICIES)
    engine_timeout_s: float = 300.0
    engine_max_batch_size: int = 64
    dtype: Optional[str] = choice(None, (None, *DTYPES))  # engine weights; null = the training compute dtype
    # Sync mode frees the engine's KV cache and weights while the trainer runs (GPU colocation);
    # false keeps them resident when memory allows (faster, no resume).
    release_memory: bool = True
    weight_bucket_mb: int = 512  # weight push: tensors travel in flattened buckets of this size
    # After each push the engine's logprobs of a probe sequence must match the trainer's within this
    # mean absolute gap; null = by engine dtype (see workers/engines/weights.py).
    weight_check_tolerance: Optional[float] = None
    mem_fraction_static: float = 0.6  # SGLang KV/weights share of the GPU when colocated
    tp_size: int = 1
    sglang_args: dict = field(default_factory=dict)  # any further SGLang ServerArgs, e.g. {attention_backend: triton}
    multi_node_host: Optional[str] = None  # address engines bind to when nnodes > 1


@dataclass
class EnvConfig:
    cls: str = "envs.sentiment:SentimentEnv"
    kwargs: dict = field(default_factory=dict)
    num_envs: int = 64
    step_timeout_s: float = 60.0
    max_failed_ratio: float = 0.1
    thread_pool_size: int = 4


@dataclass
class KLConfig:
    init_coef: float = 0.15
    adaptive: bool = True
    target: float = 6.0
    horizon: int = 10000
    estimator: str = choice("k1", KL_KINDS)


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = choice("gae", ("gae", *GROUP_KINDS))
    group_size: int = 1
    filter_zero_variance_groups: bool = False
    batch_size: int = 64  # episodes per step
    nminibatches: int = 1
    noptepochs: int = 4
    max_tokens_per_device: int = 8192
    lr: float = 1.41e-5
    critic_lr: Optional[float] = None
    optimizer: str = choice("adam", OPTIMIZER_NAMES)
    adam_eps: float = 1e-5
    weight_decay: float = 0.0
    max_grad_norm: Optional[float] = None
    anneal_lr: bool = True
    gamma: float = 1.0
    lam: float = 0.95
    cliprange: float = 0.2
    cliprange_value: float = 0.2
    vf_coef: float = 0.1
    entropy_coef: float = 0.0
    whiten_rewards: bool = True
    loss_agg: str = choice("token-mean", LOSS_AGG_MODES)
    behaviour_is_cap: float = 2.0  # truncated importance weight cap for async off-policy correction
    kl: KLConfig = field(default_factory=KLConfig)


@dataclass
class AsyncConfig:
    max_staleness: int = 1
    partial_rollout: bool = False
    queue_batches: int = 2


@dataclass
class PPOTrainerConfig(TrainerConfig):
    run_dir: str = "runs/ppo_sentiment"
    mode: str = choice("sync", ("sync", "async"))
    total_episodes: int = 4096
    save_every: int = 0
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 keeps all
    resume: str = "never"  # never | auto | <checkpoint dir>
    log_samples_every: int = 10
    export_hf: bool = True


@dataclass
class PPOConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: PPOTrainerConfig = field(default_factory=PPOTrainerConfig)


def engine_dtype(cfg: PPOConfig) -> str:
    """The dtype engines hold weights in: rollout.dtype, else the training compute dtype."""
    if cfg.rollout.dtype is not None:
        return cfg.rollout.dtype
    return {"bf16": "bfloat16", "fp16": "float16"}.get(cfg.model.mixed_precision, cfg.model.dtype)


def max_sequence_length(cfg: PPOConfig) -> int:
    """The longest query + responses one sequence can reach."""
    return cfg.data.query_length + cfg.rollout.response_length * cfg.rollout.max_turns


def validate(cfg: PPOConfig) -> None:
    """Cross-field rules: everything that would otherwise fail minutes into a run."""
    algo, ro, trainer = cfg.algorithm, cfg.rollout, cfg.trainer
    require(trainer.seed >= 0, f"config key 'trainer.seed' must be >= 0, got {trainer.seed}")
    require(algo.batch_size > 0, f"config key 'algorithm.batch_size' must be > 0, got {algo.batch_size}")
    require(algo.nminibatches > 0 and algo.batch_size % algo.nminibatches == 0,
            f"algorithm.batch_size={algo.batch_size} is not divisible into algorithm.nminibatches="
            f"{algo.nminibatches} minibatches; pick a batch_size that is a multiple of nminibatches")
    require(algo.group_size >= 1 and algo.batch_size % algo.group_size == 0,
            f"algorithm.batch_size={algo.batch_size} is not a multiple of algorithm.group_size={algo.group_size}")
    require(algo.advantage_estimator == "gae" or algo.group_size >= 2,
            f"algorithm.advantage_estimator={algo.advantage_estimator} needs algorithm.group_size >= 2 "
            "(several responses per prompt to form a baseline)")
    require(algo.noptepochs >= 1, f"config key 'algorithm.noptepochs' must be >= 1, got {algo.noptepochs}")
    require(algo.max_tokens_per_device > 0, "config key 'algorithm.max_tokens_per_device' must be > 0")
    require(0.0 <= algo.gamma <= 1.0 and 0.0 <= algo.lam <= 1.0, "algorithm.gamma and algorithm.lam must be in [0, 1]")
    require(algo.lr > 0, f"config key 'algorithm.lr' must be > 0, got {algo.lr}")
    require(algo.kl.horizon > 0, "config key 'algorithm.kl.horizon' must be > 0")
    require(algo.behaviour_is_cap >= 1.0, "config key 'algorithm.behaviour_is_cap' must be >= 1")
    require(ro.response_length > 0, "config key 'rollout.response_length' must be > 0")
    require(ro.temperature > 0, "config key 'rollout.temperature' must be > 0 (logprobs divide logits by it)")
    require(0.0 < ro.top_p <= 1.0, f"config key 'rollout.top_p' must be in (0, 1], got {ro.top_p}")
    require(ro.max_turns >= 1, "config key 'rollout.max_turns' must be >= 1")
    require(0.0 < ro.mem_fraction_static < 1.0,
            f"rollout.mem_fraction_static={ro.mem_fraction_static} cannot fit colocated with training; use (0, 1)")
    require(ro.tp_size >= 1, "config key 'rollout.tp_size' must be >= 1")
    require(ro.weight_bucket_mb >= 1, "config key 'rollout.weight_bucket_mb' must be >= 1")
    require(ro.weight_check_tolerance is None or ro.weight_check_tolerance > 0,
            "config key 'rollout.weight_check_tolerance' must be > 0 or null (by engine dtype)")
    require(not ro.sglang_args or ro.engine == "sglang",
            "rollout.sglang_args is set but rollout.engine is not sglang; drop it or set rollout.engine=sglang")
    require(cfg.data.query_length > 0, "config key 'data.query_length' must be > 0")
    require(cfg.env.num_envs >= 1, "config key 'env.num_envs' must be >= 1")
    require(0.0 <= cfg.env.max_failed_ratio <= 1.0, "config key 'env.max_failed_ratio' must be in [0, 1]")
    require(cfg.env.step_timeout_s > 0, "config key 'env.step_timeout_s' must be > 0")
    require(trainer.total_episodes >= algo.batch_size,
            f"trainer.total_episodes={trainer.total_episodes} is smaller than one batch "
            f"(algorithm.batch_size={algo.batch_size})")
    require(cfg.async_.max_staleness >= 0, "config key 'async.max_staleness' must be >= 0")
    require(trainer.save_every >= 0, "config key 'trainer.save_every' must be >= 0")
    require(trainer.keep_last >= 0, "config key 'trainer.keep_last' must be >= 0 (0 keeps every checkpoint)")
    require(trainer.collective_timeout_s > 0, "config key 'trainer.collective_timeout_s' must be > 0")
    require(cfg.reward.truncate_after >= 0, "config key 'reward.truncate_after' must be >= 0")
    longest = max_sequence_length(cfg)
    require(longest <= algo.max_tokens_per_device,
            f"one sequence can reach {longest} tokens (data.query_length + rollout.response_length * "
            f"rollout.max_turns) but algorithm.max_tokens_per_device={algo.max_tokens_per_device}; raise it")


def check_context_length(cfg: PPOConfig, model_max_positions: int | None) -> None:
    """The model's context must hold the longest query+response; checked once the model config is known."""
    if model_max_positions is None:
        return
    longest = max_sequence_length(cfg)
    require(longest <= model_max_positions,
            f"data.query_length + rollout.response_length * rollout.max_turns = {longest} tokens exceeds "
            f"the model's context of {model_max_positions} (model.path={cfg.model.path}); shorten "
            "data.query_length or rollout.response_length")
