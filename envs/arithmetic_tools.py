"""Arithmetic tools for conversation envs (envs/chat.py): plain functions, listed in a config as
`env.tools: ["envs.arithmetic_tools:calc"]`.

The names are short on purpose: the tiny recipe's whole conversation (tool list, question, call, result,
answer) must fit the tiny policy's 128 positions, and every character of a call is a token or two.
"""

from __future__ import annotations

from envs.calculator import format_number, safe_eval


def calc(expr: str) -> str:
    """Evaluate an arithmetic expression.

    Args:
        expr: numbers with + - * / // % ** and parentheses, e.g. "37 * 48"
    """
    return format_number(safe_eval(expr))  # a bad expression raises ValueError: the model reads the error
