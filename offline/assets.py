"""Offline tiny assets: a byte-level BPE tokenizer, a small pretrained GPT-2 and prompt files.

Nothing here touches a hub. Everything is generated from a seed (`offline/corpus.py`), built once
and cached on disk; real users point `model.path` at `gpt2` or a local checkpoint instead.
These assets exist so the whole framework runs, learns and is tested on a CPU.

Layout under the assets root::

    tiny-gpt2/                      tokenizer + pretrained policy (Hugging Face format), build.json
    prompts/sentiment_train.jsonl   {"text": story opening} rows, build.json
    prompts/sentiment_test.jsonl
    assets.json                     summary of the last build (settings, loss, sizes)

Each component directory is built in a temporary sibling and renamed into place with its
`build.json` (settings + seed) already inside, so a half-built component never looks finished.
"""

from __future__ import annotations

import contextlib
import dataclasses
import fcntl
import json
import math
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable, Iterator

from rl_core.lifecycle import torch_threads  # noqa: F401 - the builders import it from here
from rl_core.staging import staged_directory
from offline.corpus import generate_paragraphs, story_openings

PAD_TOKEN = "[PAD]"
EOS_TOKEN = "<|endoftext|>"
ASSETS_ENV_VAR = "RL_CORE_ASSETS"
MAX_PARAMETERS = 10_000_000
FORMAT_VERSION = 1


@dataclass(frozen=True)
class TinyAssetSettings:
    """Everything that determines the built assets; stored in each component's build.json."""

    seed: int = 1234
    corpus_sentences: int = 40_000
    vocab_size: int = 2048
    n_layer: int = 4
    n_embd: int = 128
    n_head: int = 4
    n_positions: int = 128
    steps: int = 600
    batch_size: int = 16
    seq_len: int = 128
    lr: float = 3e-3
    train_prompts: int = 2000
    test_prompts: int = 200


REAL_SETTINGS = TinyAssetSettings()
# A few seconds on a CPU: enough to exercise every code path in tests, not to write well.
SMALL_SETTINGS = TinyAssetSettings(corpus_sentences=600, vocab_size=400, n_layer=2, n_embd=32,
                                   n_head=2, n_positions=64, steps=12, batch_size=8, seq_len=32,
                                   train_prompts=64, test_prompts=16)


@dataclass(frozen=True)
class AssetPaths:
    """Where the tiny assets live; `built` names the components built by this call."""

    root: Path
    model_dir: Path  # tokenizer and policy together: AutoTokenizer / AutoModelForCausalLM load it
    prompts_dir: Path
    train_prompts: Path
    test_prompts: Path
    summary_file: Path
    built: tuple[str, ...] = ()

    @classmethod
    def under(cls, root: str | Path, built: tuple[str, ...] = ()) -> "AssetPaths":
        root = Path(root)
        prompts = root / "prompts"
        return cls(root=root, model_dir=root / "tiny-gpt2", prompts_dir=prompts,
                   train_prompts=prompts / "sentiment_train.jsonl",
                   test_prompts=prompts / "sentiment_test.jsonl",
                   summary_file=root / "assets.json", built=built)


def default_assets_root() -> Path:
    """`$RL_CORE_ASSETS` if set, else `<repo>/assets` (gitignored)."""
    configured = os.environ.get(ASSETS_ENV_VAR)
    return Path(configured) if configured else Path(__file__).resolve().parents[1] / "assets"


# --- tokenizer and model primitives ----------------------------------------------------------


def train_tokenizer(texts: Iterable[str], out_dir: str | Path, vocab_size: int = 2048):
    """Train a byte-level BPE tokenizer and save it as a Hugging Face fast tokenizer.

    OpenAI detail: the pad token is distinct from EOS (`[PAD]`), so padding never looks like
    the end of a document to the model.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=[EOS_TOKEN, PAD_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        unk_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        padding_side="left",
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    return hf_tokenizer


def init_tiny_gpt2(tokenizer, n_layer: int = 2, n_embd: int = 64, n_head: int = 2,
                   n_positions: int = 128, seed: int = 0):
    """A randomly initialised GPT-2 with dropout off (OpenAI detail: no dropout in RL)."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(seed)
    config = GPT2Config(
        vocab_size=len(tokenizer),
        n_positions=n_positions,
        n_embd=n_embd,
        n_layer=n_layer,
        n_head=n_head,
        resid_pdrop=0.0,
        embd_pdrop=0.0,
        attn_pdrop=0.0,
        bos_token_id=tokenizer.eos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    return GPT2LMHeadModel(config)


def count_parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def pack_documents(tokenizer, texts: list[str]):
    """One long token stream: documents separated (and preceded) by EOS, as in GPT-2 packing."""
    import torch

    eos = tokenizer.eos_token_id
    stream = [eos]
    for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]:
        stream.extend(ids)
        stream.append(eos)
    return torch.tensor(stream, dtype=torch.long)


