"""The offline names a recipe may give instead of a path or hub name, and where they are resolved.

"tiny", "tiny-arithmetic", "tiny-arithmetic-sft", "tiny-arithmetic-teacher", "tiny-tools-arithmetic",
"tiny-tools-arithmetic-sft", "chat-arithmetic" and "tiny-vision-shapes" name the offline assets the repository ships
(`assets/`), which the builders beside this package (`offline/`) build where they are missing. A job's entry point
resolves them before the job starts (every rank, before any process group exists); a config that names none imports no
builder, so the jobs run on real checkpoints without them. The names of a policy (`offline.prepare.MODEL_NAMES`) may
stand for any model path: a job's resolver turns the one at a dotted key into its built directory with
`offline.prepare.resolve_model_key(cfg, "distill.teacher_path", log)`.
"""

from __future__ import annotations

import importlib
from typing import Any, Callable, Iterator

from rl_core.config import to_dict
from workers.gguf import float_checkpoint, is_gguf
from workers.loading import check_model_path

OFFLINE_NAMES = frozenset({"tiny", "tiny-arithmetic", "tiny-arithmetic-sft", "tiny-arithmetic-teacher",
                           "tiny-tools-arithmetic", "tiny-tools-arithmetic-sft", "chat-arithmetic",
                           "tiny-vision-shapes"})
# Each job's builder side: the config with every offline name replaced by the path of what it names.
RESOLVERS = {"ppo": "offline.prepare:resolve_ppo_assets", "sft": "offline.prepare:resolve_sft_assets",
             "dpo": "offline.prepare:resolve_dpo_assets", "rm": "offline.prepare:resolve_rm_assets"}
# The offline raters `labeler.name` names (the reward-model job's fresh-sample check).
LABELERS = "offline.labeler:get_labeler"
# The model paths each job's config gives: checked before anything is built or loaded, so a typo costs seconds.
MODEL_KEYS = {"ppo": ("model.path", "reward.model_path", "model.tokenizer_path", "distill.teacher_path"),
              "sft": ("model.path", "model.tokenizer_path"),
              "dpo": ("model.path", "model.reference_path", "eval.reward_model_path"),
              "rm": ("model.policy_path", "model.init_from")}


def _load(import_path: str) -> Any:
    module, _, name = import_path.partition(":")
    return getattr(importlib.import_module(module), name)


def _strings(value) -> Iterator[str]:
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for item in value.values():
            yield from _strings(item)
    elif isinstance(value, (list, tuple)):
        for item in value:
            yield from _strings(item)


def names_offline_assets(cfg) -> bool:
    """Whether any value of the job's config is an offline name."""
    return not OFFLINE_NAMES.isdisjoint(_strings(to_dict(cfg)))


def check_model_paths(cfg, job: str, offline: tuple[str, ...] = ()) -> None:
    """One line naming the key when a model path `job`'s config gives (other than the `offline` names its
    resolver builds) is not a model directory or hub name."""
    for key in MODEL_KEYS[job]:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if value is not None and value not in offline:
            check_model_path(value, key, need_config=key != "model.tokenizer_path")


def convert_gguf_paths(cfg, job: str, log: Callable[[str], None]) -> None:
    """Each of `job`'s model paths that names a GGUF file (`.gguf`, `pkg://PACKAGE/FILE.gguf`) replaced by its
    float checkpoint, converted once and cached (workers/gguf.py)."""
    for key in MODEL_KEYS[job]:
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if is_gguf(value):
            setattr(getattr(cfg, section), name, float_checkpoint(value, key, log))


def offline_resolver(job: str) -> Callable:
    """`prepare(cfg, log)` for `job` (ppo, sft, dpo, rm): `cfg` with its GGUF model paths converted, its model paths
    checked, and each offline name replaced by the path of what it names (built if missing; `log` reports a build)."""
    def prepare(cfg, log):
        convert_gguf_paths(cfg, job, log)
        if names_offline_assets(cfg):
            return _load(RESOLVERS[job])(cfg, log)  # which checks the paths given beside the names
        check_model_paths(cfg, job)
        return cfg
    return prepare


def offline_labeler(name: str):
    """The offline rater `name` (labeler.name of the reward-model job)."""
    return _load(LABELERS)(name)
