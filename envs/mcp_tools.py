"""MCP servers' tools in a `Toolbox`, from `env.tools` entries beside the import paths:

    - {mcp: {command: [python, -m, my_pkg.server], env: {KEY: value}, cwd: /srv}}   # stdio: the job starts it
    - {mcp: {url: "http://127.0.0.1:8931/mcp", prefix: web_, include: [search]}}    # streamable HTTP

Each server's tools are listed once at start (a tool's `inputSchema` is the schema the template renders);
a call then goes through the toolbox like a function's: the same argument check against that schema, the
same timeout and error kinds. A result the server marks `isError`, or a server that died or broke the
connection, is an error message for the model ("raised"), never a stopped job.

The client (the `mcp` package) is anyio-based: a connection is opened and closed by one task. The toolbox
is built before the rollout's event loop runs, must list the tools synchronously, and serves whichever loop
its envs run on, so the connections live on a loop of their own in one thread per toolbox, and each call is
handed to it (`asyncio.run_coroutine_threadsafe`); a caller that gives up at its timeout cancels the call
there. A stdio server is started through a tiny launcher that asks the kernel to SIGTERM it when that
thread ends (PR_SET_PDEATHSIG, as workers/procs.py does for the engines): `close` stops it cleanly, and a
job that dies any other way cannot leave it running.
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shlex
import shutil
import sys
import threading
from typing import Any, Callable

from envs.tool_parsers import ToolError

logger = logging.getLogger(__name__)

KEYS = ("command", "url", "env", "cwd", "prefix", "include")
EXAMPLE = "{mcp: {command: [python, -m, my_pkg.server]}} or {mcp: {url: 'http://127.0.0.1:8931/mcp'}}"
CONNECT_TIMEOUT_S = 60.0  # a server's start and its tool listing (an `npx` server may download itself first)

# `python -c _LAUNCH <job pid> <command...>`: die with the forking thread, then become the server. The
# signal survives exec; a job that died before the prctl has already re-parented us, so give up.
_LAUNCH = ("import ctypes, os, signal, sys\n"
           "ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)\n"  # 1 = PR_SET_PDEATHSIG
           "os.getppid() == int(sys.argv[1]) or sys.exit(1)\n"
           "os.execvp(sys.argv[2], sys.argv[2:])\n")


def entry_problem(entry: Any) -> str | None:
    """What is wrong with one `env.tools` entry (an import path or an MCP server), or None."""
    if isinstance(entry, str):
        return None if entry.strip() else f"is empty; give 'pkg.module:function' or {EXAMPLE}"
    if not isinstance(entry, dict) or list(entry) != ["mcp"] or not isinstance(entry["mcp"], dict):
        return f"is {entry!r}; give 'pkg.module:function' or {EXAMPLE}"
    spec = entry["mcp"]
    unknown = sorted(set(spec) - set(KEYS))
    if unknown:
        return f"has unknown MCP keys {unknown}; the keys are {list(KEYS)}"
    if ("command" in spec) == ("url" in spec):
        return f"needs exactly one of mcp.command (a stdio server) and mcp.url (HTTP), e.g. {EXAMPLE}"
    command = spec.get("command", "x")
    if not (isinstance(command, str) and command.strip()) and not (
            isinstance(command, list) and command and all(isinstance(word, str) for word in command)):
        return f"mcp.command is {command!r}; give the server's command line as a list of strings"
    url = spec.get("url", "http://")
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        return f"mcp.url is {url!r}; give the server's streamable HTTP endpoint, e.g. http://127.0.0.1:8931/mcp"
    if "url" in spec and ("env" in spec or "cwd" in spec):
        return "mcp.env and mcp.cwd are for a server the job starts (mcp.command); drop them for mcp.url"
    if not isinstance(spec.get("env", {}), dict) or not isinstance(spec.get("cwd", ""), str):
        return "mcp.env must be a mapping of variables and mcp.cwd a directory"
    if not isinstance(spec.get("prefix", ""), str):
        return f"mcp.prefix is {spec['prefix']!r}; give a string put before each tool's name, e.g. web_"
    include = spec.get("include", [])
    if not isinstance(include, list) or not all(isinstance(name, str) for name in include):
        return f"mcp.include is {include!r}; give a list of the server's tool names to take"
    return None


def server_label(spec: dict) -> str:
    command = spec.get("command")
    return spec["url"] if command is None else command if isinstance(command, str) else shlex.join(command)


class _Connection:
    """One server's live connection; replaced when the server is reconnected."""

    def __init__(self, spec: dict, client, task: asyncio.Task, stop: asyncio.Event):
        self.spec, self.client, self.task, self.stop = spec, client, task, stop
        self.broken = False  # a call on it failed below the tool (the link, the session)
        self.reconnecting = asyncio.Lock()  # the calls that find it broken wait for one reconnect


