"""Loading what a job trains and serves: model paths checked in one line, the tokenizer (with a
distinct pad token), causal LMs, the value model and reward models, all with dropout off.

OpenAI details here: pad token distinct from EOS, no dropout, value head zero, reward head
N(0, 1/sqrt(d+1)) with gain/bias in the config.
"""

from __future__ import annotations

import inspect
import logging
from pathlib import Path
from typing import Any, Callable

import torch
from torch import nn
from rl_core.errors import UserError
from workers import sequence_parallel
from transformers import (
    AutoConfig,
    AutoModel,
    AutoModelForCausalLM,
    AutoModelForImageTextToText,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PretrainedConfig,
    PreTrainedModel,
)

logger = logging.getLogger(__name__)

PAD_TOKEN = "[PAD]"
VALUE_HEAD_FILE = "value_head.safetensors"


# --------------------------------------------------------------------------- model paths


class ModelPathError(UserError, ValueError):
    """A configured model path is neither a local model directory nor a model on the hub."""


HUB_HINT = "a local directory saved with save_pretrained (config.json + weights) or a Hugging Face hub name such as 'gpt2'"


def check_model_path(path: str, key: str, need_config: bool = True) -> None:
    """Fail in one line, before anything loads, when `key`'s model cannot be found.

    A path that exists must be a directory (holding config.json when `need_config`); a path that
    cannot be a hub name (absolute, ./, ../, ~, more than one '/') must exist. Anything else is a
    hub name, looked up once: transformers would retry the hub for tens of seconds per file and
    then report a repo-id or sentencepiece error. With HF_HUB_OFFLINE=1 only the local cache counts.
    """
    local = Path(path).expanduser()
    if local.exists():
        if not local.is_dir():
            raise ModelPathError(f"{key}={path} is a file, not a model directory; give {HUB_HINT}")
        if need_config and not (local / "config.json").is_file():
            raise ModelPathError(f"{key}={path} has no config.json, so it is not a Hugging Face model directory; "
                                 f"give {HUB_HINT}")
        return
    if path.startswith(("/", "./", "../", "~")) or path.count("/") > 1 or "\\" in path:
        raise ModelPathError(f"{key}={path} does not exist (resolved to {local.resolve()}); fix the path or give "
                             f"{HUB_HINT}")
    reason = _hub_lookup(path)
    if reason is not None:
        raise ModelPathError(f"{key}={path} is not a local directory (no {local.resolve()}) and not a model on the "
                             f"Hugging Face hub ({reason}); give a local directory with config.json, or check the hub "
                             "name and the network")


def _hub_lookup(name: str) -> str | None:
    """None if the hub (or, offline, the local cache) has `name`'s config.json, else why not (one request)."""
    from huggingface_hub import constants, get_hf_file_metadata, hf_hub_url, try_to_load_from_cache
    from huggingface_hub.errors import HFValidationError

    try:
        if isinstance(try_to_load_from_cache(name, "config.json"), str):
            return None
        if constants.HF_HUB_OFFLINE:
            return "HF_HUB_OFFLINE=1 and it is not in the local cache"
        get_hf_file_metadata(hf_hub_url(name, "config.json"), timeout=10, retry_on_errors=False)
    except HFValidationError:
        return "not a valid repo id"
    except Exception as err:  # noqa: BLE001 - any failure is reported in the one line
        text = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        return f"{type(err).__name__}: {text[:160]}"
    return None


# --------------------------------------------------------------------------- tokenizer and policy


def load_tokenizer(path: str):
    """Load a tokenizer; add a ``[PAD]`` token when it has none, or pads with its EOS.

    OpenAI detail: the pad token is distinct from EOS, so padding never reads as end-of-text.
    An added pad id may lie outside the model's vocabulary: it never reaches the model, because
    ``prepare_inputs`` replaces pad positions with id 0 and the engine is sent unpadded ids.
    """
    tokenizer = AutoTokenizer.from_pretrained(path)
    # Released chat models often pad with their end-of-turn token (SmolLM2: <|im_end|>); that is no pad token here.
    if tokenizer.pad_token is None or tokenizer.pad_token_id == tokenizer.eos_token_id:
        before = tokenizer.pad_token
        tokenizer.add_special_tokens({"pad_token": PAD_TOKEN})
        logger.warning("tokenizer at %s had %s: added %r (id %d)", path,
                       f"EOS {before!r} as its pad token" if before else "no pad token", PAD_TOKEN,
                       tokenizer.pad_token_id)
    return tokenizer


def single_token_id(tokenizer, text: str, config_key: str) -> int:
    """The id of ``text``, which must be exactly one token (e.g. the '.' of OpenAI's truncation)."""
    ids = tokenizer.encode(text, add_special_tokens=False)
    if len(ids) != 1:
        raise ValueError(f"{config_key}={text!r} is {len(ids)} tokens for this tokenizer; "
                         "it must be exactly one (e.g. '.')")
    return ids[0]


