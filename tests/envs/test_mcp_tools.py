"""MCP servers' tools in a toolbox, against a real stdio server (mcp_calc_server.py): listed into the template
like function tools, called through the same checks, timeout and error kinds, a dead server an error message,
and no server process left behind: after `close`, after a failed start, or after a job killed outright."""

import asyncio
import os
import signal
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from envs.base import Action
from envs.chat import ChatEnvAdapter, ToolUseEnv
from envs.chat_tokens import special_strings
from envs.mcp_tools import entry_problem
from envs.tools import Toolbox, ToolCall
from envs.turns import TurnParser
from rl_core.config import ConfigError
from tests.envs.test_chat import chat_tokenizer_dir, tokenizer_with  # noqa: F401 - a fixture
from tests.envs.test_sandbox import children_of

SERVER = str(Path(__file__).with_name("mcp_calc_server.py"))
CALC = {"mcp": {"command": [sys.executable, SERVER]}}


def add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first term
        b: the second term
    """
    return a + b


def children() -> set[int]:
    """This process's live children."""
    return set(children_of(os.getpid()))


def gone(pid: int, within_s: float = 10.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            return True
        if state == "Z":  # dead, waiting for its parent to read its exit status
            return True
        time.sleep(0.05)
    return False


def run(toolbox: Toolbox, *calls: ToolCall):
    async def all_of_them():
        return await asyncio.gather(*(toolbox.run(call) for call in calls))

    return asyncio.run(all_of_them())


@pytest.fixture(scope="module")
def toolbox():
    """One server for the module (each test's calls run on a loop of its own, as different envs' would)."""
    toolbox = Toolbox.from_paths(["tests.envs.test_mcp_tools:add", CALC], timeout_s=1.5)
    yield toolbox
    toolbox.close()


def test_the_servers_tools_are_listed_beside_the_functions_and_rendered_by_the_template(toolbox,
                                                                                        chat_tokenizer_dir):  # noqa: F811
    assert [s["function"]["name"] for s in toolbox.schemas] == ["add", "multiply", "divide", "nap", "pid", "picture"]
    multiply = toolbox.schemas[1]
    assert multiply["type"] == "function" and multiply["function"]["description"] == "Multiply two integers."
    parameters = multiply["function"]["parameters"]  # the server's inputSchema, as it is
    assert parameters["properties"]["a"]["type"] == "integer" and parameters["required"] == ["a", "b"]
    tokenizer = tokenizer_with(chat_tokenizer_dir, "tools_in_system")
    text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=toolbox.schemas, tokenize=False)
    assert "Tools: add(a, b) multiply(a, b) divide(a, b) nap(seconds) pid() picture()" in text


def test_calls_answer_or_fail_with_the_same_error_kinds_as_functions(toolbox):
    started = time.perf_counter()
    results = run(toolbox, ToolCall("c0", "multiply", {"a": 12, "b": 34}),
                  ToolCall("c1", "add", {"a": 1, "b": 2}),
                  ToolCall("c2", "mul", {"a": 1}),
                  ToolCall("c3", "multiply", {"a": "12", "c": 1}),
                  ToolCall("c4", "divide", {"a": 1, "b": 0}),
                  ToolCall("c5", "nap", {"seconds": 5}),  # over before the fixture closes
                  ToolCall("c6", "picture", {}))
    assert time.perf_counter() - started < 4.5  # the nap was given up at the timeout
    assert [r.error for r in results] == [None, None, "unknown_tool", "bad_arguments", "raised", "timed_out", None]
    assert results[0].message == {"role": "tool", "tool_call_id": "c0", "name": "multiply", "content": "408"}
    assert results[1].message["content"] == "3"
    contents = [r.message["content"] for r in results[2:]]
    assert contents[0].startswith("error: no tool named 'mul'; the tools are ['add', 'divide', 'multiply'")
    assert contents[1] == ("error: bad arguments for multiply: unknown arguments ['c']; missing arguments ['b']; "
                           "a must be integer")
    assert contents[2] == "error: divide failed: Error executing tool divide: cannot divide by zero"  # isError
    assert contents[3] == "error: nap did not answer within 1.5 s"
    assert contents[4] == "a red dot\n[image image/png]"  # a non-text block is named, not pasted
    # The connection survives a call given up on: the next one is answered.
    assert run(toolbox, ToolCall("c7", "multiply", {"a": 2, "b": 3}))[0].message["content"] == "6"


