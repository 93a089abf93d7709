"""The real SGLang server on CPU, for the tests that hold both engines to the same behaviour.

`scripts/setup_sglang_cpu.sh` builds `.venv-sglang` (CI does, before the tests); a test that
needs it is skipped with that command as the reason when it is absent, so a plain run of the
suite still works on a machine without it (under CI=true it fails instead). `RL_CORE_SGLANG_PYTHON` points at another build.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
ENGINE_KINDS = ("embedded", "sglang")
# A request line in an engine log: uvicorn's access log (SGLang) and the embedded engine's
# aiohttp access log share this shape.
ACCESS_LINE = re.compile(r'"(GET|POST|PUT) (/[\w/]*)\S* HTTP/1\.1" (\d{3})')
# What the job asks of its own engine, in order. Health and info polls come from the router and
# the launcher on their own clocks, and /generate from the rollout, so they are left out.
CONTROL_PATHS = {"/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
                 "/update_weights_from_tensor", "/end_weight_update", "/pause_generation", "/continue_generation",
                 "/flush_cache"}


def sglang_python() -> str | None:
    path = os.environ.get("RL_CORE_SGLANG_PYTHON") or str(REPO / ".venv-sglang" / "bin" / "python")
    return path if os.path.isfile(path) else None


def require_sglang_python() -> str:
    python = sglang_python()
    if python is None:
        reason = "real SGLang on CPU is not built here: run 'bash scripts/setup_sglang_cpu.sh'"
        if os.environ.get("CI"):  # CI builds it first: a missing build there is a failure, not a skip
            pytest.fail(reason)
        pytest.skip(reason)
    return python


def engine_calls(log_text: str, paths: set[str] | None = None) -> list[tuple[str, str, int]]:
    """(method, path, status) of every request an engine logged, in order (only `paths` if given)."""
    calls = [(m.group(1), m.group(2), int(m.group(3))) for m in ACCESS_LINE.finditer(log_text)]
    return [call for call in calls if paths is None or call[1] in paths]