def _config_without_dropout(path: str, **overrides: Any) -> PretrainedConfig:
    """The checkpoint's config with every dropout probability set to 0 (OpenAI detail: no dropout)."""
    config = AutoConfig.from_pretrained(path, **overrides)
    for name, value in list(config.to_dict().items()):
        is_dropout = name.endswith("pdrop") or "dropout" in name
        if is_dropout and isinstance(value, float):
            setattr(config, name, 0.0)
    return config


def disable_dropout(model: nn.Module) -> nn.Module:
    """Set every ``nn.Dropout`` to p=0 so train mode and eval mode give the same outputs."""
    for module in model.modules():
        if isinstance(module, nn.modules.dropout._DropoutNd):
            module.p = 0.0
    return model


def load_causal_lm(path: str, dtype: torch.dtype = torch.float32, attn_implementation: str | None = None) -> PreTrainedModel:
    """A causal LM with dropout off everywhere (OpenAI detail: no dropout). `attn_implementation`: the
    attention kernel by transformers' name (None: its default, sdpa where the model has it).

    A vision-language checkpoint (a `vision_config`) loads whole, vision tower included, as transformers'
    image-text-to-text class: the trainer's forward passes it the images (workers/forward.py), and
    AutoModelForCausalLM has no class at all for some (Qwen2.5-VL, Qwen3-VL)."""
    config = _config_without_dropout(path)
    auto = AutoModelForImageTextToText if hasattr(config, "vision_config") else AutoModelForCausalLM
    model = auto.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn_implementation)
    return disable_dropout(model)


