"""The DPO job's configuration (same machinery and `trainer.*` section as the other jobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_core.config import LoraSettings, ModelRunConfig, choice, require
from rl_core.preferences import FORMATS
from rl_core.finetune import FinetuneTrainConfig, FinetuneTrainerConfig, validate_training


@dataclass
class DPOModelConfig(ModelRunConfig):
    path: str = "tiny"  # the policy to train; "tiny" = the offline tiny policy
    tokenizer_path: Optional[str] = None  # null = path
    reference_path: Optional[str] = None  # the frozen reference; null = the starting policy
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class DPODataConfig:
    # The preference formats the reward-model job reads: pairwise, llama2, openai (best-of-N becomes
    # N-1 pairs of the best against each other response).
    train_path: str = "tiny"  # "tiny" = the offline pairs; otherwise a local .jsonl/.json/.csv/.parquet file or hub dataset
    test_path: Optional[str] = "tiny"  # null = hold out data.heldout_fraction of train
    heldout_fraction: float = 0.05  # with test_path null: the share of train pairs held out
    format: str = choice("auto", ("auto", *FORMATS))  # auto = found from the columns
    margin_map: Optional[dict] = None  # read with the file; DPO does not use margins
    max_length: int = 128  # prompt + response tokens per sequence
    on_malformed: str = choice("error", ("error", "skip"))  # a malformed row stops the job, or is skipped and counted
    eval_max_pairs: Optional[int] = 512  # held-out pairs evaluated; null = all


@dataclass
class DPOLossConfig:
    beta: float = 0.1  # strength of the KL tie to the reference (Rafailov et al. 2023)
    label_smoothing: float = 0.0  # conservative DPO: the chance a label is flipped


@dataclass
class DPOEvalConfig:
    every: int = 0  # steps between evaluations (besides step 0 and the end); 0 = only those two
    # Sample continuations of held-out prompts and score them with a reward model: eval/rm_score.
    reward_model_path: Optional[str] = None  # "tiny" = the tiny sentiment reward model; null = off
    prompts: int = 128  # held-out prompts continued and scored
    query_length: int = 64  # prompt tokens
    response_length: int = 24  # tokens sampled per prompt
    temperature: float = 0.7  # sampling temperature (0 = greedy)


@dataclass
class DPOTrainerConfig(FinetuneTrainerConfig):
    run_dir: str = "runs/dpo"


@dataclass
class DPOConfig:
    model: DPOModelConfig = field(default_factory=DPOModelConfig)
    data: DPODataConfig = field(default_factory=DPODataConfig)
    dpo: DPOLossConfig = field(default_factory=DPOLossConfig)
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)  # the same keys as SFT
    eval: DPOEvalConfig = field(default_factory=DPOEvalConfig)
    trainer: DPOTrainerConfig = field(default_factory=DPOTrainerConfig)


def validate(cfg: DPOConfig) -> None:
    """Cross-field rules of the DPO job; raises ConfigError naming the key and the fix."""
    tr = cfg.train
    validate_training(tr, cfg.trainer, cfg.model.lora)
    cfg.model.validate(tr.packing)
    require(cfg.dpo.beta > 0, f"config key 'dpo.beta' must be > 0, got {cfg.dpo.beta}")
    require(0.0 <= cfg.dpo.label_smoothing < 0.5,
            f"config key 'dpo.label_smoothing' must be in [0, 0.5), got {cfg.dpo.label_smoothing}")
    require(cfg.data.max_length >= 2, f"config key 'data.max_length' must be >= 2, got {cfg.data.max_length}")
    require(tr.max_tokens_per_device >= 2 * cfg.data.max_length,
            f"train.max_tokens_per_device={tr.max_tokens_per_device} cannot hold one pair of two rows of "
            f"data.max_length={cfg.data.max_length}; raise it to at least {2 * cfg.data.max_length}")
    require(0.0 < cfg.data.heldout_fraction < 1.0, "config key 'data.heldout_fraction' must be in (0, 1)")
    require(cfg.eval.every >= 0, "config key 'eval.every' must be >= 0")
    require(cfg.eval.temperature >= 0, "config key 'eval.temperature' must be >= 0 (0 = greedy)")
    require(cfg.eval.prompts > 0 and cfg.eval.response_length > 0 and cfg.eval.query_length > 0,
            "config keys 'eval.prompts', 'eval.query_length' and 'eval.response_length' must be > 0")
    longest = cfg.eval.query_length + cfg.eval.response_length
    require(not cfg.eval.reward_model_path or longest <= tr.max_tokens_per_device,
            f"eval.query_length + eval.response_length = {longest} tokens do not fit one micro-batch of "
            f"train.max_tokens_per_device={tr.max_tokens_per_device}, which the reward model scores them in; raise "
            "train.max_tokens_per_device or shorten eval.query_length or eval.response_length")


def check_models(cfg: DPOConfig) -> None:
    """The rules that need the models' configs (read at parse time, before any process group starts):
    policy and reference hold a whole sequence, and with eval.reward_model_path the policy and that
    reward model hold a continued held-out prompt."""
    from workers.loading import model_context_length

    models = (("model.path", cfg.model.path), ("model.reference_path", cfg.model.reference_path))
    for key, path in models:
        context = model_context_length(path) if path else None
        require(context is None or cfg.data.max_length <= context,
                f"data.max_length={cfg.data.max_length} exceeds the model's context of {context} ({key}={path}); "
                f"set data.max_length<={context}")
    if cfg.eval.reward_model_path:
        longest = cfg.eval.query_length + cfg.eval.response_length
        for key, path in (models[0], ("eval.reward_model_path", cfg.eval.reward_model_path)):
            context = model_context_length(path)
            require(context is None or longest <= context,
                    f"eval.query_length + eval.response_length = {longest} tokens exceeds the model's context of "
                    f"{context} ({key}={path}); shorten eval.query_length or eval.response_length")
