"""Typed configuration for every job: YAML recipe + `key=value` overrides -> validated dataclasses.

OmegaConf reads the YAML and the dotlist overrides; each job describes its keys as plain
dataclasses (`rl_core/ppo/config.py`, `rl_core/sft/config.py`, `rl_core/dpo/config.py`,
`rl_core/reward_model/config.py`) that share the `trainer.*` section, the `model` section's run keys
(`ModelRunConfig`) and the optimizer keys (`OptimizerConfig`) below; a comment next to each field describes
its key (scripts/config_reference.py writes docs/config-reference.md from them).
`load_config` checks every key, type and allowed value, then the job's cross-field rules, *before* any
process group or engine starts, so a typo costs one line of output instead of a crashed job.
"""

from __future__ import annotations

import dataclasses
import difflib
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Optional

from rl_core.errors import UserError
from rl_core.optim import OPTIMIZER_NAMES

CONFIG_DIR = Path(__file__).resolve().parents[1] / "configs"

# `async` is a Python keyword, so the PPO field is `async_`; users write `async.max_staleness`.
_KEY_ALIASES = {"async": "async_"}
_FIELD_TO_KEY = {v: k for k, v in _KEY_ALIASES.items()}
# Keys that moved: an old config names the new key in one line instead of a guess. Every job's
# evaluation cadence is `eval.every` (the PPO job had it as trainer.eval_every).
MOVED_KEYS = {"trainer.eval_every": "eval.every"}
# The weight dtypes a job's models load in (`model.dtype`), and PPO's engines serve in (`rollout.dtype`).
DTYPES = ("float32", "bfloat16", "float16")


class ConfigError(UserError, ValueError):
    """A configuration problem, phrased for the user: the key, what is wrong, how to fix it."""


def choice(default: Any, allowed: typing.Iterable[Any]) -> Any:
    """A dataclass field whose value must be one of `allowed` (checked by `load_config`)."""
    allowed = tuple(allowed)
    if default not in allowed:
        raise ValueError(f"default {default!r} is not one of {allowed}")
    return field(default=default, metadata={"choices": allowed})


@dataclass
class LoraSettings:
    rank: int = 0  # 0 = train every weight; > 0 = LoRA adapters of this rank (PEFT), the base weights frozen
    alpha: float = 16.0  # LoRA scaling: the adapters' update is alpha / rank x BA
    dropout: float = 0.0  # dropout on the adapters' input (the PPO actor keeps 0: OpenAI's no-dropout detail)
    target_modules: Optional[list] = None  # null = PEFT's default for the architecture (GPT-2: c_attn)
    export: str = choice("merged", ("merged", "adapter"))  # <run_dir>/final: the merged model, or the adapter

    def validate(self) -> None:
        require(self.rank >= 0, f"config key 'model.lora.rank' must be >= 0 (0 = no LoRA), got {self.rank}")
        require(self.alpha > 0, f"config key 'model.lora.alpha' must be > 0, got {self.alpha}")
        require(0.0 <= self.dropout < 1.0, f"config key 'model.lora.dropout' must be in [0, 1), got {self.dropout}")


@dataclass
class ModelRunConfig:
    """How the trainer runs its models: the keys every job's `model` section shares (a job's own section
    subclasses this with its paths)."""

    # The dtype every model of the job loads in: the trained models' master weights; under mixed precision
    # they stay fp32.
    dtype: str = choice("float32", DTYPES)
    mixed_precision: Optional[str] = choice(None, (None, "bf16", "fp16"))  # GPU only
    cpu_offload: bool = False  # FSDP2 parameter/optimizer offload (GPU only)
    gradient_checkpointing: bool = False  # the trained models recompute activations in backward (less memory)
    # The attention kernel by transformers' name: null = its default (sdpa where the model has it; eager for
    # Gemma 2's soft-capped scores), or e.g. flash_attention_2 on GPUs (the flash-attn package). With packing,
    # flash runs each micro-batch as one row of sequences back to back through its varlen kernel, sdpa and
    # eager as rows with a block-diagonal mask. Every model of the job loads with it.
    attn_implementation: Optional[str] = None
    # Ranks that split each packed micro-batch's tokens (Ulysses, workers/sequence_parallel.py): 1 = none.
    # Needs packing, sdpa or eager, head counts divisible by it, and a world size it divides.
    sequence_parallel: int = 1
    # Tokens of LM-head logits computed at a time, recomputed in backward (0 = the whole micro-batch's at
    # once): float32 logits are tokens x vocabulary x 4 bytes, 2.4 GB for 4096 tokens of a 150k vocabulary.
    # Used only where a micro-batch's logits exceed 64 MiB; smaller ones are computed whole (workers/forward.py).
    logits_chunk: int = 1024

    def validate(self, packing: bool) -> None:
        require(self.sequence_parallel >= 1,
                f"config key 'model.sequence_parallel' must be >= 1 (1 = none), got {self.sequence_parallel}")
        require(self.sequence_parallel == 1 or packing,
                f"model.sequence_parallel={self.sequence_parallel} splits packed micro-batches; turn packing on "
                "(the job's packing key) or set model.sequence_parallel=1")
        require(self.sequence_parallel == 1 or "flash" not in (self.attn_implementation or ""),
                f"model.sequence_parallel={self.sequence_parallel} runs the model's kernel on whole packed rows "
                f"with their mask, which model.attn_implementation={self.attn_implementation}'s varlen layout "
                "has none of; use sdpa (null) or eager")
        require(self.logits_chunk >= 0, f"config key 'model.logits_chunk' must be >= 0 (0 = no chunks), "
                                        f"got {self.logits_chunk}")
        if self.cpu_offload:
            import torch

            require(torch.cuda.is_available(),
                    "model.cpu_offload=true offloads FSDP2's GPU shards to host memory, and this machine has no GPU "
                    "(CUDA); set model.cpu_offload=false")


