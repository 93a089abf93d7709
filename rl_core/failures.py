"""How a failure is told: which errors are the user's to fix (their message alone), which only follow another
rank's, and the one line each ends a job with, in the log and in torchrun's error file.

`run_main` (rl_core/cli.py) acts on what `ending` decides: the traceback (a bug's only), the line, the wait for
the rank that failed first.
"""

from __future__ import annotations

import json
import os
import re
import sys
import time
from dataclasses import dataclass

from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from rl_core.errors import PeerFailed, UserError


def is_user_error(err: BaseException) -> bool:
    """Failures whose message is the whole story: the traceback would only bury it."""
    return isinstance(err, (UserError, FileNotFoundError))


def lost_peer(err: BaseException) -> bool:
    """A collective failed because another rank went away (gloo: "Connection closed by peer"). Only
    the process group's own errors count: an engine call that met a reset connection is this rank's."""
    text = str(err)
    in_collective = "gloo" in text or "nccl" in text.lower() or "ProcessGroup" in text
    return isinstance(err, RuntimeError) and in_collective and (
        "Connection closed by peer" in text or "Connection reset by peer" in text or "Broken pipe" in text)


def failure_line(err: BaseException) -> str:
    """The error as one line: the message alone for a user error (it names the key and the fix), else with its type."""
    text = str(err).strip() or type(err).__name__
    if isinstance(err, PeerFailed) or is_user_error(err):
        return text
    return f"{type(err).__name__}: {text}"


@dataclass(frozen=True)
class Ending:
    """How a rank's failure ends it: `line`, written to torchrun's error file (dated later when `follower`: this
    rank only followed another one down) and, when `said`, to stderr; the traceback above it only for a bug; and
    whether the rank first waits for the failed one to exit (`wait`)."""
    line: str
    follower: bool = False
    said: bool = True
    wait: bool = False
    traceback: bool = False


def ending(err: BaseException, rank: int) -> Ending:
    """How `err`, which ended this rank's job, is told."""
    if isinstance(err, PeerFailed):  # the failing rank prints the cause; one line is enough
        return Ending(f"[rank {rank}] stopped: {err}", follower=True, said=False, wait=True)
    failed = getattr(err, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failed, dict) and failed and rank not in failed:  # another rank died mid-save
        per_node = max(1, int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        cause = failed[min(failed)][0]
        line = (f"[rank {rank}] stopped: " + ", ".join(f"rank {r} (node {r // per_node})" for r in sorted(failed))
                + f" failed while the checkpoint was written ({type(cause).__name__}: {cause}); see its log")
        # (a rank on another node prints in its own log)
        return Ending(line, follower=True, wait=any(r // per_node == rank // per_node for r in failed))
    if lost_peer(err):
        peer = re.search(r"by peer \[?([0-9a-fA-F.:]+?)\]?:\d+", str(err))
        if peer and not peer.group(1).startswith("127."):  # another host: it may have no say of its own
            line = (f"[rank {rank}] stopped: the rank at {peer.group(1)} went away ({first_line(err)}); if that "
                    "is another node, it died or lost its link: see its log")
        else:
            line = (f"[rank {rank}] stopped: another rank failed or exited first ({first_line(err)}); "
                    "its error above (or in torchrun's summary) is the cause")
        # (a rank on another host prints in its own log)
        return Ending(line, follower=True, wait=not peer or peer.group(1).startswith("127."))
    return Ending(f"[rank {rank}] error: {failure_line(err)}", traceback=not is_user_error(err))


def first_line(err: BaseException) -> str:
    line = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    return line if len(line) <= 160 else line[:157] + "..."


class OneLineErrorHandler(ErrorHandler):
    """torchrun's error file holding the one line instead of a traceback: its summary prints that line."""

    def record_line(self, line: str, secondary: bool = False) -> None:
        path = self._get_error_file_path()
        if not path:
            return
        # torchrun names the failure with the earliest timestamp the root cause; a rank that only
        # followed another one down is dated later so it never hides the real cause.
        stamp = int(time.time()) + (60 if secondary else 0)
        # torch's layout, with the one line where the traceback would be: the summary prints py_callstack.
        data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(stamp)}}}
        self._write_error_file(path, json.dumps(data))

    def record_exception(self, e: BaseException) -> None:
        self.record_line(failure_line(e))


def say(line: str) -> None:
    try:  # one write, so lines of ranks failing together do not interleave
        sys.stderr.write(line + "\n")
        sys.stderr.flush()
    except OSError:  # torchrun (and the reading end of the pipe) may be gone
        pass
