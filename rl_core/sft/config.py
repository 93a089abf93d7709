"""The supervised fine-tuning job's configuration (same machinery and `trainer.*` section as the other jobs)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_core.config import LoraSettings, ModelRunConfig, choice, require
from rl_core.finetune import FinetuneTrainConfig, FinetuneTrainerConfig, validate_training

SFT_FORMATS = ("messages", "prompt_response")


@dataclass
class SFTModelConfig(ModelRunConfig):
    path: str = "tiny"  # any Hugging Face causal LM; "tiny" = the offline tiny policy
    tokenizer_path: Optional[str] = None  # null = path; the chat template comes from here
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass
class SFTDataConfig:
    # A local .jsonl/.json/.csv/.parquet file or a hub dataset. Rows are either chat `messages`
    # ([{role, content}, ...]; the loss on assistant turns) or a prompt and a response (the loss on
    # the response; a prompt that is a list of messages is rendered with the chat template).
    train_path: str = "tiny-arithmetic-sft"
    eval_path: Optional[str] = None  # held-out rows: loss and token accuracy; null = no evaluation
    format: str = choice("auto", ("auto", *SFT_FORMATS))  # auto = messages when the rows have messages_key
    messages_key: str = "messages"  # the column of chat rows
    prompt_key: str = "prompt"  # the prompt column of prompt/response rows
    response_key: str = "response"  # the response column of prompt/response rows
    max_length: int = 512  # tokens per row
    on_long: str = choice("drop", ("drop", "truncate"))  # a longer row is left out, or cut at max_length
    eval_max_rows: Optional[int] = None  # held-out rows evaluated; null = all
    chat_template_kwargs: dict = field(default_factory=dict)  # to every rendering, e.g. {enable_thinking: false}


@dataclass
class SFTEvalConfig:
    every: int = 0  # steps between evaluations (besides step 0 and the end); 0 = only those two
    # Greedy generation on the eval prompts, scored by a reward function ("pkg.module:fn", called
    # (completion, row) -> float; > 0 counts as correct): eval/accuracy. null = loss and token accuracy only.
    reward_fn: Optional[str] = None
    max_new_tokens: int = 32  # greedy tokens generated per eval row
    generate_rows: int = 200  # eval rows generated for eval/accuracy (greedy decoding is the slow part)


@dataclass
class SFTTrainerConfig(FinetuneTrainerConfig):
    run_dir: str = "runs/sft"


@dataclass
class SFTConfig:
    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: FinetuneTrainConfig = field(default_factory=FinetuneTrainConfig)
    eval: SFTEvalConfig = field(default_factory=SFTEvalConfig)
    trainer: SFTTrainerConfig = field(default_factory=SFTTrainerConfig)


def validate(cfg: SFTConfig) -> None:
    """Cross-field rules of the SFT job; raises ConfigError naming the key and the fix."""
    tr, data = cfg.train, cfg.data
    validate_training(tr, cfg.trainer, cfg.model.lora)
    cfg.model.validate(tr.packing)
    require(data.max_length >= 2, f"config key 'data.max_length' must be >= 2, got {data.max_length}")
    require(tr.max_tokens_per_device >= data.max_length,
            f"train.max_tokens_per_device={tr.max_tokens_per_device} cannot hold one row of data.max_length="
            f"{data.max_length}; raise it to at least {data.max_length}")
    require(cfg.eval.every >= 0, "config key 'eval.every' must be >= 0")
    require(cfg.eval.every == 0 or data.eval_path is not None,
            "eval.every is set but data.eval_path is null; give held-out rows in data.eval_path")
    require(cfg.eval.max_new_tokens > 0, "config key 'eval.max_new_tokens' must be > 0")
