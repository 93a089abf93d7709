"""Typed job configuration: YAML recipe + `key=value` overrides -> validated dataclasses.

OmegaConf reads the YAML and the dotlist overrides; the schema below is plain dataclasses, and
`load_config` checks every key, type and cross-field rule *before* any process group or engine
starts, so a typo costs one line of output instead of a crashed job.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"


class ConfigError(ValueError):
    """A configuration problem, phrased for the user: the key, what is wrong, how to fix it."""


@dataclass
class ModelConfig:
    # "tiny" = the offline assets built by rl_core.assets; otherwise any HF causal LM path or hub name.
    path: str = "tiny"
    tokenizer_path: Optional[str] = None
    dtype: str = "float32"  # float32 | bfloat16 | float16 (training master weights stay fp32 under mixed precision)
    mixed_precision: Optional[str] = None  # None | bf16 | fp16 (GPU only)
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
    # "tiny" = the offline prompt set built by rl_core.assets; otherwise a local json/jsonl/csv/parquet file or hub name.
    train_path: str = "tiny"
    text_key: str = "text"
    query_length: int = 64
    start_text: Optional[str] = None
    end_text: Optional[str] = None
    on_malformed: str = "error"  # error | skip


@dataclass
class RolloutConfig:
    engine: str = "embedded"  # embedded | sglang
    response_length: int = 24
    temperature: float = 0.7
    top_k: int = 0
    top_p: float = 1.0
    ignore_eos: bool = True  # OpenAI: fixed-length responses, keep sampling past EOS
    max_turns: int = 1
    concurrency: int = 256
    router_policy: str = "cache_aware"
    engine_timeout_s: float = 300.0
    engine_max_batch_size: int = 64
    mem_fraction_static: float = 0.6  # SGLang KV/weights share of the GPU when colocated
    tp_size: int = 1
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
    estimator: str = "k1"  # k1 | k2 | k3


@dataclass
class AlgorithmConfig:
    advantage_estimator: str = "gae"  # gae | grpo | rloo | reinforce
    group_size: int = 1
    filter_zero_variance_groups: bool = False
    batch_size: int = 64  # episodes per step
    nminibatches: int = 1
    noptepochs: int = 4
    max_tokens_per_device: int = 8192
    lr: float = 1.41e-5
    critic_lr: Optional[float] = None
    optimizer: str = "adam"  # adam | adamw | tf_adam
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
    loss_agg: str = "token-mean"  # token-mean | seq-mean-token-sum | seq-mean-token-mean
    behaviour_is_cap: float = 2.0  # truncated importance weight cap for async off-policy correction
    kl: KLConfig = field(default_factory=KLConfig)


@dataclass
class AsyncConfig:
    max_staleness: int = 1
    partial_rollout: bool = False
    queue_batches: int = 2


@dataclass
class TrainerConfig:
    mode: str = "sync"  # sync | async
    total_episodes: int = 4096
    run_dir: str = "runs/ppo_sentiment"
    save_every: int = 0
    resume: str = "never"  # never | auto | <checkpoint dir>
    log_samples_every: int = 10
    collective_timeout_s: float = 600.0
    progress: bool = True
    wandb: bool = False
    wandb_project: str = "rl_core"
    export_hf: bool = True


@dataclass
class JobConfig:
    seed: int = 1
    model: ModelConfig = field(default_factory=ModelConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    async_: AsyncConfig = field(default_factory=AsyncConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)


# `async` is a Python keyword, so the field is `async_`; users write `async.max_staleness`.
_KEY_ALIASES = {"async": "async_"}
_FIELD_TO_KEY = {v: k for k, v in _KEY_ALIASES.items()}

_CHOICES = {
    "model.dtype": ("float32", "bfloat16", "float16"),
    "model.mixed_precision": (None, "bf16", "fp16"),
    "data.on_malformed": ("error", "skip"),
    "rollout.engine": ("embedded", "sglang"),
    "rollout.router_policy": ("cache_aware", "round_robin", "random", "power_of_two"),
    "algorithm.advantage_estimator": ("gae", "grpo", "rloo", "reinforce"),
    "algorithm.optimizer": ("adam", "adamw", "tf_adam"),
    "algorithm.loss_agg": ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean"),
    "algorithm.kl.estimator": ("k1", "k2", "k3"),
    "trainer.mode": ("sync", "async"),
}


def resolve_config_path(name_or_path: str) -> Path:
    """`--config` takes a path, or a bare recipe name found under configs/."""
    candidates = [Path(name_or_path), CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file '{name_or_path}' not found (looked in . and {CONFIG_DIR}); "
                      f"available recipes: {available}")


def load_config(name_or_path: str | None, overrides: list[str] = (), schema=JobConfig, validate=None):
    """Read a recipe, apply `key=value` overrides, and return a validated `schema` instance.

    `validate(config)` holds the cross-field rules; it defaults to the PPO job's rules.
    """
    from omegaconf import OmegaConf

    raw: dict = {}
    if name_or_path is not None:
        path = resolve_config_path(name_or_path)
        try:
            raw = OmegaConf.to_container(OmegaConf.load(path), resolve=True) or {}
        except Exception as exc:
            raise ConfigError(f"cannot parse {path}: {exc}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{path} must hold a mapping of keys, got {type(raw).__name__}")
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override '{item}' is not key=value (example: trainer.total_episodes=256)")
    try:
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    except Exception as exc:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {exc}") from None
    merged = _deep_merge(raw, dotlist)
    config = _build(schema, merged, prefix="", root=schema)
    (validate or _validate_job)(config)
    return config


def to_dict(config) -> dict:
    """Dataclass -> plain dict with user-facing key names (for saving next to the run)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = _FIELD_TO_KEY.get(f.name, f.name)
        out[key] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def save_config(config, path: str | Path) -> None:
    from omegaconf import OmegaConf

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(to_dict(config)), str(path))


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict) and key not in ("kwargs",):
            merged[key] = _deep_merge(merged[key], value)
        elif isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = {**merged[key], **value}
        else:
            merged[key] = value
    return merged


