"""A small MCP server for tests/envs/test_mcp_tools.py: `python mcp_calc_server.py` (stdio), or
`python mcp_calc_server.py --http PORT` (streamable HTTP at http://127.0.0.1:PORT/mcp).

Tools: `multiply` answers, `divide` fails on a zero divisor (a tool error: `isError`), `nap` sleeps as long
as asked (past a toolbox's timeout), `pid` says which process serves (to kill it mid-run), `picture`
answers with an image block beside its text.
"""

import os
import sys
import time

from mcp.server.mcpserver import MCPServer
from mcp.server.mcpserver.exceptions import ToolError
from mcp_types import ImageContent, TextContent

server = MCPServer("calc", log_level="ERROR")  # the test output stays quiet


@server.tool()
def multiply(a: int, b: int) -> int:
    """Multiply two integers."""
    return a * b


@server.tool()
def divide(a: float, b: float) -> float:
    """Divide a by b."""
    if b == 0:
        raise ToolError("cannot divide by zero")
    return a / b


@server.tool()
def nap(seconds: float) -> str:
    """Sleep, then say so."""
    time.sleep(seconds)
    return "awake"


@server.tool()
def pid() -> int:
    """The server's process id."""
    return os.getpid()


@server.tool()
def picture() -> list:
    """A caption and a one-pixel image."""
    return [TextContent(text="a red dot"), ImageContent(data="iVBORw0KGgo=", mime_type="image/png")]


if __name__ == "__main__":
    if sys.argv[1:2] == ["--http"]:
        server.run("streamable-http", host="127.0.0.1", port=int(sys.argv[2]))  # loopback only
    else:
        server.run()
