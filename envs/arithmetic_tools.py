"""Arithmetic tools for conversation envs (envs/chat.py): plain functions, listed in a config as
`env.tools: ["envs.arithmetic_tools:calc"]`, and a `ToolUseEnv` for small contexts (short tool results).

The names are short on purpose: the tiny recipe's whole conversation (tool list, question, call, result,
answer) must fit the tiny policy's 128 positions, and every character of a call is a token or two.
"""

from __future__ import annotations

from envs.calculator import format_number, safe_eval
from envs.chat import ToolUseEnv
from envs.tools import ToolCall, Toolbox


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expr: numbers with + - * / // % ** and parentheses, e.g. "37 * 48"
    """
    return format_number(safe_eval(expr))  # a bad expression raises ValueError: the model reads the error


class ShortResultsToolUseEnv(ToolUseEnv):
    """`ToolUseEnv` whose tool messages are cut to `max_result_chars` characters.

    A small context cannot take whatever a tool or the toolbox writes back: an error such as
    "error: calc raised ValueError: not an arithmetic expression: '46 * 9 3'" is 52 tokens with the tiny
    tokenizer, and after a 39-token prompt and a 45-token call the conversation would pass the tiny
    policy's 128 positions. A result of the recipe's problems is at most 4 digits; an error keeps its start.
    """

    def __init__(self, toolbox: Toolbox | None = None, max_result_chars: int = 16, **kwargs):
        super().__init__(toolbox, **kwargs)
        if max_result_chars < 1:
            raise ValueError(f"ShortResultsToolUseEnv: max_result_chars must be >= 1, got {max_result_chars}")
        self.max_result_chars = max_result_chars

    async def call_tools(self, calls: list[ToolCall]) -> list[dict]:
        messages = await super().call_tools(calls)
        return [{**message, "content": message["content"][:self.max_result_chars]} for message in messages]