class McpServers:
    """The connections to one toolbox's MCP servers, on their own loop and thread (module docstring).

    `tools`: (schema, async function) per tool taken; the function runs the call on the server and returns
    its text, or raises `ToolError` with the server's error (or the broken connection's). A connection that
    ended (the server died or dropped it) is opened again by the next call: the call that was running when
    it broke fails (a tool may have acted, so it is not sent twice), later ones reach the restarted server."""

    def __init__(self, specs: list[dict], connect_timeout_s: float = CONNECT_TIMEOUT_S):
        self.tools: list[tuple[dict, Callable]] = []
        self.closed = False
        self.connect_timeout_s = connect_timeout_s
        self._connections: list[_Connection] = []
        self._calls: set[asyncio.Task] = set()  # calls running on the MCP loop
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="mcp-client", daemon=True)
        self.thread.start()
        try:
            for spec in specs:
                self.tools += self._submit(self._connect(spec, connect_timeout_s)).result()
        except BaseException:
            self.close()
            raise

    def _submit(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop)

    async def _open(self, spec: dict, timeout_s: float) -> tuple[_Connection, list]:
        """Start (stdio) or reach (URL) the server and list its tools; a one-line error when it cannot."""
        from mcp import Client

        label = server_label(spec)
        ready, stop = asyncio.get_running_loop().create_future(), asyncio.Event()
        task = asyncio.create_task(self._hold(Client(_transport(spec)), label, ready, stop))
        try:
            client, listed = await asyncio.wait_for(asyncio.shield(ready), timeout_s)
        except BaseException as err:
            task.cancel()  # the client's exit stops a server that started
            await asyncio.gather(task, return_exceptions=True)
            if isinstance(err, asyncio.TimeoutError):
                raise RuntimeError(f"MCP server {label} did not list its tools within {timeout_s:g} s; check that "
                                   "it starts (run its command by hand) and speaks MCP") from None
            if isinstance(err, Exception):
                raise RuntimeError(f"MCP server {label} did not start: {_describe(err)}") from None
            raise
        return _Connection(spec, client, task, stop), listed

    async def _connect(self, spec: dict, timeout_s: float) -> list[tuple[dict, Callable]]:
        label = server_label(spec)
        connection, listed = await self._open(spec, timeout_s)
        self._connections.append(connection)
        include, prefix = spec.get("include"), spec.get("prefix", "")
        missing = sorted(set(include or ()) - {tool.name for tool in listed})
        if missing:
            raise ValueError(f"MCP server {label} has no tools {missing} (mcp.include); its tools are "
                             f"{sorted(tool.name for tool in listed)}")
        return [({"type": "function", "function": {"name": prefix + tool.name, "description": tool.description or "",
                                                   "parameters": tool.input_schema}},
                 self._caller(connection, tool.name, label))
                for tool in listed if include is None or tool.name in include]

    @staticmethod
    async def _hold(client, label: str, ready: asyncio.Future, stop: asyncio.Event) -> None:
        """Open the connection, list the tools, and keep it open until `stop` (the client's task group is
        entered and left in this one task, as anyio requires)."""
        try:
            async with client:
                ready.set_result((client, await _list_tools(client)))
                await stop.wait()
        except BaseException as err:  # noqa: BLE001 - a failure to start is the caller's; a later one, the calls'
            if not ready.done():
                ready.set_exception(err if isinstance(err, Exception) else RuntimeError("cancelled"))
            elif not isinstance(err, asyncio.CancelledError):
                logger.warning("MCP server %s: the connection ended: %s", label, _describe(err))
            if isinstance(err, asyncio.CancelledError):
                raise

    def _caller(self, connection: _Connection, name: str, label: str) -> Callable:
        async def call(**arguments: Any) -> str:
            if self.closed:
                raise ToolError(f"the MCP server {label} is closed")
            # Cancelling this await (the toolbox's timeout) cancels the call on the MCP loop too.
            return await asyncio.wrap_future(self._submit(self._call(connection, name, arguments, label)))

        call.__name__ = name
        return call

    def close(self) -> None:
        """Stop every connection (a stdio server gets its stdin closed, then a SIGTERM, then a SIGKILL, by
        the client) and the thread. Idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            self._submit(self._shutdown()).result(timeout=30)
        except Exception as err:  # noqa: BLE001 - the thread's end SIGTERMs what is left
            logger.warning("closing the MCP servers: %s", _describe(err))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=10)
        if not self.thread.is_alive():
            self.loop.close()

    async def _call(self, connection: _Connection, name: str, arguments: dict, label: str) -> str:
        self._calls.add(asyncio.current_task())
        try:
            await self._reconnect_if_ended(connection, label)
            result = await connection.client.call_tool(name, arguments)
        except Exception as err:  # noqa: BLE001 - the connection broke, the server died or answered nonsense
            connection.broken = True
            raise ToolError(f"{_describe(err)} (MCP server {label})") from None
        finally:
            self._calls.discard(asyncio.current_task())
        text = result_text(result)
        if result.is_error:
            raise ToolError(text or "the tool reported an error")
        return text

    async def _reconnect_if_ended(self, connection: _Connection, label: str) -> None:
        """A connection whose holding task ended (the server died, or dropped it) is opened again, once for
        all the calls that find it so; a server that does not come back fails this call and is tried again
        by the next."""
        async with connection.reconnecting:
            if not (connection.task.done() or connection.broken) or self.closed:
                return
            logger.warning("MCP server %s: reconnecting", label)
            connection.stop.set()  # what is left of the old connection (a stdio server still running is stopped)
            await asyncio.gather(connection.task, return_exceptions=True)
            fresh, _ = await self._open(connection.spec, self.connect_timeout_s)
            connection.client, connection.task, connection.stop = fresh.client, fresh.task, fresh.stop
            connection.broken = False

    async def _shutdown(self) -> None:
        for task in list(self._calls):  # calls still running: their callers have gone
            task.cancel()
        await asyncio.gather(*self._calls, return_exceptions=True)
        for connection in self._connections:
            connection.stop.set()
        await asyncio.gather(*(connection.task for connection in self._connections), return_exceptions=True)


def _transport(spec: dict):
    """What `mcp.Client` connects to: the URL (streamable HTTP), or the stdio server's parameters."""
    from mcp import StdioServerParameters

    if "url" in spec:
        return spec["url"]
    command = spec["command"]
    command = shlex.split(command) if isinstance(command, str) else list(command)
    if os.sep not in command[0] and shutil.which(command[0]) is None:  # else only "Connection closed" says so
        raise ValueError(f"MCP server {server_label(spec)}: no command {command[0]!r} on PATH")
    if sys.platform.startswith("linux"):
        command = [sys.executable, "-c", _LAUNCH, str(os.getpid()), *command]
    # The server gets the library's safe environment (HOME, PATH, USER, ...) plus `env`, not the job's.
    return StdioServerParameters(command=command[0], args=command[1:], cwd=spec.get("cwd"),
                                 env={key: str(value) for key, value in spec.get("env", {}).items()})