def test_a_conversation_env_calls_the_servers_tool(toolbox, chat_tokenizer_dir):  # noqa: F811
    tokenizer = tokenizer_with(chat_tokenizer_dir, "tools_in_system")
    parse = TurnParser("hermes", "none", toolbox.schemas, tokenizer, special_strings(tokenizer))
    env = ChatEnvAdapter(ToolUseEnv(toolbox, max_tool_turns=1), tokenizer, parse)
    call = '<tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call>'

    async def episode():
        ids = await env.reset({"messages": [{"role": "user", "content": "12 * 34?"}]})
        call_ids = tokenizer.encode(call, add_special_tokens=False) + [tokenizer.eos_token_id]
        return ids, call_ids, await env.step(Action(call, call_ids))

    ids, call_ids, result = asyncio.run(episode())
    assert "multiply(a, b)" in tokenizer.decode(ids)
    assert tokenizer.decode(result.observation[len(ids) + len(call_ids):]) == "\nTool multiply: 408\nAssistant:\n"
    assert result.info["tool_calls"] == 1 and result.info["tool_errors"] == 0


def test_a_server_killed_mid_call_fails_that_call_the_next_restarts_it_and_close_leaves_no_process():
    before = children()
    toolbox = Toolbox.from_paths([{"mcp": {"command": [sys.executable, SERVER], "prefix": "calc_",
                                           "include": ["pid", "nap", "multiply"]}}], timeout_s=20)
    assert [s["function"]["name"] for s in toolbox.schemas] == ["calc_multiply", "calc_nap", "calc_pid"]
    pid = int(run(toolbox, ToolCall("c0", "calc_pid", {}))[0].message["content"])
    assert pid in children() - before

    async def killed_mid_call():
        napping = asyncio.ensure_future(toolbox.run(ToolCall("c1", "calc_nap", {"seconds": 30})))
        await asyncio.sleep(0.5)
        os.kill(pid, signal.SIGKILL)
        return await napping, await toolbox.run(ToolCall("c2", "calc_multiply", {"a": 2, "b": 3}))

    started = time.perf_counter()
    napped, after = asyncio.run(killed_mid_call())
    assert time.perf_counter() - started < 15  # not the 20 s timeout: the broken connection answers at once
    assert napped.error == "raised"  # it may have acted: not sent again
    assert napped.message["content"].startswith("error: calc_nap failed: MCPError: Connection closed (MCP server ")
    assert after.error is None and after.message["content"] == "6"  # the next call started the server again
    restarted = int(run(toolbox, ToolCall("c3", "calc_pid", {}))[0].message["content"])
    assert restarted != pid and restarted in children() - before and gone(pid)
    toolbox.close()
    assert gone(restarted) and children() == before


def test_a_name_clash_or_a_missing_tool_stops_the_start_in_one_line_and_the_server_with_it():
    before = children()
    with pytest.raises(ValueError, match=r"^two tools are named 'multiply'; tool names must be unique \(rename one "
                                         r"with its server's mcp.prefix\)$"):
        Toolbox.from_paths(["tests.envs.test_chat:multiply", CALC])
    assert children() == before
    with pytest.raises(RuntimeError, match=r"^MCP server \S+ -c pass did not start: MCPError: Connection closed$"):
        Toolbox.from_paths([{"mcp": {"command": [sys.executable, "-c", "pass"]}}])  # exits at once
    with pytest.raises(ValueError, match=r"^MCP server no-such-server --port 1: no command 'no-such-server' on PATH$"):
        Toolbox.from_paths([{"mcp": {"command": "no-such-server --port 1"}}])
    assert children() == before


def test_a_job_killed_outright_takes_its_stdio_server_with_it(tmp_path):
    """No `close` runs in a SIGKILLed job: the kernel's parent-death signal stops the server."""
    script = tmp_path / "job.py"
    script.write_text(textwrap.dedent(f"""
        import asyncio, sys
        from envs.mcp_tools import McpServers
        servers = McpServers([{CALC['mcp']!r}])
        pid = dict((s["function"]["name"], call) for s, call in servers.tools)["pid"]
        print(asyncio.run(pid()), flush=True)
        sys.stdin.read()
    """))
    job = subprocess.Popen([sys.executable, str(script)], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                           env={**os.environ, "PYTHONPATH": str(Path(__file__).parents[2])})
    try:
        server = int(job.stdout.readline())
    finally:
        job.kill()
        job.wait()
    assert gone(server)


