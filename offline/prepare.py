"""The recipes' offline names ("tiny", "tiny-arithmetic", "tiny-tools-arithmetic", "tiny-vision-shapes", ...)
turned into paths before a job starts.

The entry points (`rl_core/train.py`, `rl_core/train_rm.py`) run this on every rank before any
process group exists (`rl_core.distributed.prepare_before_process_group`): what is missing is
built once on each node (minutes on a CPU, the first time only), and the jobs themselves only
ever see real paths. Paths the user gave are checked first, so a typo costs seconds, not a build.
"""

from __future__ import annotations

from typing import Callable

from offline import ARITHMETIC, ARITHMETIC_TEACHER, CHAT_ARITHMETIC, TOOLS_ARITHMETIC, TOOLS_ARITHMETIC_SFT
from offline.vision_shapes import VISION_SHAPES
from rl_core.offline_names import check_model_paths

Log = Callable[[str], None]
# The offline names that name a policy, each a Hugging Face model directory any model key may be given.
MODEL_NAMES = ("tiny", ARITHMETIC, ARITHMETIC_TEACHER, TOOLS_ARITHMETIC, VISION_SHAPES)


def offline_model_path(value, log: Log, progress: bool = False):
    """The model directory an offline policy name (MODEL_NAMES) names, built if missing; any other value
    (a path, a hub name, None) unchanged. "tiny" is the tiny sentiment policy here (the reward-model keys
    give it another meaning and resolve it themselves)."""
    if value == "tiny":
        from offline.assets import ensure_tiny_assets

        return str(ensure_tiny_assets(log=log, progress=progress).model_dir)
    if value == ARITHMETIC:
        from offline.arithmetic import ensure_arithmetic_assets

        return str(ensure_arithmetic_assets(log=log).model_dir)
    if value == ARITHMETIC_TEACHER:
        from offline.arithmetic_teacher import ensure_arithmetic_teacher

        return str(ensure_arithmetic_teacher(log=log))
    if value == TOOLS_ARITHMETIC:
        from offline.tools_arithmetic import ensure_tools_arithmetic_assets

        return str(ensure_tools_arithmetic_assets(log=log).model_dir)
    if value == VISION_SHAPES:
        from offline.vision_shapes import ensure_vision_shapes_assets

        return str(ensure_vision_shapes_assets(log=log).model_dir)
    return value


def resolve_model_key(cfg, key: str, log: Log, progress: bool = False) -> None:
    """`cfg`'s model path at the dotted `key` ("model.path", "distill.teacher_path", ...) resolved in place:
    an offline policy name replaced by its built directory (`offline_model_path`), anything else kept."""
    *sections, name = key.split(".")
    owner = cfg
    for section in sections:
        owner = getattr(owner, section)
    setattr(owner, name, offline_model_path(getattr(owner, name), log, progress))


def resolve_ppo_assets(cfg, log: Log):
    """A PPO config whose model, reward-model and data paths name no offline asset any more."""
    check_model_paths(cfg, "ppo", MODEL_NAMES)
    if cfg.model.path == ARITHMETIC_TEACHER:  # the distillation teacher as a policy (its own GRPO run, say)
        resolve_model_key(cfg, "model.path", log)
    resolve_model_key(cfg, "distill.teacher_path", log)  # any offline policy may teach (configs/opd_arithmetic.yaml)
    named = (cfg.model.path, cfg.reward.model_path, cfg.data.train_path, cfg.data.eval_path)
    if "tiny" in named:
        from offline.assets import ensure_tiny_assets

        tiny = ensure_tiny_assets(log=log, progress=cfg.trainer.progress)
        cfg.model.path = str(tiny.model_dir) if cfg.model.path == "tiny" else cfg.model.path
        cfg.data.train_path = str(tiny.train_prompts) if cfg.data.train_path == "tiny" else cfg.data.train_path
        cfg.data.eval_path = str(tiny.test_prompts) if cfg.data.eval_path == "tiny" else cfg.data.eval_path
        if cfg.reward.model_path == "tiny":
            from offline.reward_model import ensure_tiny_reward_model

            cfg.reward.model_path = str(ensure_tiny_reward_model(tiny, log=log, progress=cfg.trainer.progress))
    if ARITHMETIC in named:
        from offline.arithmetic import ensure_arithmetic_assets

        arithmetic = ensure_arithmetic_assets(log=log)
        cfg.model.path = str(arithmetic.model_dir) if cfg.model.path == ARITHMETIC else cfg.model.path
        cfg.data.train_path = str(arithmetic.train_file) if cfg.data.train_path == ARITHMETIC else cfg.data.train_path
        cfg.data.eval_path = str(arithmetic.eval_file) if cfg.data.eval_path == ARITHMETIC else cfg.data.eval_path
    if CHAT_ARITHMETIC in named:
        from offline.chat_arithmetic import ensure_chat_arithmetic

        chat = ensure_chat_arithmetic(log=log)
        cfg.data.train_path = str(chat.train_file) if cfg.data.train_path == CHAT_ARITHMETIC else cfg.data.train_path
        cfg.data.eval_path = str(chat.eval_file) if cfg.data.eval_path == CHAT_ARITHMETIC else cfg.data.eval_path
    if TOOLS_ARITHMETIC in named:
        from offline.tools_arithmetic import ensure_tools_arithmetic_assets

        tools = ensure_tools_arithmetic_assets(log=log)
        cfg.model.path = str(tools.model_dir) if cfg.model.path == TOOLS_ARITHMETIC else cfg.model.path
        cfg.data.train_path = str(tools.train_file) if cfg.data.train_path == TOOLS_ARITHMETIC else cfg.data.train_path
        cfg.data.eval_path = str(tools.eval_file) if cfg.data.eval_path == TOOLS_ARITHMETIC else cfg.data.eval_path
    if VISION_SHAPES in named:
        from offline.vision_shapes import ensure_vision_shapes_assets

        shapes = ensure_vision_shapes_assets(log=log)
        cfg.model.path = str(shapes.model_dir) if cfg.model.path == VISION_SHAPES else cfg.model.path
        cfg.data.train_path = str(shapes.train_file) if cfg.data.train_path == VISION_SHAPES else cfg.data.train_path
        cfg.data.eval_path = str(shapes.eval_file) if cfg.data.eval_path == VISION_SHAPES else cfg.data.eval_path
    return cfg


