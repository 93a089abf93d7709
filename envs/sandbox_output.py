"""What a sandboxed call printed, as the trainer reads it and the model sees it (used by `envs.sandbox`).

The trainer reads each stream only up to the call's `max_output_bytes`: one byte past it stops the call
(the caller kills it), so a program printing as fast as it can costs the trainer no more than that, and what
is left in the pipe (64 KB by default, 1 MB at most), which it discards. The text
handed on is valid and visible: invalid UTF-8 shows as `\\xNN` escapes, and control characters (ANSI escape
sequences, bells, carriage returns; newlines and tabs excepted) as `\\xNN` too, so nothing the code prints can
hide text or drive a terminal that shows it.
"""

from __future__ import annotations

import asyncio
import codecs
from typing import Callable

READ_CHUNK = 65536
ENDED_POLL_S = 0.01
# C0 and C1 control characters and DEL, but newline and tab: escaped where the text is decoded.
CONTROL_ESCAPES = {code: f"\\x{code:02x}" for code in [*range(0x20), 0x7F, *range(0x80, 0xA0)]
                   if chr(code) not in "\n\t"}


async def read_capped(stream: asyncio.StreamReader, limit: int, over_limit: Callable[[], None],
                      ended: Callable[[], bool]) -> tuple[bytes, bool]:
    """The first `limit` bytes of `stream`, and whether it had more. At the first byte past `limit` this calls
    `over_limit` (which has the code killed) and stops reading until `ended()` (the call's processes are gone);
    then it discards what is left in the pipe, at most a pipe's worth, so that the pipe closes."""
    kept = bytearray()
    while chunk := await stream.read(min(READ_CHUNK, limit + 1 - len(kept))):
        kept += chunk
        if len(kept) > limit:
            over_limit()
            while not ended():
                await asyncio.sleep(ENDED_POLL_S)
            while await stream.read(READ_CHUNK):
                pass
            return bytes(kept[:limit]), True
    return bytes(kept), False


def visible_text(data: bytes, truncated: bool) -> str:
    """`data` as text with invalid UTF-8 and control characters escaped; a multi-byte character cut at the end of
    truncated output is dropped, not escaped."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="backslashreplace")
    return decoder.decode(data, final=not truncated).translate(CONTROL_ESCAPES)


def truncation_note(limit: int) -> str:
    return f"\n[output truncated: more than {limit} bytes written, the first {limit} kept; the program was stopped]"
