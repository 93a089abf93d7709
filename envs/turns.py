"""One assistant turn read as a message: reasoning (`env.reasoning_parser`), tool calls (`env.tool_parser`, see
envs/tool_parsers.py) and the content that is left. `auto` reads it with the tokenizer's own response template
(`transformers`' `tokenizer.parse_response`)."""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.tool_parsers import PARSERS, REASONING_PARSERS, ToolCall, harmony_messages, load_parser


@dataclass
class ParsedTurn:
    content: str
    reasoning: str | None = None
    tool_calls: list[ToolCall] = field(default_factory=list)

    def key(self) -> tuple:
        """What the turn says, whatever its formatting: for telling a template's re-rendering of the turn from a
        rewrite of it (envs/chat_tokens.py)."""
        return ((self.reasoning or "").strip(), self.content.strip(),
                [(c.name, json.dumps(c.arguments, sort_keys=True), c.problem is None) for c in self.tool_calls])


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def split_reasoning(text: str, kind: str) -> tuple[str | None, str]:
    """(reasoning, the rest). `think`: a `</think>` without its `<think>` closes a block the prompt opened; a
    `<think>` never closed (a length cut) holds everything after it. `gpt_oss`: the analysis channel."""
    if kind == "think":
        if THINK_CLOSE in text:
            head, _, rest = text.partition(THINK_CLOSE)
            before, opened, inside = head.partition(THINK_OPEN)
            return (inside if opened else head), (before if opened else "") + rest
        if THINK_OPEN in text:
            before, _, inside = text.partition(THINK_OPEN)
            return inside, before
        return None, text
    if kind == "gpt_oss":
        analysis = [m for m in harmony_messages(text) if "<|channel|>analysis" in m.group("header")]
        if not analysis:
            return None, text
        rest, end = "", 0
        for m in analysis:  # a call addressed from the analysis channel goes with the reasoning: not run
            rest, end = rest + text[end:m.start()], m.end()
        return "\n".join(m.group("body") for m in analysis), rest + text[end:]
    return None, text


# Markers that open a call in some format: text holding one that no parser read is a call that failed.
CALL_MARKERS = ("<tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "<｜tool▁call▁begin｜>", "<|tool_call_begin|>",
                "to=functions.", "<function=")
SECTIONS = re.compile(r"<｜tool▁calls▁(?:begin|end)｜>|<\|tool_calls_section_(?:begin|end)\|>")  # around the calls
JSON_CALL = re.compile(r'\{\s*"name"\s*:\s*"[^"]*"\s*,\s*"(?:arguments|parameters)"\s*:')


def looks_like_a_call(text: str) -> str | None:
    """The call-like marker in `text`, if any."""
    marker = next((m for m in CALL_MARKERS if m in text), None)
    return marker or (JSON_CALL.search(text).group(0) if JSON_CALL.search(text) else None)