@dataclass
class OptimizerConfig:
    """The optimizer keys every job's training section shares (PPO's `algorithm`, SFT's, DPO's and the reward
    model's `train`), validated once; a section redeclares the defaults it changes."""

    optimizer: str = choice("adamw", OPTIMIZER_NAMES)  # adam, adamw or tf_adam (TensorFlow's epsilon placement)
    lr: float = 1e-5  # peak learning rate
    adam_eps: float = 1e-8  # Adam epsilon
    adam_betas: tuple = (0.9, 0.999)  # Adam betas: the decay rates of the gradient's mean and square averages
    weight_decay: float = 0.0  # decoupled weight decay (adamw, tf_adam; adam adds it to the gradient)
    max_grad_norm: Optional[float] = 1.0  # gradient clipping; null = none

    def validate(self, section: str) -> None:
        """The rules of these keys under `section` (e.g. "train"), each broken one a line naming its key."""
        require(self.lr > 0, f"config key '{section}.lr' must be > 0, got {self.lr}")
        require(self.adam_eps > 0, f"config key '{section}.adam_eps' must be > 0, got {self.adam_eps}")
        betas = self.adam_betas
        require(isinstance(betas, (list, tuple)) and len(betas) == 2
                and all(isinstance(b, (int, float)) and not isinstance(b, bool) and 0 <= b < 1 for b in betas),
                f"config key '{section}.adam_betas' must be two numbers in [0, 1), got {betas}")
        require(self.weight_decay >= 0, f"config key '{section}.weight_decay' must be >= 0, got {self.weight_decay}")
        require(self.max_grad_norm is None or self.max_grad_norm > 0,
                f"config key '{section}.max_grad_norm' must be > 0 or null, got {self.max_grad_norm}")


@dataclass
class TrainerConfig:
    """Run-level settings every job shares; a job's own trainer section subclasses this."""

    run_dir: str = "runs/job"  # where the job writes config, metrics, logs, checkpoints and final/
    seed: int = 1  # base seed; each rank uses seed + rank * 100003
    progress: bool = True  # progress bars on rank 0
    wandb: bool = False  # also log to Weights & Biases (needs the wandb package)
    wandb_project: str = "rl_core"  # the wandb project, when trainer.wandb is true
    # Bounds every collective, so a dead rank stops the job;
    collective_timeout_s: float = 600.0  # what rank 0 does alone (a rollout, an evaluation) is waited for without it

    def validate(self) -> None:
        """The rules of these keys; a job's section that adds keys checks them after calling this."""
        require(self.seed >= 0, f"config key 'trainer.seed' must be >= 0, got {self.seed}")
        require(self.collective_timeout_s > 0, "config key 'trainer.collective_timeout_s' must be > 0")


def validate_checkpoint_keys(save_every: int, keep_last: int) -> None:
    """`trainer.save_every` and `trainer.keep_last`, of the jobs that save checkpoints (SFT, DPO, PPO)."""
    require(save_every >= 0, "config key 'trainer.save_every' must be >= 0")
    require(keep_last >= 0, "config key 'trainer.keep_last' must be >= 0 (0 keeps every checkpoint)")


def validate_profile_steps(steps: list, total_steps: int | None, unit: str) -> None:
    """`trainer.profile_steps` (rl_core.profiling): step numbers as logged, within the run's `total_steps`
    (`unit` says what sets them); None when the data sets the run's length, checked again once it is known."""
    require(all(isinstance(s, int) and not isinstance(s, bool) for s in steps),
            f"config key 'trainer.profile_steps' must be a list of step numbers, e.g. [3, 4], got {steps!r}")
    outside = sorted({s for s in steps if s < 1 or (total_steps is not None and s > total_steps)})
    if outside:
        bound = f"1..{total_steps}, the run's steps ({unit})" if total_steps is not None else "1 or more"
        raise ConfigError(f"trainer.profile_steps={steps} names step(s) {outside} outside {bound}; "
                          "list steps of the run, e.g. trainer.profile_steps=[3,4]")