def _learning_rate(step: int, steps: int, peak: float, warmup: int) -> float:
    """Linear warmup, then cosine decay to zero."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, steps - warmup)
    return peak * 0.5 * (1.0 + math.cos(math.pi * progress))


def pretrain_tiny_gpt2(model, tokenizer, texts: list[str], settings: TinyAssetSettings, num_threads: int = 1,
                       log_every: int = 0, log: Callable[[str], None] = print, progress: bool = False) -> list[float]:
    """Plain PyTorch language-model pretraining on packed text; returns the loss of every step.

    One thread by default, for bytes that do not depend on the machine's load: the weights' last bits follow
    how many threads split each reduction (1, 2 and 3 threads give three different c_attn biases, ~2e-6
    apart), and twice in CI a build under `torch.set_num_threads(2)` differed from another one in exactly that
    way. One thread has one split.

    `settings`: the schedule is read from its `steps`, `batch_size`, `seq_len`, `lr` and `seed` (the model's
    shape is already in `model`). `progress`: a bar with the loss and an ETA (the real build pretrains for
    about three minutes).
    """
    import torch

    from rl_core.logger import progress_bar

    steps, batch_size, seq_len, lr, seed = (settings.steps, settings.batch_size, settings.seq_len, settings.lr,
                                            settings.seed)

    if seq_len > model.config.n_positions:
        raise ValueError(f"seq_len={seq_len} exceeds the model's n_positions="
                         f"{model.config.n_positions}; lower seq_len or raise n_positions")
    stream = pack_documents(tokenizer, texts)
    if len(stream) <= seq_len:
        raise ValueError(f"only {len(stream)} tokens of text for seq_len={seq_len}; give more texts")
    generator = torch.Generator().manual_seed(seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=lr, betas=(0.9, 0.95), weight_decay=0.01)
    warmup = max(1, steps // 20)
    offsets = torch.arange(seq_len)
    losses = []
    model.train()
    bar = progress_bar(total=steps, desc="[offline] pretraining the tiny policy", unit="step", enabled=progress)
    with torch_threads(num_threads), bar:
        for step in range(steps):
            for group in optimizer.param_groups:
                group["lr"] = _learning_rate(step, steps, lr, warmup)
            starts = torch.randint(0, len(stream) - seq_len, (batch_size, 1), generator=generator)
            batch = stream[starts + offsets]
            loss = model(input_ids=batch, labels=batch).loss
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.item())
            bar.update(1)
            bar.set_postfix(loss=f"{loss.item():.3f}", refresh=False)
            if log_every and (step + 1) % log_every == 0:
                log(f"step {step + 1}/{steps} loss {sum(losses[-log_every:]) / log_every:.3f}")
    model.eval()
    return losses


# --- cached build ------------------------------------------------------------------------------


def _component_settings(settings: TinyAssetSettings, component: str) -> dict:
    return {"format": FORMAT_VERSION, "component": component, **dataclasses.asdict(settings)}


# The three pieces of a cached build (also used by the tiny reward model in offline/reward_model.py):
# a marker file written last records the settings, a file lock makes concurrent builders wait,
# and a staging directory is renamed into place only when its build finished.


def settings_match(marker: Path, expected: dict) -> bool:
    """Whether the build marker ``marker`` (JSON with a ``settings`` key) records ``expected``."""
    try:
        return json.loads(marker.read_text()).get("settings") == expected
    except (OSError, json.JSONDecodeError):
        return False


def _is_built(directory: Path, expected: dict) -> bool:
    return settings_match(directory / "build.json", expected)


@contextlib.contextmanager
def _quiet_transformers_progress() -> Iterator[None]:
    """`save_pretrained` draws a progress bar of its own; the build shows only its own bars."""
    from transformers.utils import logging as hf_logging

    was_enabled = hf_logging.is_progress_bar_enabled()
    hf_logging.disable_progress_bar()
    try:
        yield
    finally:
        if was_enabled:
            hf_logging.enable_progress_bar()


def _build_policy(paths: AssetPaths, settings: TinyAssetSettings, progress: bool = False,
                  log: Callable[[str], None] = print) -> dict:
    """Tokenizer + pretrained policy in one directory; returns the facts it recorded."""
    started = time.perf_counter()
    with staged_directory(paths.model_dir) as staging:
        texts = generate_paragraphs(settings.corpus_sentences, seed=settings.seed)
        tokenizer = train_tokenizer(texts, staging, vocab_size=settings.vocab_size)
        model = init_tiny_gpt2(tokenizer, n_layer=settings.n_layer, n_embd=settings.n_embd,
                               n_head=settings.n_head, n_positions=settings.n_positions,
                               seed=settings.seed)
        parameters = count_parameters(model)
        if parameters > MAX_PARAMETERS:
            raise ValueError(f"tiny policy has {parameters:,} parameters (> {MAX_PARAMETERS:,}); "
                             "shrink n_layer/n_embd/vocab_size")
        losses = pretrain_tiny_gpt2(model, tokenizer, texts, settings, progress=progress,
                                    log_every=max(1, settings.steps // 10),  # what a waiting rank shows
                                    log=lambda line: log(f"[offline] pretraining the tiny policy: {line}"))
        with _quiet_transformers_progress():
            model.save_pretrained(staging)
        tail = losses[-max(1, len(losses) // 20):]
        facts = {"parameters": parameters, "vocab_size": len(tokenizer),
                 "final_loss": sum(tail) / len(tail), "first_loss": losses[0],
                 "seconds": round(time.perf_counter() - started, 1)}
        (staging / "build.json").write_text(json.dumps(
            {"settings": _component_settings(settings, "policy"), **facts}, indent=2))
    return facts


def _write_jsonl(path: Path, texts: list[str]) -> None:
    with path.open("w", encoding="utf-8") as handle:
        for text in texts:
            handle.write(json.dumps({"text": text}) + "\n")


def _build_prompts(paths: AssetPaths, settings: TinyAssetSettings) -> dict:
    """Story openings from seeds the pretraining corpus never used (train and test differ too)."""
    with staged_directory(paths.prompts_dir) as staging:
        train = story_openings(settings.train_prompts, seed=settings.seed + 1)
        test = story_openings(settings.test_prompts, seed=settings.seed + 2)
        _write_jsonl(staging / paths.train_prompts.name, train)
        _write_jsonl(staging / paths.test_prompts.name, test)
        facts = {"train_rows": len(train), "test_rows": len(test)}
        (staging / "build.json").write_text(json.dumps(
            {"settings": _component_settings(settings, "prompts"), **facts}, indent=2))
    return facts


@contextlib.contextmanager
def file_lock(path: Path) -> Iterator[None]:
    """Exclusive lock on ``path``: concurrent ranks/jobs wait here instead of building twice."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _missing_components(paths: AssetPaths, settings: TinyAssetSettings) -> list[str]:
    missing = []
    if not _is_built(paths.model_dir, _component_settings(settings, "policy")):
        missing.append("policy")
    if not _is_built(paths.prompts_dir, _component_settings(settings, "prompts")):
        missing.append("prompts")
    return missing


