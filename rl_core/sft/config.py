"""The supervised fine-tuning job's configuration (same machinery and `trainer.*` section as the other jobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_core.config import TrainerConfig, choice, require
from rl_core.optim import OPTIMIZER_NAMES

SFT_FORMATS = ("messages", "prompt_response")


@dataclass
class SFTModelConfig:
    path: str = "tiny"  # any Hugging Face causal LM; "tiny" = the offline tiny policy
    tokenizer_path: Optional[str] = None  # null = path; the chat template comes from here
    mixed_precision: Optional[str] = choice(None, (None, "bf16", "fp16"))  # GPU only
    gradient_checkpointing: bool = False


@dataclass
class SFTDataConfig:
    # A local .jsonl/.json/.parquet file or a hub dataset. Rows are either chat `messages`
    # ([{role, content}, ...]; the loss on assistant turns) or a prompt and a response (the loss on
    # the response; a prompt that is a list of messages is rendered with the chat template).
    train_path: str = "tiny-arithmetic-sft"
    eval_path: Optional[str] = None  # held-out rows: loss and token accuracy; null = no evaluation
    format: str = choice("auto", ("auto", *SFT_FORMATS))
    messages_key: str = "messages"
    prompt_key: str = "prompt"
    response_key: str = "response"
    max_length: int = 512  # tokens per row
    on_long: str = choice("drop", ("drop", "truncate"))  # a longer row is left out, or cut at max_length
    eval_max_rows: Optional[int] = None


@dataclass
class SFTTrainConfig:
    batch_size: int = 32  # rows per optimizer step, over all ranks
    epochs: int = 1
    max_steps: Optional[int] = None  # stop earlier than `epochs`
    lr: float = 1e-5
    schedule: str = choice("linear", ("linear", "constant"))  # after warmup: annealed to zero, or held
    warmup_steps: int = 0
    optimizer: str = choice("adamw", OPTIMIZER_NAMES)
    weight_decay: float = 0.0
    adam_eps: float = 1e-8
    adam_betas: tuple = (0.9, 0.999)
    max_grad_norm: Optional[float] = 1.0
    max_tokens_per_device: int = 8192  # real tokens per micro-batch; rows are balanced across ranks by tokens
    log_every: int = 10


@dataclass
class SFTEvalConfig:
    every: int = 0  # steps between evaluations (besides step 0 and the end); 0 = only those two
    # Greedy generation on the eval prompts, scored by a reward function ("pkg.module:fn", called
    # (completion, row) -> float; > 0 counts as correct): eval/accuracy. null = loss and token accuracy only.
    reward_fn: Optional[str] = None
    max_new_tokens: int = 32
    generate_rows: int = 200  # eval rows generated for eval/accuracy (greedy decoding is the slow part)


@dataclass
class SFTTrainerConfig(TrainerConfig):
    run_dir: str = "runs/sft"
    save_every: int = 0
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 keeps all
    resume: str = "never"  # never | auto | <checkpoint dir>
    export_hf: bool = True  # <run_dir>/final in Hugging Face format


@dataclass
class SFTConfig:
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def validate(cfg: SFTConfig) -> None:
    """Cross-field rules of the SFT job; raises ConfigError naming the key and the fix."""
    tr, data = cfg.train, cfg.data
    require(cfg.trainer.seed >= 0, f"config key 'trainer.seed' must be >= 0, got {cfg.trainer.seed}")
    require(tr.batch_size > 0, f"config key 'train.batch_size' must be > 0, got {tr.batch_size}")
    require(tr.epochs > 0, f"config key 'train.epochs' must be > 0, got {tr.epochs}")
    require(tr.max_steps is None or tr.max_steps > 0, f"config key 'train.max_steps' must be > 0 or null, got {tr.max_steps}")
    require(tr.lr > 0, f"config key 'train.lr' must be > 0, got {tr.lr}")
    require(len(tr.adam_betas) == 2 and all(0 <= b < 1 for b in tr.adam_betas),
            f"config key 'train.adam_betas' must be two numbers in [0, 1), got {tr.adam_betas}")
    require(tr.warmup_steps >= 0, f"config key 'train.warmup_steps' must be >= 0, got {tr.warmup_steps}")
    require(tr.max_grad_norm is None or tr.max_grad_norm > 0,
            f"config key 'train.max_grad_norm' must be > 0 or null, got {tr.max_grad_norm}")
    require(tr.log_every > 0, f"config key 'train.log_every' must be > 0, got {tr.log_every}")
    require(data.max_length >= 2, f"config key 'data.max_length' must be >= 2, got {data.max_length}")
    require(tr.max_tokens_per_device >= data.max_length,
            f"train.max_tokens_per_device={tr.max_tokens_per_device} cannot hold one row of data.max_length="
            f"{data.max_length}; raise it to at least {data.max_length}")
    require(cfg.eval.every >= 0, "config key 'eval.every' must be >= 0")
    require(cfg.eval.every == 0 or data.eval_path is not None,
            "eval.every is set but data.eval_path is null; give held-out rows in data.eval_path")
    require(cfg.eval.max_new_tokens > 0, "config key 'eval.max_new_tokens' must be > 0")
    require(cfg.trainer.save_every >= 0, "config key 'trainer.save_every' must be >= 0")
    require(cfg.trainer.keep_last >= 0, "config key 'trainer.keep_last' must be >= 0 (0 keeps every checkpoint)")
    require(cfg.trainer.collective_timeout_s > 0, "config key 'trainer.collective_timeout_s' must be > 0")