# ------------------------------------------------------------------------------------ loading


def resolve_config_path(name_or_path: str) -> Path:
    """`--config` takes a path, or a bare recipe name found under configs/."""
    candidates = [Path(name_or_path), CONFIG_DIR / name_or_path, CONFIG_DIR / f"{name_or_path}.yaml"]
    for candidate in candidates:
        if candidate.is_file():
            return candidate
    available = ", ".join(sorted(p.name for p in CONFIG_DIR.glob("*.yaml")))
    raise ConfigError(f"config file '{name_or_path}' not found (looked in . and {CONFIG_DIR}); "
                      f"available recipes: {available}")


def load_config(name_or_path: str | None, overrides: typing.Sequence[str], schema: type,
                validate: Callable[[Any], None] | None = None):
    """Read a recipe, apply `key=value` overrides, and return a checked `schema` instance.

    Unknown keys, wrong types and values outside a field's `choice(...)` raise ConfigError;
    `validate(config)` then applies the job's cross-field rules.
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
            raise ConfigError(f"override '{item}' is not key=value (example: trainer.seed=2)")
    try:
        dotlist = OmegaConf.to_container(OmegaConf.from_dotlist(list(overrides)), resolve=True)
    except Exception as exc:
        raise ConfigError(f"cannot parse overrides {list(overrides)}: {exc}") from None
    config = _build(schema, _deep_merge(raw, dotlist), prefix="", root=schema)
    _check_choices(config, prefix="")
    if validate is not None:
        validate(config)
    return config


def to_dict(config) -> dict:
    """Dataclass -> plain dict with user-facing key names (for saving next to the run)."""
    out = {}
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        out[_FIELD_TO_KEY.get(f.name, f.name)] = to_dict(value) if dataclasses.is_dataclass(value) else value
    return out


def save_config(config, path: str | Path) -> None:
    from omegaconf import OmegaConf

    Path(path).parent.mkdir(parents=True, exist_ok=True)
    OmegaConf.save(OmegaConf.create(to_dict(config)), str(path))


def require(condition: bool, message: str) -> None:
    """A cross-field rule: raise ConfigError(message) unless `condition` holds."""
    if not condition:
        raise ConfigError(message)


# ------------------------------------------------------------------------------------ internals


def _deep_merge(base: dict, update: dict) -> dict:
    merged = dict(base)
    for key, value in update.items():
        if isinstance(value, dict) and isinstance(merged.get(key), dict):
            merged[key] = _deep_merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def _all_keys(schema, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(schema):
        key = prefix + _FIELD_TO_KEY.get(f.name, f.name)
        keys.append(key)
        ftype = typing.get_type_hints(schema)[f.name]
        if dataclasses.is_dataclass(ftype):
            keys.extend(_all_keys(ftype, key + "."))
    return keys


def _build(schema, values: Any, prefix: str, root):
    if not isinstance(values, dict):
        raise ConfigError(f"'{prefix.rstrip('.') or '<root>'}' must be a mapping of keys, got {values!r}")
    types_ = typing.get_type_hints(schema)
    names = {_FIELD_TO_KEY.get(f.name, f.name): f.name for f in dataclasses.fields(schema)}
    kwargs = {}
    for key, value in values.items():
        if key not in names:
            full_key = prefix + str(key)
            if full_key in MOVED_KEYS:
                raise ConfigError(f"config key '{full_key}' is now '{MOVED_KEYS[full_key]}'; rename it")
            # Search the whole tree: a right key may sit under the wrong section.
            everywhere = _all_keys(root)
            same_name = [k for k in everywhere if k.rsplit(".", 1)[-1] == str(key)]
            close = same_name or difflib.get_close_matches(full_key, everywhere, n=1, cutoff=0.6)
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
    elif expected is tuple:  # a fixed-length list (e.g. adam_betas): YAML's list, kept as the default's tuple
        if isinstance(value, (list, tuple)):
            return tuple(value)
    else:
        return value
    name = "list" if expected is tuple else expected.__name__
    raise ConfigError(f"config key '{key}' must be {name}, got {value!r} "
                      f"({type(value).__name__}); fix the recipe or pass {key}=<{name}>")


def _check_choices(config, prefix: str) -> None:
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        key = prefix + _FIELD_TO_KEY.get(f.name, f.name)
        if dataclasses.is_dataclass(value):
            _check_choices(value, key + ".")
        elif "choices" in f.metadata and value not in f.metadata["choices"]:
            shown = ", ".join("null" if a is None else str(a) for a in f.metadata["choices"])
            raise ConfigError(f"config key '{key}' = {value!r} is not one of: {shown}")
