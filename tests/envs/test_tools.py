"""Tools from plain functions, calls parsed from model text, and every way a call can fail becoming a
`tool` message for the model (never an exception for the job)."""

import asyncio
import json
import time

import pytest

from envs.tools import Toolbox, ToolCall, hermes_tool_calls, load_parser


def multiply(a: int, b: int) -> int:
    """Multiply two integers.

    Args:
        a: the first factor
        b: the second factor
    """
    return a * b


async def lookup(word: str, limit: float = 3.0) -> list:
    """Look a word up.

    Args:
        word: what to look up
        limit: how many senses at most
    """
    await asyncio.sleep(0)
    return [word] * int(limit)


def divide(a: float, b: float) -> float:
    """Divide.

    Args:
        a: the dividend
        b: the divisor
    """
    return a / b


def slow(seconds: float) -> str:
    """Sleep.

    Args:
        seconds: how long
    """
    time.sleep(seconds)
    return "done"


def test_schemas_are_what_apply_chat_template_renders_for_the_function():
    from transformers.utils import get_json_schema

    toolbox = Toolbox([multiply, lookup])
    assert toolbox.schemas == [get_json_schema(multiply), get_json_schema(lookup)]
    assert toolbox.schemas[0]["function"]["parameters"]["properties"]["a"] == {"type": "integer",
                                                                               "description": "the first factor"}
    assert toolbox.schemas[1]["function"]["parameters"]["required"] == ["word"]


def test_a_function_without_a_schema_or_a_repeated_name_is_one_line():
    def undocumented(x):
        return x

    with pytest.raises(ValueError, match="tool 'undocumented' has no usable schema: .*give it type hints"):
        Toolbox([undocumented])
    with pytest.raises(ValueError, match="two tools are named 'multiply'"):
        Toolbox([multiply, multiply])


def test_hermes_calls_parse_in_order_and_keep_what_went_wrong():
    text = ('I will compute.\n<tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>\n'
            '<tool_call>{"name": "lookup", "arguments": "{\\"word\\": \\"cat\\"}"}</tool_call>'
            '<tool_call>{"name": "multiply", "arguments": {"a": 1,</tool_call>'
            '<tool_call>["multiply"]</tool_call>')
    calls = hermes_tool_calls(text)
    assert [(c.id, c.name, c.arguments) for c in calls[:2]] == [("call_0", "multiply", {"a": 12, "b": 34}),
                                                                ("call_1", "lookup", {"word": "cat"})]
    assert calls[2].name == "multiply" and calls[2].problem.startswith("the call is not JSON")
    assert calls[3].problem == 'the call must be {"name": ..., "arguments": {...}}'
    assert hermes_tool_calls("no calls here") == []
    assert load_parser("hermes") is hermes_tool_calls
    assert load_parser("envs.tools:hermes_tool_calls") is hermes_tool_calls
    with pytest.raises(ValueError, match="neither one of .* nor an import path"):
        load_parser("xml")


def test_every_failure_is_a_tool_message_with_its_kind():
    toolbox = Toolbox([multiply, lookup, divide, slow], timeout_s=0.5)

    async def run_all():
        calls = [ToolCall("c0", "multiply", {"a": 12, "b": 34}),
                 ToolCall("c1", "lookup", {"word": "cat", "limit": 2}),
                 ToolCall("c2", "", problem="the call is not JSON (Expecting value)"),
                 ToolCall("c3", "add", {"a": 1}),
                 ToolCall("c4", "multiply", {"a": "12", "c": 1}),
                 ToolCall("c5", "multiply", {"a": True, "b": 2}),
                 ToolCall("c6", "divide", {"a": 1, "b": 0}),
                 ToolCall("c7", "slow", {"seconds": 60})]
        return await asyncio.gather(*(toolbox.run(call) for call in calls))

    started = time.perf_counter()
    results = asyncio.run(run_all())
    assert time.perf_counter() - started < 30  # the 60 s tool was abandoned at its timeout, not waited for
    assert [r.error for r in results] == [None, None, "unparsed", "unknown_tool", "bad_arguments", "bad_arguments",
                                          "raised", "timed_out"]
    assert results[0].message == {"role": "tool", "tool_call_id": "c0", "name": "multiply", "content": "408"}
    assert json.loads(results[1].message["content"]) == ["cat", "cat"]
    contents = [r.message["content"] for r in results[2:]]
    assert contents[0] == "error: the call is not JSON (Expecting value)"
    assert contents[1] == "error: no tool named 'add'; the tools are ['divide', 'lookup', 'multiply', 'slow']"
    assert contents[2] == ("error: bad arguments for multiply: unknown arguments ['c']; missing arguments ['b']; "
                           "a must be integer")
    assert contents[3] == "error: bad arguments for multiply: a must be integer"
    assert contents[4] == "error: divide raised ZeroDivisionError: division by zero"
    assert contents[5] == "error: slow did not answer within 0.5 s"
    assert all(r.message["role"] == "tool" and r.seconds >= 0 for r in results)