def cache_keyword(model: nn.Module) -> str:
    """The keyword (and output field) of a causal LM's KV cache: `cache` where transformers renamed it (5.24 here,
    which warns at the old name until 5.40 drops it), `past_key_values` before (5.12, the floor)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under LoRA, peft's wrapper
    return "cache" if "cache" in inspect.signature(base.forward).parameters else "past_key_values"



# --------------------------------------------------------------------------- critic


class ValueModel(nn.Module):
    """A base transformer with a scalar head: one value per position.

    OpenAI detail: the value head starts at zero (weight and bias), so initial values are 0.
    """

    def __init__(self, backbone: PreTrainedModel):
        super().__init__()
        self.backbone = backbone
        self.head = nn.Linear(backbone.config.hidden_size, 1, dtype=backbone.dtype)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)

    @classmethod
    def from_pretrained(cls, path: str, dtype: torch.dtype = torch.float32,
                        attn_implementation: str | None = None) -> "ValueModel":
        """Backbone from a causal-LM or value checkpoint; head from ``value_head.safetensors`` if present."""
        config = _config_without_dropout(path)
        backbone = AutoModel.from_pretrained(path, config=config, dtype=dtype, attn_implementation=attn_implementation)
        model = cls(disable_dropout(backbone))
        head_file = Path(path) / VALUE_HEAD_FILE
        if head_file.exists():
            from safetensors.torch import load_file

            model.head.load_state_dict(load_file(str(head_file)))
        return model

    def save_pretrained(self, out_dir: str | Path) -> None:
        """Backbone as a Hugging Face checkpoint plus the head as ``value_head.safetensors``."""
        from safetensors.torch import save_file

        self.backbone.save_pretrained(str(out_dir))
        head = {name: tensor.detach().cpu().contiguous() for name, tensor in self.head.state_dict().items()}
        save_file(head, str(Path(out_dir) / VALUE_HEAD_FILE))

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, attention_mask=None,
                use_cache: bool = False, **kwargs) -> torch.Tensor:
        """`[n, L]` values; `kwargs` reach the attention (e.g. `workers.sequence_parallel`'s group)."""
        hidden = self.backbone(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=use_cache, **kwargs
        ).last_hidden_state
        # A fresh tensor, not a squeeze view: FSDP2 hooks the module output for backward, and a
        # view would let a later in-place op bypass that hook.
        return self.head(hidden.to(self.head.weight.dtype)).squeeze(-1).clone()


# --------------------------------------------------------------------------- reward model


def score_head(model: PreTrainedModel) -> nn.Module:
    for name in ("score", "classifier"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Module):
            return head
    raise ValueError(f"{type(model).__name__} has no 'score' or 'classifier' head; "
                     "use an AutoModelForSequenceClassification checkpoint with num_labels=1")


def _ensure_gain_bias(model: PreTrainedModel) -> PreTrainedModel:
    """Default gain 1 / bias 0 so any HF sequence-classification checkpoint loads."""
    model.config.reward_gain = float(getattr(model.config, "reward_gain", 1.0))
    model.config.reward_bias = float(getattr(model.config, "reward_bias", 0.0))
    return model


def _set_pad_token_id(model: PreTrainedModel, pad_token_id: int | None) -> None:
    if pad_token_id is not None:
        model.config.pad_token_id = pad_token_id


def init_reward_model(
    policy_path: str,
    dtype: torch.dtype = torch.float32,
    pad_token_id: int | None = None,
    seed: int | None = None,
    attn_implementation: str | None = None,
) -> PreTrainedModel:
    """A fresh reward model (scalar sequence classifier) on top of a causal-LM checkpoint.

    OpenAI detail: head weight ~ N(0, 1/sqrt(d_model + 1)), bias 0; gain 1 and bias 0 until fitted.
    """
    config = _config_without_dropout(policy_path, num_labels=1)
    model = AutoModelForSequenceClassification.from_pretrained(policy_path, config=config, dtype=dtype,
                                                               attn_implementation=attn_implementation)
    _set_pad_token_id(model, pad_token_id)
    head = score_head(model)
    generator = torch.Generator().manual_seed(seed) if seed is not None else None
    d_model = head.weight.shape[1]
    with torch.no_grad():
        init = torch.randn(head.weight.shape, generator=generator) / (d_model + 1) ** 0.5
        head.weight.copy_(init.to(head.weight.dtype))
        if head.bias is not None:
            head.bias.zero_()
    set_reward_gain_bias(model, 1.0, 0.0)
    return disable_dropout(model)


def load_reward_model(path: str, dtype: torch.dtype = torch.float32, pad_token_id: int | None = None,
                      attn_implementation: str | None = None) -> PreTrainedModel:
    """A trained reward model (any HF seq-cls checkpoint with one label); gain/bias from its config."""
    config = _config_without_dropout(path)
    if config.num_labels != 1:
        raise ValueError(f"reward model at {path} has num_labels={config.num_labels}; a scalar reward needs 1")
    model = AutoModelForSequenceClassification.from_pretrained(path, config=config, dtype=dtype,
                                                               attn_implementation=attn_implementation)
    _set_pad_token_id(model, pad_token_id)
    return disable_dropout(_ensure_gain_bias(model))


def set_reward_gain_bias(model: PreTrainedModel, gain: float, bias: float) -> None:
    """Store the normalisation in the config so ``save_pretrained`` carries it."""
    model.config.reward_gain, model.config.reward_bias = float(gain), float(bias)


def prepare_for_run(model: nn.Module, run, trained: bool) -> nn.Module:
    """Apply a job's `model` run keys (`rl_core.config.ModelRunConfig`) to a loaded model: activation
    checkpointing on a model being `trained`, and Ulysses attention under sequence parallelism."""
    base = model.backbone if isinstance(model, ValueModel) else model
    if trained and run.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    if run.sequence_parallel > 1:
        sequence_parallel.enable(base, run.sequence_parallel)
    return model


def enable_gradient_checkpointing(model: PreTrainedModel) -> None:
    """Recompute each block's activations in backward instead of storing them (memory for compute).
    Non-reentrant checkpointing works under FSDP2; the KV cache is useless when training."""
    if hasattr(model, "activation_checkpointing_enable"):  # the name since transformers 5.x
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False


def context_length(config: PretrainedConfig) -> int | None:
    """The longest sequence a model's positions allow (None when its config does not say): what the
    jobs check their lengths against and both engines serve."""
    config = config.get_text_config()  # a multimodal config's language model holds the positions
    for key in ("n_positions", "max_position_embeddings", "n_ctx", "seq_length"):
        if getattr(config, key, None):
            return int(getattr(config, key))
    return None


def model_context_length(path: str) -> int | None:
    """`context_length` of the model at `path`, from its config alone (no weights loaded)."""
    return context_length(AutoConfig.from_pretrained(path))


# --------------------------------------------------------------------------- checkpoint names


def checkpoint_renamer(config: dict) -> Callable[[str], str] | None:
    """The trainer's parameter name -> the model's checkpoint name, for a vision-language model whose names
    transformers 5 changes on load (its config dict: `architectures`, `vision_config`); None when they are the same.

    Qwen2-VL and Qwen2.5-VL load `visual.*` as `model.visual.*` and `model.*` as `model.language_model.*`;
    SGLang 0.5.23 takes only the checkpoint's names (its scheduler dies on a KeyError for the others). The renames
    are transformers' own (its conversion mapping for the architecture), reversed, as `save_pretrained` does.
    Text models are left alone: their names reach the engine as they are."""
    if "vision_config" not in config:
        return None
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping
    from transformers.core_model_loading import WeightRenaming

    conversions = []
    for key in (*(config.get("architectures") or ()), config.get("model_type")):
        conversions = get_checkpoint_conversion_mapping(key) or [] if key else []
        if conversions:
            break
    # Renames only: a weight converter (fused experts) changes tensors, not names, and is not undone here.
    reverse = [step.reverse_transform() for step in reversed(conversions) if isinstance(step, WeightRenaming)]
    if not reverse:
        return None

    def rename(name: str) -> str:
        for step in reverse:
            name = step.rename_source_key(name)[0]
        return name
    return rename


def model_checkpoint_renamer(model_path: str | None) -> Callable[[str], str] | None:
    """`checkpoint_renamer` of the model at `model_path` (a directory or a cached hub name; else None)."""
    from workers.engines.spec import model_config

    config = model_config(model_path) if model_path else None
    return checkpoint_renamer(config) if config is not None else None
