"""The reward-model job's configuration (same machinery and `trainer.*` section as the PPO job)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from rl_core.config import (ModelRunConfig, OptimizerConfig, TrainerConfig, choice, require,
                            validate_checkpoint_keys, validate_profile_steps)
from rl_core.optim import OPTIMIZER_NAMES
from rl_core.preferences import FORMATS

LABELER_NAMES = (None, "sentiment", "descriptiveness")


@dataclass
class RMModelConfig(ModelRunConfig):
    # Reference policy: its tokenizer, and the sampler for reward normalisation. "tiny" = assets policy.
    policy_path: str = "tiny"
    # Starting weights: null = policy_path; any HF causal LM (fresh head) or seq-cls checkpoint (kept head).
    init_from: Optional[str] = None


@dataclass
class RMDataConfig:
    # "tiny" = offline labels (policy samples judged by the labeler), built if missing; otherwise a
    # local .jsonl/.json/.csv/.parquet file or a hub dataset.
    train_path: str = "tiny"
    # "tiny" goes with a tiny train set; null = hold out heldout_fraction of the train file.
    test_path: Optional[str] = "tiny"
    heldout_fraction: float = 0.1  # with test_path null: the share of train rows held out
    format: str = choice("auto", ("auto", *FORMATS))  # pairwise, llama2 or openai; auto = found from the columns
    margin_map: Optional[dict] = None  # LLaMA-2 prefer_degree -> margin; null = margins off
    max_length: int = 128  # prompt + response tokens per row
    on_malformed: str = choice("error", ("error", "skip"))  # a malformed row stops the job, or is skipped and counted


@dataclass
class RMTrainConfig(OptimizerConfig):
    """The reward model's training; its optimizer keys are every job's (`rl_core.config.OptimizerConfig`), with
    OpenAI's defaults: Adam, epsilon 1e-5, no gradient clipping."""
    batch_size: int = 32  # comparisons per optimizer step
    lr: float = 5e-5  # annealed linearly to zero over the epoch
    optimizer: str = choice("adam", OPTIMIZER_NAMES)  # tf_adam = TensorFlow's epsilon placement
    adam_eps: float = 1e-5  # Adam epsilon
    max_grad_norm: Optional[float] = None  # gradient clipping; null = none
    max_tokens_per_device: int = 4096  # real tokens per micro-batch (a comparison's responses stay together)
    packing: bool = False  # padding-free micro-batches (workers.layout.pack): the same loss, less compute
    log_every: int = 10  # steps between metrics lines


@dataclass
class NormalizeConfig:
    # Queries the reference policy continues: "tiny" = assets train prompts, else a prompt file with text_key.
    prompts_path: str = "tiny"
    text_key: str = "text"  # the prompt column of prompts_path
    num_samples: int = 256  # reference-policy samples the gain and bias are fitted on
    query_length: int = 64  # query tokens
    response_length: int = 24  # tokens sampled per query
    temperature: float = 1.0  # sampling temperature
    batch_size: int = 64  # samples generated at a time (scoring runs in train.max_tokens_per_device micro-batches)
    # OpenAI rejection sampling, as the PPO job applies it before scoring: each response is cut at
    # its first truncate_token at/after index truncate_after, and one without it is not scored
    # (PPO gives it a fixed penalty instead). null = score whole responses.
    truncate_token: Optional[str] = "."
    truncate_after: int = 16  # the first index at which truncate_token may cut


@dataclass
class LabelerConfig:
    # Offline rater: labels "tiny" data, and its score is what the reward model's ranking is
    # compared with (Spearman) on fresh samples.
    name: Optional[str] = choice("sentiment", LABELER_NAMES)
    noise: float = 0.0  # flip probability for the offline labels


@dataclass
class RMTrainerConfig(TrainerConfig):
    run_dir: str = "runs/rm_sentiment"
    output_dir: Optional[str] = None  # null = <run_dir>/reward_model
    save_every: int = 0  # training steps between checkpoints (<run_dir>/checkpoints); 0 = none
    keep_last: int = 2  # newest complete checkpoints kept on disk; 0 keeps all
    resume: str = "never"  # never | auto | <checkpoint dir>: continue the epoch from a checkpoint
    # A checkpoint that cannot be written (disk full, permissions): stop the job, or say so and train on.
    on_checkpoint_error: str = choice("stop", ("stop", "continue"))
    # Steps traced by torch.profiler into <run_dir>/profile/step_N/rankR.pt.trace.json (rl_core/profiling.py);
    # within the epoch's steps, which the data sets (checked once it is read).
    profile_steps: list = field(default_factory=list)