def ensure_tiny_assets(root: str | Path | None = None, *, small: bool = False,
                       force: bool = False, seed: int | None = None,
                       log: Callable[[str], None] = print, progress: bool = True) -> AssetPaths:
    """Build whatever tiny asset is missing or stale under `root`; return where they are.

    Idempotent and safe to call from every rank at once: the first caller builds under a file
    lock (about 2-3 minutes on 2 CPU cores for the real assets, shown with a progress bar when
    `progress`), the others wait and reuse it.
    """
    settings = SMALL_SETTINGS if small else REAL_SETTINGS
    if seed is not None:
        settings = dataclasses.replace(settings, seed=seed)
    paths = AssetPaths.under(Path(root) if root is not None else default_assets_root())
    if not force and not _missing_components(paths, settings):
        return paths
    with file_lock(paths.root / ".build.lock"):
        missing = ["policy", "prompts"] if force else _missing_components(paths, settings)
        if not missing:  # another process built them while we waited for the lock
            return paths
        kind = "small test" if small else "tiny offline"
        log(f"[offline] building {kind} assets ({', '.join(missing)}) under {paths.root} "
            f"with seed {settings.seed}; cached for later runs")
        if "policy" in missing:
            _build_policy(paths, settings, progress, log)
        if "prompts" in missing:
            _build_prompts(paths, settings)
        _write_summary(paths, settings, small)
    return dataclasses.replace(paths, built=tuple(missing))


def _write_summary(paths: AssetPaths, settings: TinyAssetSettings, small: bool) -> None:
    """assets.json: the settings and every component's recorded facts, in one place."""
    summary = {"settings": dataclasses.asdict(settings), "small": small}
    for name, directory in (("policy", paths.model_dir), ("prompts", paths.prompts_dir)):
        facts = json.loads((directory / "build.json").read_text())
        facts.pop("settings")
        summary[name] = facts
    paths.summary_file.write_text(json.dumps(summary, indent=2))


def read_build_facts(paths: AssetPaths) -> dict:
    """The facts recorded when the policy was built (parameters, final loss, seconds)."""
    return json.loads((paths.model_dir / "build.json").read_text())
