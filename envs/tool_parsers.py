"""Reading a model's turn: its reasoning, its answer and the tool calls it wrote, in each vendor's format.

    parse = TurnParser("qwen3_coder", "think", schemas=toolbox.schemas)
    turn = parse(text)         # text decoded with special tokens kept
    turn.reasoning, turn.content, turn.tool_calls

Tool-call parsers (`env.tool_parser`) take the turn's text and return its calls in order, each with the span of
text it came from. Each is written from its format's documentation:

- `hermes`: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>` (Hermes, Qwen2.5, Qwen3, Qwen3-2507).
- `qwen3_coder`: `<tool_call><function=NAME><parameter=KEY>value</parameter>...</function></tool_call>`.
- `llama3_json`: a JSON object `{"name": ..., "parameters"|"arguments": {...}}` (several joined by `;`),
  optionally after `<|python_tag|>` (Llama 3.1/3.2/3.3).
- `mistral`: `[TOOL_CALLS] [{"name": ..., "arguments": {...}}, ...]` (v3/v7 tokenizers) and
  `[TOOL_CALLS]NAME[ARGS]{...}` (v11+); ids are 9 alphanumerics, as Mistral's templates require.
- `deepseek_v3`: `<｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME\n```json\n{...}\n```<｜tool▁call▁end｜>`
  (V3/R1) and `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{...}<｜tool▁call▁end｜>` (V3.1).
- `glm45`: `<tool_call>NAME\n<arg_key>KEY</arg_key>\n<arg_value>value</arg_value>...</tool_call>` (GLM-4.5/4.6).
- `gpt_oss`: harmony messages addressed `to=functions.NAME` with a JSON body, ended by `<|call|>`.
- `kimi_k2`: `<|tool_call_begin|>functions.NAME:IDX<|tool_call_argument_begin|>{...}<|tool_call_end|>`.

Formats whose values are text (qwen3_coder, glm45) get them typed by the tool's schema. A call that does not
parse keeps a `problem` and is answered with an error (`unparsed`); so is a turn that looks like a call no
parser read (a call marker of any known format, or a `{"name": ..., "arguments": ...}` object).

Reasoning parsers (`env.reasoning_parser`): `none`; `think` (`<think>...</think>`, also when the prompt opened
the block); `gpt_oss` (the harmony `analysis` channel). Calls written inside reasoning are never run.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.plugins import load_by_path


class ToolError(Exception):
    """A tool's own failure, shown to the model as its message says (error kind "raised"); here beside
    `ToolCall` so the toolbox and the MCP client (envs/mcp_tools.py) share it without importing each other."""


@dataclass
class ToolCall:
    """One call the model wrote: `arguments` parsed, or `problem` saying why they could not be.

    Attributes:
        id: The call's id, which its `tool` message answers (`tool_call_id`).
        name: The tool it names.
        arguments: The arguments by name, typed by the tool's schema where the format writes text.
        problem: Why the call could not be read; None when it parsed. Such a call is answered with an error
            (kind `unparsed`) and never run.
        span: Where in the turn's text the call was written (start, end).
    """

    id: str
    name: str
    arguments: dict[str, Any] = field(default_factory=dict)
    problem: str | None = None
    span: tuple[int, int] | None = field(default=None, compare=False, repr=False)  # where in the text


def _json_call(call_id: str, body: str, span: tuple[int, int], keys: tuple[str, ...] = ("arguments",)) -> ToolCall:
    """`{"name": ..., <key>: {...}}` as a call; what went wrong kept as its `problem`."""
    try:
        payload = json.loads(body)
    except json.JSONDecodeError as err:
        name = re.search(r'"name"\s*:\s*"([^"]*)"', body)
        return ToolCall(call_id, name.group(1) if name else "", problem=f"the call is not JSON ({err.msg})", span=span)
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return ToolCall(call_id, "", problem='the call must be {"name": ..., "arguments": {...}}', span=span)
    arguments = next((payload[key] for key in keys if key in payload), {})
    return _with_arguments(call_id, payload["name"], arguments, span)


def _with_arguments(call_id: str, name: str, arguments: Any, span: tuple[int, int]) -> ToolCall:
    if isinstance(arguments, str):  # some models write the arguments as a JSON string, as OpenAI's API does
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            pass
    if not isinstance(arguments, dict):
        return ToolCall(call_id, name, problem="the arguments must be a JSON object", span=span)
    return ToolCall(call_id, name, arguments, span=span)


HERMES_CALL = re.compile(r"<tool_call>\s*(.*?)\s*</tool_call>", re.DOTALL)


def hermes_tool_calls(text: str) -> list[ToolCall]:
    """The calls in Hermes/Qwen style, `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, in order;
    ids `call_0`, `call_1`, ... A call whose JSON does not parse keeps a `problem` (and a name if one shows)."""
    return [_json_call(f"call_{k}", m.group(1), m.span()) for k, m in enumerate(HERMES_CALL.finditer(text))]


CODER_CALL = re.compile(r"<tool_call>\s*<function=([^>\n]*)>(.*?)</function>\s*</tool_call>", re.DOTALL)
CODER_PARAMETER = re.compile(r"<parameter=([^>\n]*)>\n?(.*?)\n?</parameter>", re.DOTALL)


def qwen3_coder_tool_calls(text: str) -> list[ToolCall]:
    """Qwen3-Coder's XML calls; parameter values are text (typed later by the tool's schema)."""
    return [ToolCall(f"call_{k}", m.group(1).strip(), {key.strip(): value for key, value in
                                                       CODER_PARAMETER.findall(m.group(2))}, span=m.span())
            for k, m in enumerate(CODER_CALL.finditer(text))]


GLM_CALL = re.compile(r"<tool_call>([^<\n]*)(.*?)</tool_call>", re.DOTALL)
GLM_ARGUMENT = re.compile(r"<arg_key>(.*?)</arg_key>\s*<arg_value>(.*?)</arg_value>", re.DOTALL)


def glm45_tool_calls(text: str) -> list[ToolCall]:
    """GLM-4.5's calls: the name after `<tool_call>`, then key/value pairs (values as text, typed later)."""
    calls = []
    for k, m in enumerate(GLM_CALL.finditer(text)):
        name = m.group(1).strip()
        problem = None if name else "the call names no function"
        calls.append(ToolCall(f"call_{k}", name, {key.strip(): value for key, value in GLM_ARGUMENT.findall(m.group(2))},
                              problem, span=m.span()))
    return calls


PYTHON_TAG = "<|python_tag|>"
LLAMA_START = re.compile(r'<\|python_tag\|>|\{\s*"name"\s*:')


def llama3_json_tool_calls(text: str) -> list[ToolCall]:
    """Llama 3.x JSON calls: from the first `<|python_tag|>` or `{"name":`, objects joined by `;`."""
    start = LLAMA_START.search(text)
    if start is None:
        return []
    position = start.end() if start.group(0) == PYTHON_TAG else start.start()
    decoder, calls, previous_end = json.JSONDecoder(), [], start.start()
    while True:
        while position < len(text) and text[position] in " \t\n\r;":
            position += 1
        if position >= len(text) or text.startswith("<|", position):  # the end, or an end-of-turn token
            return calls
        begin = position
        try:
            _, position = decoder.raw_decode(text, position)
        except json.JSONDecodeError as err:
            if not calls:  # after a call, what does not parse is the turn's text
                calls.append(ToolCall("call_0", "", problem=f"the call is not JSON ({err.msg})",
                                      span=(start.start(), len(text))))
            return calls
        calls.append(_json_call(f"call_{len(calls)}", text[begin:position], (previous_end, position),
                                ("parameters", "arguments")))
        previous_end = position


MISTRAL_MARK = "[TOOL_CALLS]"
MISTRAL_NAMED = re.compile(r"\s*([\w.\-]+)(?:\[CALL_ID\][\w]*)?\[ARGS\]")


def mistral_tool_calls(text: str) -> list[ToolCall]:
    """Mistral calls after each `[TOOL_CALLS]`: a JSON list (v3/v7) or `NAME[ARGS]{...}` (v11+)."""
    decoder, calls = json.JSONDecoder(), []
    for m in re.finditer(re.escape(MISTRAL_MARK), text):
        call_id = f"call{len(calls):05d}"  # Mistral templates refuse ids that are not 9 alphanumerics
        named = MISTRAL_NAMED.match(text, m.end())
        begin = named.end() if named else m.end()
        while begin < len(text) and text[begin].isspace():
            begin += 1
        try:
            value, end = decoder.raw_decode(text, begin)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(call_id, named.group(1) if named else "", problem=f"the call is not JSON ({err.msg})",
                                  span=(m.start(), len(text))))
            continue
        if named:
            calls.append(_with_arguments(call_id, named.group(1), value, (m.start(), end)))
            continue
        for item in value if isinstance(value, list) else [value]:
            call = _json_call(f"call{len(calls):05d}", json.dumps(item), (m.start(), end))
            given = item.get("id") if isinstance(item, dict) else None
            if isinstance(given, str) and len(given) == 9 and given.isalnum():  # the id the model wrote
                call.id = given
            calls.append(call)
    return calls


DEEPSEEK_CALL = re.compile(r"<｜tool▁call▁begin｜>(.*?)<｜tool▁sep｜>(.*?)<｜tool▁call▁end｜>", re.DOTALL)
DEEPSEEK_FENCED = re.compile(r"([^\n]*)\n```(?:json)?\n(.*?)\n```\s*$", re.DOTALL)


def deepseek_v3_tool_calls(text: str) -> list[ToolCall]:
    """DeepSeek-V3/R1 calls (type, name and a fenced JSON block) and V3.1 calls (name, then JSON)."""
    calls = []
    for k, m in enumerate(DEEPSEEK_CALL.finditer(text)):
        fenced = DEEPSEEK_FENCED.match(m.group(2))
        name, body = (fenced.group(1), fenced.group(2)) if fenced else (m.group(1), m.group(2))
        try:
            arguments = json.loads(body)
        except json.JSONDecodeError as err:
            calls.append(ToolCall(f"call_{k}", name.strip(), problem=f"the arguments are not JSON ({err.msg})",
                                  span=m.span()))
            continue
        calls.append(_with_arguments(f"call_{k}", name.strip(), arguments, m.span()))
    return calls


HARMONY_MESSAGE = re.compile(r"(?:<\|start\|>assistant)?(?P<header>(?:(?!<\|message\|>|<\|start\|>).)*)<\|message\|>"
                             r"(?P<body>.*?)(?:<\|end\|>|<\|call\|>|<\|return\|>|$)", re.DOTALL)
HARMONY_RECIPIENT = re.compile(r"to=functions\.([\w.\-]+)")


def harmony_messages(text: str) -> list[re.Match]:
    return list(HARMONY_MESSAGE.finditer(text))


def gpt_oss_tool_calls(text: str) -> list[ToolCall]:
    """gpt-oss (harmony) calls: messages addressed `to=functions.NAME`, whose body is the JSON arguments."""
    calls = []
    for m in harmony_messages(text):
        recipient = HARMONY_RECIPIENT.search(m.group("header"))
        if recipient is None:
            continue
        try:
            arguments = json.loads(m.group("body"))
        except json.JSONDecodeError as err:
            calls.append(ToolCall(f"call_{len(calls)}", recipient.group(1), problem=f"the arguments are not JSON "
                                  f"({err.msg})", span=m.span()))
            continue
        calls.append(_with_arguments(f"call_{len(calls)}", recipient.group(1), arguments, m.span()))
    return calls


KIMI_CALL = re.compile(r"<\|tool_call_begin\|>\s*(?:functions\.)?([\w.\-]+?)(?::(\d+))?\s*"
                       r"<\|tool_call_argument_begin\|>(.*?)<\|tool_call_end\|>", re.DOTALL)


def kimi_k2_tool_calls(text: str) -> list[ToolCall]:
    """Kimi-K2 calls: `functions.NAME:IDX`, then the JSON arguments; the id is Kimi's own `functions.NAME:IDX`."""
    calls = []
    for k, m in enumerate(KIMI_CALL.finditer(text)):
        call_id = f"functions.{m.group(1)}:{m.group(2) if m.group(2) is not None else k}"
        try:
            arguments = json.loads(m.group(3))
        except json.JSONDecodeError as err:
            calls.append(ToolCall(call_id, m.group(1), problem=f"the arguments are not JSON ({err.msg})", span=m.span()))
            continue
        calls.append(_with_arguments(call_id, m.group(1), arguments, m.span()))
    return calls


PARSERS: dict[str, Callable[[str], list[ToolCall]]] = {
    "hermes": hermes_tool_calls, "qwen3_coder": qwen3_coder_tool_calls, "llama3_json": llama3_json_tool_calls,
    "mistral": mistral_tool_calls, "deepseek_v3": deepseek_v3_tool_calls, "glm45": glm45_tool_calls,
    "gpt_oss": gpt_oss_tool_calls, "kimi_k2": kimi_k2_tool_calls,
}
REASONING_PARSERS = ("none", "think", "gpt_oss")


def load_parser(name_or_path: str) -> Callable[[str], list[ToolCall]]:
    """A parser by name (`PARSERS`) or import path ("pkg.module:function", text -> list[ToolCall])."""
    if name_or_path in PARSERS:
        return PARSERS[name_or_path]
    if ":" not in name_or_path:
        raise ValueError(f"tool-call parser {name_or_path!r} is neither one of {sorted(PARSERS)} (or 'auto') nor an "
                         "import path 'pkg.module:function'")
    return load_by_path(name_or_path, "tool-call parser", "envs.tools:hermes_tool_calls")