def resolve_rm_assets(cfg, log: Log):
    """A reward-model config whose policy, preference and prompt paths name no offline asset any more."""
    check_model_paths(cfg, "rm", ("tiny",))
    if "tiny" not in (cfg.model.policy_path, cfg.data.train_path, cfg.normalize.prompts_path):
        return cfg
    from offline.assets import ensure_tiny_assets
    from offline.reward_model import ensure_tiny_preferences, preference_files

    tiny = ensure_tiny_assets(log=log, progress=cfg.trainer.progress)
    if cfg.data.train_path == "tiny":
        ensure_tiny_preferences(tiny, cfg.labeler.name, log, noise=cfg.labeler.noise, progress=cfg.trainer.progress)
        train, test, _ = preference_files(tiny, cfg.labeler.name)
        cfg.data.train_path = str(train)
        cfg.data.test_path = str(test) if cfg.data.test_path == "tiny" else cfg.data.test_path
    cfg.model.policy_path = str(tiny.model_dir) if cfg.model.policy_path == "tiny" else cfg.model.policy_path
    if cfg.normalize.prompts_path == "tiny":
        cfg.normalize.prompts_path = str(tiny.train_prompts)
    return cfg


# --- the shipped assets ------------------------------------------------------------------------
# The repository ships what the recipes need, built by this code, so a fresh clone trains in
# seconds instead of building for minutes. `scripts/bootstrap_assets.py --check` rebuilds them
# from scratch and compares every file with checksums.json.

SUMS_FILE = "checksums.json"  # sha256 by relative path


def build_all(root, log: Log, progress: bool = False, small: bool = False):
    """Every asset the recipes name, built (or reused) under `root`: tiny policy, prompts,
    sentiment preferences and reward model, arithmetic policy, problems and SFT rows, the tool-calling
    policy, its problems and SFT rows, the arithmetic distillation teacher, the released-model recipe's questions,
    the vision recipe's pictures and policy (`small`: the tests' quick versions)."""
    from offline.arithmetic import ensure_arithmetic_assets, ensure_arithmetic_sft_data
    from offline.arithmetic_teacher import ensure_arithmetic_teacher
    from offline.assets import ensure_tiny_assets
    from offline.chat_arithmetic import ensure_chat_arithmetic
    from offline.reward_model import ensure_tiny_reward_model
    from offline.tools_arithmetic import ensure_tools_arithmetic_assets
    from offline.vision_shapes import ensure_vision_shapes_assets

    tiny = ensure_tiny_assets(root, small=small, log=log, progress=progress)
    ensure_tiny_reward_model(tiny, log=log, small=small, progress=progress)
    ensure_arithmetic_assets(root, small=small, log=log)
    ensure_arithmetic_sft_data(root, small=small, log=log)
    ensure_arithmetic_teacher(root, small=small, log=log)  # the arithmetic policy fine-tuned on slip-free rows
    ensure_tools_arithmetic_assets(root, small=small, log=log)  # built last: it fine-tunes the arithmetic policy
    ensure_chat_arithmetic(root, log=log)  # questions only: the released-model recipe's model is SmolLM2's
    ensure_vision_shapes_assets(root, small=small, log=log)  # a tiny Qwen2.5-VL and its pictures
    return tiny


