"""Tools for tool-calling environments: plain Python functions become the JSON schemas chat templates
take, the calls a model writes are parsed out of its text, and each call runs to a `tool` message.

    toolbox = Toolbox([multiply, run_python])          # typed signature + Google-style docstring each
    tokenizer.apply_chat_template(messages, tools=toolbox.schemas, ...)
    calls = hermes_tool_calls(action.text)             # or any parser (envs/tool_parsers.py)
    messages += [await toolbox.run(call) for call in calls]

Schemas come from `transformers.utils.get_json_schema`, the function `apply_chat_template(tools=...)`
applies to a callable, so a model sees exactly what its template renders for that function. Nothing a
call does stops the job: a call that does not parse, names no tool, has bad arguments, raises or runs
past its time becomes a `tool` message with the error for the model to read, and its kind is counted
(`ToolResult.error`).

MCP servers' tools join the same toolbox (envs/mcp_tools.py): `env.tools` takes `{mcp: {command: [...]}}`
or `{mcp: {url: ...}}` beside the import paths; their schemas are the servers' and their calls take the
same checks, timeout and error kinds.
"""

from __future__ import annotations

import asyncio
import inspect
import json
import time
from dataclasses import dataclass
from typing import Any, Callable, Sequence

from envs.threads import EnvThreadPool
from envs.plugins import load_by_path
from envs.tool_parsers import PARSERS, ToolCall, ToolError, hermes_tool_calls, load_parser  # noqa: F401 - re-exported

ERROR_KINDS = ("unparsed", "unknown_tool", "bad_arguments", "raised", "timed_out", "over_limit")
"""How a tool call can fail, each counted in `rollout/tool_errors/<kind>`: the call could not be read
(`unparsed`), names no tool (`unknown_tool`), has arguments the schema refuses (`bad_arguments`), the tool
raised (`raised`) or ran past its time (`timed_out`), or the turn had more calls than the env runs
(`over_limit`). The model reads each failure as its tool message."""


@dataclass
class ToolResult:
    """What one call gave: the `tool` message for the model, and for the metrics its error kind and time.

    Attributes:
        message: `{"role": "tool", "tool_call_id", "name", "content"}`; the content is the tool's return value
            (a string as it is, anything else as JSON) or the error.
        error: One of `ERROR_KINDS`, None when the tool answered.
        seconds: How long the call took.
    """

    message: dict[str, str]  # {"role": "tool", "tool_call_id", "name", "content"}
    error: str | None  # one of ERROR_KINDS, None when the tool answered
    seconds: float


# --------------------------------------------------------------------------- the toolbox

_JSON_TYPES = {"integer": int, "number": (int, float), "string": str, "boolean": bool, "array": list, "object": dict}


