"""Directories written whole or not at all: the final export of a job and the offline assets' builds."""

from __future__ import annotations

import contextlib
import os
import shutil
from pathlib import Path
from typing import Iterator


@contextlib.contextmanager
def staged_directory(final: str | Path) -> Iterator[Path]:
    """`with staged_directory(d) as staging:` write into `staging`, which then replaces `d`; when the writing
    stops (an error, a stop signal), `d` stays as it was. A resume takes an existing `final/` for a finished
    export, and a build an existing asset for a built one, so a half-written one must never appear there.

    Called by the one writer of `d` (a build lock, a run directory's lock), so any other staging directory
    beside it is stale (a writer that died) and is removed.
    """
    final = Path(final)
    for stale in final.parent.glob(f".{final.name}.building-*"):
        shutil.rmtree(stale, ignore_errors=True)
    staging = final.with_name(f".{final.name}.building-{os.getpid()}")
    staging.mkdir(parents=True)
    try:
        yield staging
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    if final.exists():  # an earlier one: stopped right here, there is none until the next write
        shutil.rmtree(final)
    staging.rename(final)