def typed_arguments(call: ToolCall, schemas: list[dict]) -> ToolCall:
    """Values a format writes as text (`<parameter=a>12`) read as JSON where the tool's schema wants a non-string."""
    schema = next((s["function"] for s in schemas if s["function"]["name"] == call.name), None)
    if schema is None or call.problem is not None:
        return call
    properties = schema.get("parameters", {}).get("properties", {})
    arguments = {}
    for key, value in call.arguments.items():
        if isinstance(value, str) and properties.get(key, {}).get("type") not in (None, "string"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError:
                pass  # left as text: the toolbox answers "a must be integer"
        arguments[key] = value
    return ToolCall(call.id, call.name, arguments, call.problem, call.span)


class TurnParser:
    """`text` (decoded with special tokens kept) -> `ParsedTurn`. `tool_parser`: a name in `PARSERS`, an import
    path, a function (text -> list[ToolCall]) or `auto` (needs `tokenizer`); `specials`: token strings left out
    of the content."""

    def __init__(self, tool_parser: str | Callable = "hermes", reasoning_parser: str = "none",
                 schemas: list[dict] | None = None, tokenizer: Any = None, specials: list[str] | None = None):
        if reasoning_parser not in REASONING_PARSERS:
            raise ValueError(f"config key 'env.reasoning_parser' is {reasoning_parser!r}; use one of "
                             f"{list(REASONING_PARSERS)}")
        if tool_parser == "auto" and getattr(tokenizer, "response_template", None) is None:
            raise ValueError("env.tool_parser=auto reads calls with the tokenizer's response template "
                             "(tokenizer.parse_response), and this tokenizer has none: set env.tool_parser to the "
                             f"model's format, one of {sorted(PARSERS)}")
        self.name = tool_parser if isinstance(tool_parser, str) else getattr(tool_parser, "__name__", "custom")
        self.reasoning_parser, self.tokenizer = reasoning_parser, tokenizer
        self.calls: Callable[[str], list[ToolCall]] | None = (
            None if tool_parser == "auto" else tool_parser if callable(tool_parser) else load_parser(tool_parser))
        self.schemas = schemas or []
        specials = sorted(set(specials or ()), key=len, reverse=True)
        self.specials = re.compile("|".join(map(re.escape, specials))) if specials else None

    def __call__(self, text: str, prefix: str = "") -> ParsedTurn:
        reasoning, rest = split_reasoning(text, self.reasoning_parser)
        if self.calls is None:
            return self._auto(rest, prefix, reasoning)
        calls = [typed_arguments(call, self.schemas) for call in self.calls(rest)]
        if self.name == "gpt_oss" or (self.reasoning_parser == "gpt_oss" and "<|channel|>" in rest):
            content = "".join(m.group("body") for m in harmony_messages(rest) if "<|channel|>final" in m.group("header"))
        else:
            content, end = "", 0
            for call in calls:
                if call.span is not None and call.span[0] >= end:
                    content, end = content + rest[end:call.span[0]], call.span[1]
            content = SECTIONS.sub("", content + rest[end:])
        marker = looks_like_a_call(content)
        if marker is not None:  # a call no parser read is an error the model reads, never silence
            calls.append(ToolCall(f"call_{len(calls)}", "", problem=f"this looks like a tool call ({marker!r}) but "
                                  f"the {self.name} parser cannot read it"))
        return ParsedTurn(self._clean(content), reasoning, calls)

    def _clean(self, text: str) -> str:
        return (self.specials.sub("", text) if self.specials else text).strip()

    def _auto(self, text: str, prefix: str, reasoning: str | None) -> ParsedTurn:
        """With the tokenizer's response template; a response it cannot read is one failed call."""
        try:
            message = self.tokenizer.parse_response(text, prefix=prefix, tools=self.schemas or None)
        except Exception as err:  # noqa: BLE001 - the template's parser raises ValueError/KeyError on bad output
            first_line = str(err).splitlines()[0] if str(err) else type(err).__name__
            return ParsedTurn(self._clean(text), reasoning, [ToolCall("call_0", "", problem=f"the response does not "
                                                                      f"parse: {first_line}")])
        calls = []
        for k, call in enumerate(message.get("tool_calls") or []):
            function = call.get("function", call) if isinstance(call, dict) else None
            call_id = (call.get("id") if isinstance(call, dict) else None) or f"call_{k}"
            calls.append(_auto_call(call_id, function) if isinstance(function, dict) else
                         ToolCall(call_id, "", problem="the call must be {\"name\": ..., \"arguments\": {...}}"))
        reasoning = message.get("reasoning_content") or message.get("thinking") or reasoning
        return ParsedTurn(self._clean(message.get("content") or ""), reasoning, calls)


def _auto_call(call_id: str, function: dict) -> ToolCall:
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except json.JSONDecodeError:
            return ToolCall(call_id, str(function.get("name", "")), problem="the arguments are not JSON")
    if not isinstance(arguments, dict):
        return ToolCall(call_id, str(function.get("name", "")), problem="the arguments must be a JSON object")
    return ToolCall(call_id, str(function.get("name", "")), arguments)
