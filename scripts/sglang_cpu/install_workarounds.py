"""Apply the CPU workarounds SGLang 0.5.23 needs (1, 2) or is slow without (3) to the running Python environment.

1. torchvision: the launcher imports it, and the only torchvision 0.28 on the package index is
   linked against CUDA, so its operator registrations fail on CPU torch ("operator
   torchvision::nms does not exist"). SGLang needs none of its operators for text models: import
   the two registration modules only when torchvision's compiled ops did load.
2. sgl_kernel: install the pure-torch stand-in (scripts/sglang_cpu/sgl_kernel) into site-packages.
3. Start-up: the launcher starts its scheduler and detokenizer with multiprocessing's "spawn", so each
   imports SGLang again: 9 s of a 20 s start on 2 cores. Spawn is there for CUDA (a forked child
   cannot initialise it); under SGLANG_USE_CPU_ENGINE=1 the launcher forks them instead (10-11 s to
   ready). At that point the launcher's only threads are ZeroMQ's (checked): no OpenMP pool is forked.
   Start-up only: the children run the same code on the same arguments.

Run by scripts/setup_sglang_cpu.sh with the environment's own python. Idempotent.
"""

import shutil
import sys
import sysconfig
from pathlib import Path

HERE = Path(__file__).resolve().parent
ORIGINAL = """from torchvision import (
    _autograd_registrations,
    _meta_registrations,
    datasets,"""
SPAWN = '    mp.set_start_method("spawn", force=True)\n'
CPU_FORK = ('    # rl_core (scripts/sglang_cpu): on CPU, fork the scheduler and detokenizer (spawn re-imports SGLang).\n'
            '    mp.set_start_method("fork" if os.environ.get("SGLANG_USE_CPU_ENGINE") == "1" else "spawn", force=True)\n')
GUARDED = """# rl_core (scripts/sglang_cpu): register meta/autograd kernels only when the compiled ops loaded.
if extension._has_ops():
    from torchvision import _autograd_registrations, _meta_registrations  # noqa: F401
from torchvision import (
    datasets,"""


def main() -> int:
    site = Path(sysconfig.get_paths()["purelib"])
    init = site / "torchvision" / "__init__.py"
    if not init.is_file():
        print(f"install_workarounds: torchvision is not installed in {site}", file=sys.stderr)
        return 1
    text = init.read_text()
    if GUARDED not in text:
        if ORIGINAL not in text:
            print(f"install_workarounds: {init} does not look like torchvision 0.28's; "
                  "the import guard cannot be applied", file=sys.stderr)
            return 1
        init.write_text(text.replace(ORIGINAL, GUARDED, 1))
    engine = site / "sglang" / "srt" / "entrypoints" / "engine.py"
    text = engine.read_text()
    if CPU_FORK not in text:
        if text.count(SPAWN) != 1 or "\nimport os\n" not in text:
            print(f"install_workarounds: {engine} does not look like SGLang 0.5.23's; "
                  "the start-up workaround cannot be applied", file=sys.stderr)
            return 1
        engine.write_text(text.replace(SPAWN, CPU_FORK, 1))
    target = site / "sgl_kernel"
    shutil.rmtree(target, ignore_errors=True)
    shutil.copytree(HERE / "sgl_kernel", target, ignore=shutil.ignore_patterns("__pycache__"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
