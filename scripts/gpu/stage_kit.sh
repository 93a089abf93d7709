#!/usr/bin/env bash
# On a machine with the package index: fetch the offline SGLang 0.5.17 kit and the TRL 1.16.0 wheel, and
# split them into .gpu_kit/part1..N (git-ignored), each small enough to travel beside the repository in one
# device call (a call carries at most 64 MiB, the repository's own files included; scripts/gpu/README.md).
# The kit's own fetch.sh does the fetching; its install.sh (in every part) checks each file's sha256. py-spy,
# for run.sh's profile of the SGLang server, comes from the package index.
#   bash scripts/gpu/stage_kit.sh [SHARED_GPU_DIR]     (default: ../shared/gpu beside the checkout)
set -euo pipefail
cd "$(dirname "$0")/../.."
shared=${1:-../shared/gpu}
[ -f "$shared/sglang-0.5.17-h100/fetch.sh" ] || { echo "stage_kit.sh: no kit at $shared/sglang-0.5.17-h100; pass the folder that holds it"; exit 2; }
[ -d .gpu_kit/fetched ] || bash "$shared/sglang-0.5.17-h100/fetch.sh" .gpu_kit/fetched
# py-spy (a sampling profiler, one static binary): run.sh records the SGLang server's processes with it
[ -n "$(ls .gpu_kit/tools/py_spy-*.whl 2>/dev/null)" ] || python3 -m pip download -q --no-deps --only-binary=:all: \
  -d .gpu_kit/tools py-spy==0.4.3
rm -rf .gpu_kit/part*
python3 - "$shared" <<'PY'
# First-fit decreasing: the call limit less what the repository itself sends (tracked and untracked,
# not ignored), less 1 MiB of slack, is what each part may hold.
import os, shutil, subprocess, sys
from pathlib import Path

listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                        capture_output=True, text=True, check=True).stdout.split("\0")
repo_bytes = sum(os.path.getsize(f) for f in listed if f and os.path.isfile(f))
room = 64 * 2**20 - repo_bytes - 2**20
files = [p for p in Path(".gpu_kit/fetched").glob("chunk*/*") if p.suffix in (".whl", ".gz")]
files += list(Path(sys.argv[1], "trl").glob("trl-*.whl")) + list(Path(".gpu_kit/tools").glob("py_spy-*.whl"))
files.sort(key=lambda p: p.stat().st_size, reverse=True)
if files[0].stat().st_size > room:
    sys.exit(f"stage_kit.sh: {files[0].name} ({files[0].stat().st_size >> 20} MiB) does not fit beside the "
             f"repository ({repo_bytes >> 20} MiB) in one 64 MiB call; make the repository smaller")
parts: list[list[Path]] = []
for f in files:
    part = next((p for p in parts if sum(x.stat().st_size for x in p) + f.stat().st_size <= room), None)
    if part is None:
        part = []
        parts.append(part)
    part.append(f)
installer = next(Path(".gpu_kit/fetched").glob("chunk*/install.sh"))
for i, part in enumerate(parts, 1):
    dest = Path(f".gpu_kit/part{i}")
    dest.mkdir(parents=True)
    for f in part + [installer]:
        shutil.copy(f, dest / f.name)
    print(f"part{i}: {sum(x.stat().st_size for x in part) >> 20} MiB, {len(part)} files")
print(f"{len(parts)} parts; each travels beside {repo_bytes >> 20} MiB of repository (limit 64 MiB a call)")
PY