async def _list_tools(client) -> list:
    tools, cursor = [], None
    for _ in range(100):  # a server whose pages never end cannot hang the start
        page = await client.list_tools(cursor=cursor)
        tools += page.tools
        cursor = page.next_cursor
        if not cursor:
            break
    return tools


def result_text(result) -> str:
    """A `CallToolResult` as the text of a tool message: its text blocks joined, other blocks named."""
    parts = [_block_text(block) for block in result.content]
    if not parts and result.structured_content is not None:
        return json.dumps(result.structured_content)
    return "\n".join(parts)


def _block_text(block) -> str:
    if block.type == "text":
        return block.text
    if block.type == "resource":  # an embedded resource: its text, or what it is
        return getattr(block.resource, "text", None) or f"[resource {block.resource.uri}]"
    if block.type == "resource_link":
        return f"[resource link {block.uri}]"
    return f"[{block.type} {getattr(block, 'mime_type', '')}]".replace(" ]", "]")  # image, audio


def _describe(err: BaseException) -> str:
    """One line for an error: the first leaf of an exception group, an MCP error's message."""
    while isinstance(err, BaseExceptionGroup) and err.exceptions:
        err = err.exceptions[0]
    message = getattr(getattr(err, "error", None), "message", None) or str(err)
    return f"{type(err).__name__}: {message}" if message else type(err).__name__