def asset_digests(root) -> dict[str, str]:
    """sha256 of every built file under `root`, by relative path. Lock and staging files (dot
    names) are not assets; a build.json is hashed without its wall-clock `seconds`."""
    import hashlib
    import json
    from pathlib import Path

    root = Path(root)
    digests = {}
    for path in sorted(root.rglob("*")):
        relative = path.relative_to(root)
        if not path.is_file() or any(part.startswith(".") for part in relative.parts) or path.name == SUMS_FILE:
            continue
        data = path.read_bytes()
        if (path.name.endswith(".json") and "build" in path.name) or path.name == "assets.json":
            data = json.dumps(_without_timings(json.loads(data)), sort_keys=True).encode()
        digests[str(relative)] = hashlib.sha256(data).hexdigest()
    return digests


def _without_timings(value):
    if isinstance(value, dict):
        return {k: _without_timings(v) for k, v in value.items() if k != "seconds"}
    return value


def resolve_sft_assets(cfg, log: Log):
    """An SFT config whose model, tokenizer and data paths name no offline asset any more."""
    from offline.arithmetic import ARITHMETIC_SFT

    check_model_paths(cfg, "sft", ("tiny", ARITHMETIC, ARITHMETIC_TEACHER, ARITHMETIC_SFT, TOOLS_ARITHMETIC_SFT))
    if cfg.model.path == ARITHMETIC_TEACHER:  # the distillation teacher, fine-tuned further
        resolve_model_key(cfg, "model.path", log)
    if cfg.model.path == ARITHMETIC:  # the arithmetic chat policy, fine-tuned further (sft_tools_arithmetic.yaml)
        from offline.arithmetic import ensure_arithmetic_assets

        cfg.model.path = str(ensure_arithmetic_assets(log=log).model_dir)
    if "tiny" in (cfg.model.path, cfg.model.tokenizer_path):
        from offline.assets import ensure_tiny_assets

        tiny = ensure_tiny_assets(log=log, progress=cfg.trainer.progress)
        cfg.model.path = str(tiny.model_dir) if cfg.model.path == "tiny" else cfg.model.path
        cfg.model.tokenizer_path = str(tiny.model_dir) if cfg.model.tokenizer_path == "tiny" else cfg.model.tokenizer_path
    if ARITHMETIC_SFT in (cfg.model.tokenizer_path, cfg.data.train_path, cfg.data.eval_path):
        from offline.arithmetic import ensure_arithmetic_sft_data

        data = ensure_arithmetic_sft_data(log=log)
        if cfg.model.tokenizer_path == ARITHMETIC_SFT:
            cfg.model.tokenizer_path = str(data / "tokenizer")
        cfg.data.train_path = str(data / "train.jsonl") if cfg.data.train_path == ARITHMETIC_SFT else cfg.data.train_path
        cfg.data.eval_path = str(data / "eval.jsonl") if cfg.data.eval_path == ARITHMETIC_SFT else cfg.data.eval_path
    if TOOLS_ARITHMETIC_SFT in (cfg.model.tokenizer_path, cfg.data.train_path, cfg.data.eval_path):
        from offline.tools_arithmetic import ensure_tools_arithmetic_sft_data

        data = ensure_tools_arithmetic_sft_data(log=log)
        if cfg.model.tokenizer_path == TOOLS_ARITHMETIC_SFT:
            cfg.model.tokenizer_path = str(data / "tokenizer")
        for key in ("train_path", "eval_path"):
            if getattr(cfg.data, key) == TOOLS_ARITHMETIC_SFT:
                setattr(cfg.data, key, str(data / f"{key.split('_')[0]}.jsonl"))
    return cfg


def resolve_dpo_assets(cfg, log: Log):
    """A DPO config whose policy, preference and reward-model paths name no offline asset any more:
    "tiny" is the tiny policy, its sentiment preferences and the tiny sentiment reward model."""
    check_model_paths(cfg, "dpo", ("tiny",))
    named = (cfg.model.path, cfg.model.tokenizer_path, cfg.model.reference_path, cfg.data.train_path,
             cfg.data.test_path, cfg.eval.reward_model_path)
    if "tiny" not in named:
        return cfg
    from offline.assets import ensure_tiny_assets
    from offline.reward_model import ensure_tiny_preferences, ensure_tiny_reward_model, preference_files

    tiny = ensure_tiny_assets(log=log, progress=cfg.trainer.progress)
    for section, key in (("model", "path"), ("model", "tokenizer_path"), ("model", "reference_path")):
        if getattr(getattr(cfg, section), key) == "tiny":
            setattr(getattr(cfg, section), key, str(tiny.model_dir))
    if "tiny" in (cfg.data.train_path, cfg.data.test_path):
        ensure_tiny_preferences(tiny, "sentiment", log, progress=cfg.trainer.progress)
        train, test, _ = preference_files(tiny, "sentiment")
        cfg.data.train_path = str(train) if cfg.data.train_path == "tiny" else cfg.data.train_path
        cfg.data.test_path = str(test) if cfg.data.test_path == "tiny" else cfg.data.test_path
    if cfg.eval.reward_model_path == "tiny":
        cfg.eval.reward_model_path = str(ensure_tiny_reward_model(tiny, log=log, progress=cfg.trainer.progress))
    return cfg