def start_http_server(port: int) -> subprocess.Popen:
    """The test server over streamable HTTP on 127.0.0.1:`port`, once it accepts connections."""
    server = subprocess.Popen([sys.executable, SERVER, "--http", str(port)], stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return server
        except OSError:
            if server.poll() is not None or time.monotonic() > deadline:
                server.kill()
                raise AssertionError(f"the HTTP test server did not start on port {port}") from None
            time.sleep(0.2)


def test_a_server_at_a_url_is_listed_and_called_over_streamable_http_and_a_dead_one_is_a_message():
    from workers.net import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}/mcp"
    with pytest.raises(RuntimeError, match=rf"^MCP server {url} did not start: "):  # nothing listens yet
        Toolbox.from_paths([{"mcp": {"url": url}}])
    server = start_http_server(port)
    try:
        toolbox = Toolbox.from_paths([{"mcp": {"url": url, "prefix": "web_", "include": ["multiply", "divide"]}}],
                                     timeout_s=20)
        try:
            assert [s["function"]["name"] for s in toolbox.schemas] == ["web_multiply", "web_divide"]
            product, by_zero = run(toolbox, ToolCall("c0", "web_multiply", {"a": 12, "b": 34}),
                                   ToolCall("c1", "web_divide", {"a": 1, "b": 0}))
            assert product.message["content"] == "408" and product.error is None
            assert by_zero.error == "raised" and by_zero.message["content"].endswith("cannot divide by zero")
            server.kill()
            server.wait()
            started = time.perf_counter()
            gone_server = run(toolbox, ToolCall("c2", "web_multiply", {"a": 2, "b": 3}))[0]
            assert gone_server.error == "raised" and time.perf_counter() - started < 15
            assert gone_server.message["content"].startswith("error: web_multiply failed: ")
            server = start_http_server(port)  # back on the same URL: the next call opens a new session
            assert run(toolbox, ToolCall("c3", "web_multiply", {"a": 2, "b": 3}))[0].message["content"] == "6"
        finally:
            toolbox.close()
    finally:
        server.kill()
        server.wait()


def test_bad_entries_are_one_line_at_config_validation():
    from rl_core.config import load_config
    from rl_core.ppo.config import PPOConfig
    from rl_core.ppo.validation import validate

    assert entry_problem("my_pkg.tools:search") is None and entry_problem(CALC) is None
    assert entry_problem({"mcp": {"url": "http://127.0.0.1:8931/mcp", "prefix": "web_", "include": ["a"]}}) is None
    assert entry_problem({"mcp": {"command": "npx -y server", "env": {"KEY": "1"}, "cwd": "/tmp"}}) is None
    assert "exactly one of mcp.command" in entry_problem({"mcp": {}})
    assert "exactly one of mcp.command" in entry_problem({"mcp": {"command": ["x"], "url": "http://a"}})
    assert "unknown MCP keys ['args']" in entry_problem({"mcp": {"command": ["x"], "args": []}})
    assert "mcp.env and mcp.cwd are for a server the job starts" in entry_problem({"mcp": {"url": "http://a",
                                                                                           "cwd": "/"}})
    assert "mcp.include is 'a'" in entry_problem({"mcp": {"url": "http://a", "include": "a"}})
    assert "give 'pkg.module:function' or {mcp:" in entry_problem({"command": ["x"]})
    with pytest.raises(ConfigError) as error:
        load_config("ppo_sentiment.yaml", ["env.cls=envs.chat:ToolUseEnv", "env.tools=[{mcp: {url: ftp://x}}]"],
                    PPOConfig, validate)
    assert str(error.value) == ("config key 'env.tools[0]' mcp.url is 'ftp://x'; give the server's streamable HTTP "
                                "endpoint, e.g. http://127.0.0.1:8931/mcp")
    with pytest.raises(ValueError, match=r"^env.tools\[1\] needs exactly one of mcp.command"):
        Toolbox.from_paths(["tests.envs.test_mcp_tools:add", {"mcp": {}}])


def test_the_recipe_calculator_served_over_mcp_renders_the_recipe_prompt_token_for_token():
    """envs/examples/calc_mcp_server.py serves the tool recipe's `calc`: the shipped policy must read the
    same prompt ids whichever way the tool is listed, and a bad expression must come back with its reason."""
    from offline.assets import default_assets_root
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(default_assets_root() / "tools-arithmetic-sft" / "tokenizer")
    served = Toolbox.from_paths([{"mcp": {"command": [sys.executable, "-m", "envs.examples.calc_mcp_server"]}}])
    try:
        imported = Toolbox.from_paths(["envs.arithmetic_tools:calc"])
        question = [{"role": "user", "content": "What is 37 * 48?"}]
        prompts = [tokenizer.apply_chat_template(question, tools=box.schemas, add_generation_prompt=True)
                   for box in (served, imported)]
        assert prompts[0] == prompts[1] and "Tools: calc(expr)" in tokenizer.decode(prompts[0])
        good, bad = run(served, ToolCall("c0", "calc", {"expr": "37 * 48"}), ToolCall("c1", "calc", {"expr": "open(1)"}))
        assert good.message["content"] == "1776" and bad.error == "raised"
        assert bad.message["content"].endswith("unsupported syntax Call: only numbers and + - * / // % ** are allowed")
    finally:
        served.close()
