"""Loading what a config names by import path: env classes, reward functions."""

from __future__ import annotations

import importlib
from typing import Any


def load_by_path(import_path: Any, what: str, example: str) -> Any:
    """The object at "pkg.module:name" (or "pkg.module.name"), or one line saying what is wrong.

    `what` and `example` name the kind of object in the message, e.g. "env class",
    "envs.sentiment:SentimentEnv"; the caller checks that the object is of that kind.
    """
    if not isinstance(import_path, str) or not import_path.strip():
        raise ValueError(f"{what} path must be a non-empty string like {example!r}, got {import_path!r}")
    module_name, sep, name = import_path.partition(":")
    if not sep:
        module_name, _, name = import_path.rpartition(".")
    if not module_name or not name:
        raise ValueError(f"{what} path {import_path!r} must look like 'pkg.module:name' (e.g. {example!r})")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ImportError(f"cannot import module {module_name!r} for {what} {import_path!r}: {err}. "
                          "Check the spelling and that the package is installed or on PYTHONPATH.") from err
    if not hasattr(module, name):
        raise ImportError(f"module {module_name!r} has no attribute {name!r} ({what} {import_path!r})")
    return getattr(module, name)