@dataclass
class RMConfig:
    model: RMModelConfig = field(default_factory=RMModelConfig)
    data: RMDataConfig = field(default_factory=RMDataConfig)
    train: RMTrainConfig = field(default_factory=RMTrainConfig)
    normalize: NormalizeConfig = field(default_factory=NormalizeConfig)
    labeler: LabelerConfig = field(default_factory=LabelerConfig)
    trainer: RMTrainerConfig = field(default_factory=RMTrainerConfig)


def validate(cfg: RMConfig) -> None:
    """Cross-field rules of the reward-model job; raises ConfigError naming the key and the fix."""
    tr, norm, data = cfg.train, cfg.normalize, cfg.data
    cfg.trainer.validate()
    validate_checkpoint_keys(cfg.trainer.save_every, cfg.trainer.keep_last)
    validate_profile_steps(cfg.trainer.profile_steps, None, "")
    cfg.model.validate(tr.packing)
    require(tr.batch_size > 0, f"config key 'train.batch_size' must be > 0, got {tr.batch_size}")
    tr.validate("train")  # the optimizer keys, as every job checks them
    require(tr.log_every > 0, f"config key 'train.log_every' must be > 0, got {tr.log_every}")
    require(data.max_length >= 2, f"config key 'data.max_length' must be >= 2, got {data.max_length}")
    # A comparison has at least two responses and must fit one micro-batch whole.
    require(tr.max_tokens_per_device >= 2 * data.max_length,
            f"train.max_tokens_per_device={tr.max_tokens_per_device} cannot hold one comparison of two "
            f"rows of data.max_length={data.max_length}; raise it to at least {2 * data.max_length}")
    require(0.0 < data.heldout_fraction < 1.0,
            f"config key 'data.heldout_fraction' must be in (0, 1), got {data.heldout_fraction}")
    require(norm.num_samples >= 2, f"config key 'normalize.num_samples' must be >= 2, got {norm.num_samples}")
    require(norm.query_length > 0, "config key 'normalize.query_length' must be > 0")
    require(norm.response_length > 0, "config key 'normalize.response_length' must be > 0")
    require(norm.temperature > 0, f"config key 'normalize.temperature' must be > 0, got {norm.temperature}")
    require(norm.batch_size > 0, "config key 'normalize.batch_size' must be > 0")
    require(norm.truncate_token is None or 0 <= norm.truncate_after < norm.response_length,
            f"normalize.truncate_after={norm.truncate_after} must be in [0, normalize.response_length="
            f"{norm.response_length}) so a response can hold the truncate token; or set normalize.truncate_token=null")
    require(0.0 <= cfg.labeler.noise <= 1.0,
            f"config key 'labeler.noise' must be a probability in [0, 1], got {cfg.labeler.noise}")
    require(data.train_path != "tiny" or cfg.labeler.name is not None,
            "data.train_path=tiny labels samples offline and needs a labeler; set labeler.name="
            "sentiment or labeler.name=descriptiveness, or point data.train_path at a preference file")
    require(data.test_path != "tiny" or data.train_path == "tiny",
            "data.test_path=tiny is the held-out half of the tiny labels; with your own data.train_path "
            "give a data.test_path file, or null to hold out data.heldout_fraction of the train file")


def check_lengths(cfg: RMConfig, max_positions: int | None) -> None:
    """The model must hold the longest preference row and the longest normalisation sample."""
    if max_positions is None:
        return
    require(cfg.data.max_length <= max_positions,
            f"data.max_length={cfg.data.max_length} exceeds the model's context of {max_positions} "
            f"tokens; set data.max_length<={max_positions}")
    longest = cfg.normalize.query_length + cfg.normalize.response_length
    require(longest <= max_positions,
            f"normalize.query_length + normalize.response_length = {longest} exceeds the model's context "
            f"of {max_positions} tokens; shorten normalize.query_length")