def _all_keys(schema, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        key = prefix + _FIELD_TO_KEY.get(f.name, f.name)
        keys.append(key)
        ftype = _field_types(schema)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys.extend(_all_keys(ftype, key + "."))
    return keys


def _field_types(schema) -> dict:
    return typing.get_type_hints(schema)


def _build(schema, values: Any, prefix: str, root):
    if not isinstance(values, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or '<root>'}' must be a mapping of keys, got {values!r}")
    types_ = _field_types(schema)
    names = {_FIELD_TO_KEY.get(f.name, f.name): f.name for f in dataclasses.fields(schema)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            full_key = prefix + str(key)
            # Search the whole tree: a right key may sit under the wrong section.
            close = difflib.get_close_matches(full_key, _all_keys(root), n=1, cutoff=0.6)
            hint = f"; did you mean '{close[0]}'?" if close else f"; valid keys here: {', '.join(sorted(names))}"
            raise ConfigError(f"unknown config key '{full_key}'{hint}")
        fname = names[key]
        kwargs[fname] = _coerce(types_[fname], value, prefix + key, root)
    return schema(**kwargs)


def _coerce(ftype, value: Any, key: str, root):
    origin = typing.get_origin(ftype)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(ftype) if a is not type(None)]
        if value is None:
            return None
        return _coerce(args[0], value, key, root)
    if dataclasses.is_dataclass(ftype):
        return _build(ftype, value, key + ".", root)
    expected = origin or ftype
    if expected is bool:
        if isinstance(value, bool):
            return value
    elif expected is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif expected is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif expected is str:
        if isinstance(value, str):
            return value
    elif expected in (dict, list):
        if isinstance(value, expected):
            return value
    else:
        return value
    raise ConfigError(f"config key '{key}' must be {expected.__name__}, got {value!r} "
                      f"({type(value).__name__}); fix the recipe or pass {key}=<{expected.__name__}>")


def _check_choice(config, key: str) -> None:
    value = config
    for part in key.split("."):
        value = getattr(value, _KEY_ALIASES.get(part, part))
    allowed = _CHOICES[key]
    if value not in allowed:
        shown = ", ".join("null" if a is None else str(a) for a in allowed)
        raise ConfigError(f"config key '{key}' = {value!r} is not one of: {shown}")


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _validate_job(cfg: JobConfig) -> None:
    """Cross-field rules: everything that would otherwise fail minutes into a run."""
    for key in _CHOICES:
        _check_choice(cfg, key)
    alg, ro = cfg.algorithm, cfg.rollout
    _require(cfg.seed >= 0, f"config key 'seed' must be >= 0, got {cfg.seed}")
    _require(alg.batch_size > 0, f"config key 'algorithm.batch_size' must be > 0, got {alg.batch_size}")
    _require(alg.nminibatches > 0 and alg.batch_size % alg.nminibatches == 0,
             f"algorithm.batch_size={alg.batch_size} is not divisible into algorithm.nminibatches="
             f"{alg.nminibatches} minibatches; pick a batch_size that is a multiple of nminibatches")
    _require(alg.group_size >= 1 and alg.batch_size % alg.group_size == 0,
             f"algorithm.batch_size={alg.batch_size} is not a multiple of algorithm.group_size={alg.group_size}")
    _require(alg.advantage_estimator == "gae" or alg.group_size >= 2,
             f"algorithm.advantage_estimator={alg.advantage_estimator} needs algorithm.group_size >= 2 "
             f"(several responses per prompt to form a baseline)")
    _require(alg.noptepochs >= 1, f"config key 'algorithm.noptepochs' must be >= 1, got {alg.noptepochs}")
    _require(alg.max_tokens_per_device > 0, "config key 'algorithm.max_tokens_per_device' must be > 0")
    _require(0.0 <= alg.gamma <= 1.0 and 0.0 <= alg.lam <= 1.0, "algorithm.gamma and algorithm.lam must be in [0, 1]")
    _require(alg.lr > 0, f"config key 'algorithm.lr' must be > 0, got {alg.lr}")
    _require(alg.kl.horizon > 0, "config key 'algorithm.kl.horizon' must be > 0")
    _require(alg.behaviour_is_cap >= 1.0, "config key 'algorithm.behaviour_is_cap' must be >= 1")
    _require(ro.response_length > 0, "config key 'rollout.response_length' must be > 0")
    _require(ro.temperature > 0, "config key 'rollout.temperature' must be > 0 (logprobs divide logits by it)")
    _require(0.0 < ro.top_p <= 1.0, f"config key 'rollout.top_p' must be in (0, 1], got {ro.top_p}")
    _require(ro.max_turns >= 1, "config key 'rollout.max_turns' must be >= 1")
    _require(0.0 < ro.mem_fraction_static < 1.0,
             f"rollout.mem_fraction_static={ro.mem_fraction_static} cannot fit colocated with training; use (0, 1)")
    _require(ro.tp_size >= 1, "config key 'rollout.tp_size' must be >= 1")
    _require(cfg.data.query_length > 0, "config key 'data.query_length' must be > 0")
    _require(cfg.env.num_envs >= 1, "config key 'env.num_envs' must be >= 1")
    _require(0.0 <= cfg.env.max_failed_ratio <= 1.0, "config key 'env.max_failed_ratio' must be in [0, 1]")
    _require(cfg.env.step_timeout_s > 0, "config key 'env.step_timeout_s' must be > 0")
    _require(cfg.trainer.total_episodes >= alg.batch_size,
             f"trainer.total_episodes={cfg.trainer.total_episodes} is smaller than one batch "
             f"(algorithm.batch_size={alg.batch_size})")
    _require(cfg.async_.max_staleness >= 0, "config key 'async.max_staleness' must be >= 0")
    _require(cfg.trainer.save_every >= 0, "config key 'trainer.save_every' must be >= 0")
    _require(cfg.trainer.collective_timeout_s > 0, "config key 'trainer.collective_timeout_s' must be > 0")
    _require(cfg.reward.truncate_after >= 0, "config key 'reward.truncate_after' must be >= 0")
    longest = cfg.data.query_length + ro.response_length * ro.max_turns
    _require(longest <= alg.max_tokens_per_device,
             f"one sequence can reach {longest} tokens (data.query_length + rollout.response_length * "
             f"rollout.max_turns) but algorithm.max_tokens_per_device={alg.max_tokens_per_device}; raise it")


def check_context_length(cfg: JobConfig, model_max_positions: int | None) -> None:
    """The model's context must hold the longest query+response; checked once the model config is known."""
    if model_max_positions is None:
        return
    longest = cfg.data.query_length + cfg.rollout.response_length * cfg.rollout.max_turns
    _require(longest <= model_max_positions,
             f"data.query_length + rollout.response_length * rollout.max_turns = {longest} tokens exceeds "
             f"the model's context of {model_max_positions} (model.path={cfg.model.path}); shorten "
             f"data.query_length or rollout.response_length")
