"""setup.cfg admits transformers from 5.12 (the version SGLang 0.5.17 pins): the embedded engine, whose KV
cache implements transformers' cache-layer interface, the packed model inputs and the trainer's decoder (which
pass the KV cache by 5.12's keyword there) must work there too.
`scripts/setup_env.sh` puts transformers 5.12.1 in `.venv-floor`; these tests run on it in a subprocess."""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
FLOOR_DIR = REPO / ".venv-floor"
FLOOR = "5.12.1"


def floor_env() -> dict[str, str]:
    if not (FLOOR_DIR / "transformers").is_dir():
        pytest.fail(f"{FLOOR_DIR} lacks transformers {FLOOR}: run 'bash scripts/setup_env.sh' (it installs it there)")
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(FLOOR_DIR), str(REPO)])}


def test_setup_cfg_admits_the_version_tested_here():
    floor = re.search(r"^\s*transformers>=([\d.]+)\s*$", (REPO / "setup.cfg").read_text(), re.M)
    assert floor is not None and FLOOR.startswith(floor.group(1) + "."), floor


@pytest.mark.timeout(600)
def test_engine_and_packing_tests_pass_on_the_oldest_transformers():
    env = floor_env()
    version = subprocess.run([sys.executable, "-c", "import transformers; print(transformers.__version__)"],
                             env=env, capture_output=True, text=True, check=True).stdout.strip()
    assert version == FLOOR
    tests = ["tests/workers/test_engine_runner.py", "tests/workers/test_packing.py", "tests/workers/test_decode.py"]
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", *tests], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=560)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", proc.stdout) and "skipped" not in proc.stdout
