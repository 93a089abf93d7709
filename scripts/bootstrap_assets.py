"""Build the offline assets the recipes name, or check that the shipped ones are what the code builds.

    python scripts/bootstrap_assets.py [--root DIR] [--force]   # build what is missing (or everything)
    python scripts/bootstrap_assets.py --check                  # rebuild from scratch, compare with checksums.json
    python scripts/bootstrap_assets.py --write-sums             # after a rebuild you mean to ship

The repository ships `assets/` (tiny policy and tokenizer, sentiment prompts, preferences and
reward model, the arithmetic chat policy and problems, the tool-calling policy and problems, the vision recipe's tiny
Qwen2.5-VL and pictures; about 39 MB), built by this project's code
(`offline/`), so a fresh clone trains at once. `--check` rebuilds all of it in a temporary
directory (about 25 minutes on 2 cores, half of it the tool-calling policy's fine-tuning) and compares every file's sha256 with
`assets/checksums.json`; the builds fix their seeds and thread counts, so the same torch build on
the same kind of CPU reproduces them bit for bit (another CPU or torch may round differently, a
config.json records the transformers version that wrote it, and the check says which files differ).
The tiny policy, the preferences, the reward model, the tool-calling and the vision policies build on one thread, whose
results no load can change; the arithmetic policy's fine-tuning runs on two, where reductions split
otherwise between threads (seen twice in CI for the tiny policy when it pretrained on two) would change
the last bits.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from offline.assets import default_assets_root  # noqa: E402
from offline.prepare import SUMS_FILE, asset_digests, build_all  # noqa: E402


def check(root: Path, keep: bool) -> int:
    shipped = json.loads((root / SUMS_FILE).read_text())
    scratch = Path(tempfile.mkdtemp(prefix="rl_core_assets_check_"))
    try:
        started = time.perf_counter()
        build_all(scratch, log=print, progress=False)
        print(f"rebuilt every asset under {scratch} in {time.perf_counter() - started:.0f} s")
        rebuilt = asset_digests(scratch)
    finally:
        if not keep:
            shutil.rmtree(scratch, ignore_errors=True)
    different = sorted(name for name in shipped if rebuilt.get(name) != shipped[name])
    extra = sorted(set(rebuilt) - set(shipped))
    for name in different:
        print(f"DIFFERENT  {name}" if name in rebuilt else f"MISSING    {name}")
    for name in extra:
        print(f"NOT SHIPPED {name}")
    same = len(shipped) - len(different)
    print(json.dumps({"files": len(shipped), "identical": same, "different": len(different), "not_shipped": len(extra)}))
    return 0 if not different and not extra else 1


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=None, help="assets directory (default: $RL_CORE_ASSETS or <repo>/assets)")
    parser.add_argument("--force", action="store_true", help="rebuild everything under --root, shipped or not")
    parser.add_argument("--check", action="store_true", help="rebuild in a temporary directory and compare with checksums.json")
    parser.add_argument("--keep", action="store_true", help="with --check: keep the rebuilt directory")
    parser.add_argument("--write-sums", action="store_true", help="write checksums.json for what is under --root")
    args = parser.parse_args()
    root = args.root or default_assets_root()
    if args.check:
        sys.exit(check(root, args.keep))
    if args.force:
        for child in root.iterdir() if root.exists() else ():
            if child.name != SUMS_FILE:
                shutil.rmtree(child) if child.is_dir() else child.unlink()
    if not args.write_sums or args.force:
        started = time.perf_counter()
        build_all(root, log=print, progress=True)
        print(f"assets under {root} ready in {time.perf_counter() - started:.0f} s")
    if args.write_sums:
        digests = asset_digests(root)
        (root / SUMS_FILE).write_text(json.dumps(digests, indent=1, sort_keys=True) + "\n")
        print(f"{root / SUMS_FILE}: {len(digests)} files")


if __name__ == "__main__":
    main()
