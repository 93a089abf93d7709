"""What one rank's engine serves and how it is launched, for either kind: the one description the launcher
(`launch.py`) and each kind's command line (`embedded/`, `sglang_engine.py`) read. Nothing here imports torch.
"""

from __future__ import annotations

import dataclasses
import json
import os


@dataclasses.dataclass
class EngineSpec:
    """What one rank's engine serves and how it is launched."""
    kind: str  # embedded | sglang
    model_path: str
    dtype: str  # float32 | bfloat16 | float16: the engine's weights
    device: str  # cpu | cuda:N (the rank's device)
    host: str = "127.0.0.1"
    seed: int = 0
    max_batch_size: int = 64
    num_threads: int = 0  # embedded on CPU: torch threads
    tp_size: int = 1
    mem_fraction_static: float = 0.6
    sglang_args: dict = dataclasses.field(default_factory=dict)
    gpu_ids: tuple[int, ...] | None = None  # sglang: the GPUs of this rank's server
    sglang_python: str | None = None  # sglang: the interpreter that runs the server (None: this one)
    # sglang: the context it serves, the one the trainer checks its lengths against (workers.loading.
    # context_length; the embedded engine reads the same from the model). None: SGLang's own derivation,
    # which differs for some configs (it multiplies by a rope-scaling factor, reads other keys first).
    context_length: int | None = None
    # sglang: its KV pool in tokens (max_total_tokens; the job's memory plan), unless sglang_args sets it.
    # The embedded engine grows its cache per decode batch and has no pool to size.
    kv_tokens: int | None = None


def is_vision_language(model_path: str) -> bool:
    """Whether the model at `model_path` (a directory or a cached hub name) is a vision-language one: its
    config.json has a `vision_config`. A model whose config is not to be found counts as text."""
    return "vision_config" in (model_config(model_path) or {})


def model_config(model_path: str) -> dict | None:
    """The config.json of the model an engine serves, as a dict: from its directory, or for a hub name from the
    local hub cache (the trainer has loaded it by then; no request is made). None when neither has it."""
    path = os.path.join(str(model_path), "config.json")
    if not os.path.isfile(path):
        try:
            from huggingface_hub import try_to_load_from_cache

            cached = try_to_load_from_cache(str(model_path), "config.json")
        except Exception:  # noqa: BLE001 - not a repo id either: no config to read
            return None
        if not isinstance(cached, str):
            return None
        path = cached
    with open(path, encoding="utf-8") as handle:
        return json.load(handle)