class Toolbox:
    """The tools of an environment by name; `timeout_s` bounds each call, `max_threads` the blocking
    (non-async) tool calls running at once, `max_concurrent` all calls running at once: one toolbox serves a
    job's every env, so this bounds the job's total (a sandbox per call would otherwise run as many programs
    as the policy writes calls).

    A tool is a plain function, sync or `async`, listed in `env.tools` by import path ("pkg.module:function").
    Its schema, what the chat template shows the model, comes from its signature and docstring: a type hint
    on every parameter and a Google-style docstring whose `Args:` section describes each one
    (`envs.arithmetic_tools.calc` is an example). It returns a string, or any value JSON can write; whatever
    it raises reaches the model as an error message. The job builds the toolbox with `env.tool_timeout_s`,
    `env.thread_pool_size` and `env.tool_concurrency`.
    """

    def __init__(self, functions: list[Callable], timeout_s: float = 30.0, max_threads: int = 8,
                 max_concurrent: int = 8, mcp_servers: Sequence[dict] = ()):
        from transformers.utils import get_json_schema

        if timeout_s <= 0:
            raise ValueError(f"a tool timeout must be > 0 seconds, got {timeout_s}")
        if max_concurrent < 1:
            raise ValueError(f"tool calls running at once must be >= 1, got {max_concurrent}")
        self.timeout_s = timeout_s
        self._running = asyncio.Semaphore(max_concurrent)
        self._threads = EnvThreadPool(max_threads, name="tool-worker")
        self.functions: dict[str, Callable] = {}
        self.schemas: list[dict] = []
        for function in functions:
            try:
                schema = get_json_schema(function)
            except Exception as err:  # transformers' own message names the missing hint or docstring entry
                raise ValueError(f"tool {getattr(function, '__name__', function)!r} has no usable schema: {err}; give "
                                 "it type hints and a Google-style docstring with an Args: line per argument") from err
            self._add(schema, function)
        self.mcp = None
        if mcp_servers:
            from envs.mcp_tools import McpServers

            self.mcp = McpServers(list(mcp_servers))
            try:
                for schema, call in self.mcp.tools:
                    self._add(schema, call, " (rename one with its server's mcp.prefix)")
            except BaseException:
                self.close()
                raise

    def _add(self, schema: dict, function: Callable, fix: str = "") -> None:
        name = schema["function"]["name"]
        if name in self.functions:
            raise ValueError(f"two tools are named {name!r}; tool names must be unique{fix}")
        self.functions[name] = function
        self.schemas.append(schema)

    @classmethod
    def from_paths(cls, entries: list, **options: Any) -> "Toolbox":
        """Tools as a config lists them: import paths ("pkg.module:function") and MCP servers ({mcp: ...})."""
        from envs.mcp_tools import entry_problem

        for index, entry in enumerate(entries):
            problem = entry_problem(entry)
            if problem:
                raise ValueError(f"env.tools[{index}] {problem}")
        functions = [load_by_path(entry, "tool", "my_pkg.tools:search") for entry in entries if isinstance(entry, str)]
        return cls(functions, mcp_servers=[entry["mcp"] for entry in entries if isinstance(entry, dict)], **options)

    def close(self) -> None:
        """Stop the MCP servers' connections (and a stdio server itself); the functions need nothing."""
        if self.mcp is not None:
            self.mcp.close()

    async def run(self, call: ToolCall) -> ToolResult:
        """Run `call`; whatever happens, a `tool` message for the model."""
        async with self._running:
            return await self._run(call)

    async def _run(self, call: ToolCall) -> ToolResult:
        started = time.perf_counter()
        error, content = self._check(call)
        if error is None:
            function = self.functions[call.name]
            try:
                if inspect.iscoroutinefunction(function):
                    value = await asyncio.wait_for(function(**call.arguments), self.timeout_s)
                else:
                    value = await self._in_thread(function, call.arguments)
                content = value if isinstance(value, str) else json.dumps(value, default=str)
            except asyncio.TimeoutError:
                error, content = "timed_out", f"error: {call.name} did not answer within {self.timeout_s:g} s"
            except ToolError as err:  # a failure the tool put in words (an MCP server's isError, a broken link)
                error, content = "raised", f"error: {call.name} failed: {err}"
            except Exception as err:  # noqa: BLE001 - the tool's failure is the model's to read
                error, content = "raised", f"error: {call.name} raised {type(err).__name__}: {err}"
        message = {"role": "tool", "tool_call_id": call.id, "name": call.name, "content": content}
        return ToolResult(message, error, time.perf_counter() - started)

    async def _in_thread(self, function: Callable, arguments: dict) -> Any:
        """A blocking tool in a thread, so it never stalls the rollout's event loop. One that runs past its
        time is abandoned (a thread cannot be killed; the pool's are daemons, so it holds up no exit), which
        is why blocking tools that may hang belong in a subprocess (envs/sandbox.py)."""
        future = self._threads.submit(function, **arguments)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), self.timeout_s)
        except asyncio.TimeoutError:
            self._threads.abandon(future)
            raise

    def _check(self, call: ToolCall) -> tuple[str | None, str]:
        """(error kind, message) when `call` cannot run, else (None, "")."""
        if call.problem is not None:
            return "unparsed", f"error: {call.problem}"
        if call.name not in self.functions:
            return "unknown_tool", f"error: no tool named {call.name!r}; the tools are {sorted(self.functions)}"
        parameters = next(s for s in self.schemas if s["function"]["name"] == call.name)["function"]["parameters"]
        properties = parameters.get("properties", {})
        unknown = sorted(set(call.arguments) - set(properties))
        missing = sorted(set(parameters.get("required", [])) - set(call.arguments))
        wrong = [f"{name} must be {properties[name]['type']}" for name, value in call.arguments.items()
                 if name in properties and not _has_type(value, properties[name].get("type"))]
        if unknown or missing or wrong:
            problems = ([f"unknown arguments {unknown}"] if unknown else []) + \
                       ([f"missing arguments {missing}"] if missing else []) + wrong
            return "bad_arguments", f"error: bad arguments for {call.name}: {'; '.join(problems)}"
        return None, ""


def _has_type(value: Any, json_type: str | list | None) -> bool:
    """Whether `value` is of a JSON-schema type (a list: any of them; unknown or none: anything goes)."""
    if isinstance(json_type, list):
        return any(_has_type(value, each) for each in json_type)
    expected = _JSON_TYPES.get(json_type)
    if expected is None or (json_type == "null" and value is None):
        return True
    if isinstance(value, bool) and json_type in ("integer", "number"):  # bool is an int in Python, not in JSON
        return False
    return isinstance(value, expected)
