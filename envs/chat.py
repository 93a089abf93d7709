"""Conversation environments: the policy talks in chat messages, calls tools and reads their results.

    messages = await env.reset(sample)        # [system?, user]: the conversation so far
    turn = await env.step(assistant)          # AssistantMessage: the model's text, token ids, parsed tool calls
    turn.messages                             # what comes back: tool results (role "tool"), or a user turn
    turn.reward, turn.done

Tools are plain functions listed in the config (`env.tools`, see envs/tools.py); their schemas go to the
chat template as `apply_chat_template(tools=...)` does, and the model's calls are parsed from its text by
`env.tool_parser`. A `ChatEnv` gets the job's `Toolbox` at construction and runs the calls it accepts
with `await self.call_tools(message.tool_calls)`, which counts calls, errors by kind and time.

The tokens are the framework's job (`ChatTokens`), and they are exact: the model's own ids are kept as
the engine sampled them, and each turn adds only the rendered conversation's suffix beyond what the
model already saw, tokenized on its own. A template that is not append-only (one that drops earlier
`<think>` blocks, or re-renders an earlier turn) is detected and the trajectory continues in a new
sequence holding the whole re-rendered conversation, counted as a template divergence.
"""

from __future__ import annotations

import asyncio
import logging
import re
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Callable

from envs.base import Action, Env, StepResult
from envs.tools import ERROR_KINDS, ToolCall, Toolbox, ToolResult, load_parser

logger = logging.getLogger(__name__)


@dataclass
class AssistantMessage:
    """One assistant turn: its text (special tokens left out), the engine's ids, the calls parsed from it."""

    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall]
    finish_reason: str = "stop"

    @property
    def message(self) -> dict:
        return {"role": "assistant", "content": self.text}


@dataclass
class ChatStep:
    """The env's answer to an assistant turn: new messages (tool results, a user turn) or `done`."""

    messages: list[dict] = field(default_factory=list)
    reward: float = 0.0
    done: bool = False
    info: dict = field(default_factory=dict)


@dataclass
class ToolStats:
    """One trajectory's tool use, reported in the rollout's metrics."""

    calls: int = 0
    errors: Counter = field(default_factory=Counter)  # ERROR_KINDS -> count
    seconds: float = 0.0

    def info(self) -> dict[str, float]:
        out = {"tool_calls": self.calls, "tool_errors": sum(self.errors.values()), "tool_time_s": self.seconds}
        out.update({f"tool_errors/{kind}": self.errors[kind] for kind in ERROR_KINDS})
        return out


class ChatEnv:
    """Async conversation environment. Subclass and implement `reset` and `step`; `close` is optional.

    Constructor: `toolbox` (the job's tools, None without `env.tools`) plus the plain values of
    `env.kwargs`. One instance serves many trajectories in turn, so `reset` clears per-trajectory state.
    """

    def __init__(self, toolbox: Toolbox | None = None):
        self.toolbox = toolbox
        self.tool_stats = ToolStats()

    async def reset(self, sample: dict) -> list[dict]:
        """The conversation's first messages for one dataset row (system and user)."""
        raise NotImplementedError

    async def step(self, message: AssistantMessage) -> ChatStep:
        """React to the model's turn: tool results or a next user turn, or `done` with a reward."""
        raise NotImplementedError

    async def close(self) -> None:
        """Release resources. Called once, when the pool drops the env."""

    async def call_tools(self, calls: list[ToolCall], max_calls: int | None = None) -> list[dict]:
        """Run `calls` concurrently; one `tool` message each, in order. Failures are messages too. Calls past
        the first `max_calls` are not run: each is answered with an error (`over_limit`)."""
        toolbox = self.toolbox or Toolbox([])  # no env.tools: every call is answered "no tool named ..."
        run, refused = (calls, []) if max_calls is None else (calls[:max_calls], calls[max_calls:])
        results = await asyncio.gather(*(toolbox.run(call) for call in run))
        results += [ToolResult({"role": "tool", "tool_call_id": call.id, "name": call.name,
                                "content": f"error: at most {max_calls} tool calls per turn; this one was not run"},
                               "over_limit", 0.0) for call in refused]
        for result in results:
            self.tool_stats.calls += 1
            self.tool_stats.seconds += result.seconds
            if result.error is not None:
                self.tool_stats.errors[result.error] += 1
        return [result.message for result in results]


class ToolUseEnv(ChatEnv):
    """A question answered with tools: each turn's calls run and their results come back; a turn without a
    call is the answer, which the job's reward functions score (`reward.fns`; the env gives no reward).

    `prompt_key`: the sample's column holding the messages (or a text, sent as the user turn);
    `system_prompt`: prepended when given; `max_tool_turns`: turns with calls before the episode ends;
    `max_result_chars`: each tool message cut to this many characters (a small context cannot take a
    long result or error; None keeps them whole); `max_calls_per_turn`: calls of one turn that run, the rest
    answered with an error (a policy may write dozens in one turn).
    """

    def __init__(self, toolbox: Toolbox | None = None, prompt_key: str = "messages", system_prompt: str | None = None,
                 max_tool_turns: int = 4, max_result_chars: int | None = None, max_calls_per_turn: int = 8):
        super().__init__(toolbox)
        if max_tool_turns < 0:
            raise ValueError(f"ToolUseEnv: max_tool_turns must be >= 0, got {max_tool_turns}")
        if max_calls_per_turn < 1:
            raise ValueError(f"ToolUseEnv: max_calls_per_turn must be >= 1, got {max_calls_per_turn}")
        self.max_calls_per_turn = max_calls_per_turn
        if max_result_chars is not None and max_result_chars < 1:
            raise ValueError(f"ToolUseEnv: max_result_chars must be >= 1 or null, got {max_result_chars}")
        self.prompt_key, self.system_prompt, self.max_tool_turns = prompt_key, system_prompt, max_tool_turns
        self.max_result_chars = max_result_chars
        self.tool_turns = 0

    async def reset(self, sample: dict) -> list[dict]:
        self.tool_turns = 0
        if self.prompt_key not in sample:
            raise KeyError(f"ToolUseEnv needs a {self.prompt_key!r} column (env.kwargs.prompt_key), got {sorted(sample)}")
        prompt = sample[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def step(self, message: AssistantMessage) -> ChatStep:
        if not message.tool_calls or message.finish_reason == "length":
            return ChatStep(done=True, info={"answered": bool(not message.tool_calls)})
        if self.tool_turns >= self.max_tool_turns:
            return ChatStep(done=True, info={"answered": False, "out_of_tool_turns": True})
        self.tool_turns += 1
        results = await self.call_tools(message.tool_calls, self.max_calls_per_turn)
        if self.max_result_chars is not None:
            results = [{**result, "content": result["content"][:self.max_result_chars]} for result in results]
        return ChatStep(results)


ZERO_WIDTH_SPACE = "\u200b"


class ToolTextGuard:
    """Tool output as text that cannot forge a turn: every special or added token of the tokenizer and every
    line of text the chat template writes around messages (`<|im_start|>user`, `User:`) that appears in it is
    broken by a zero-width space after its first character, so it is tokenized as plain text and reads as
    no turn. Code a policy writes prints what it likes; without this a printed `<|im_end|>` became the real
    special token, and a printed `User:` line a turn to anything that reads the transcript."""

    def __init__(self, tokenizer: Any):
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        strings = set(getattr(tokenizer, "all_special_tokens", [])) | {token.content for token in added.values()}
        tokens = re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True))) or "$^")
        for marker in template_markers(tokenizer):  # a header after an end-of-turn token forges a turn alone too
            strings.update(part.strip() for part in tokens.split(marker))
            strings.add(marker)
        strings = sorted((text for text in strings if len(text.strip()) > 1), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def __call__(self, text: str) -> str:
        if self.pattern is None:
            return text
        for _ in range(8):  # a break may leave the text around it forming another marker: until none is left
            broken = self.pattern.sub(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], text)
            if broken == text:
                break
            text = broken
        return text


def template_markers(tokenizer: Any) -> set[str]:
    """The lines of text the chat template writes between messages (role headers, end-of-turn markers), found
    by rendering probe conversations whose contents are placeholders; a template that refuses a probe (a role
    it does not know, an order it does not allow) is simply probed less."""
    probes = [["system", "user", "assistant", "user"], ["user", "assistant", "tool", "user"], ["user"]]
    markers: set[str] = set()
    for roles in probes:
        messages = []
        for k, role in enumerate(roles):
            message = {"role": role, "content": f"\x07{k}\x07"}
            if role == "tool":
                message.update(tool_call_id="call_0", name="probe")
            messages.append(message)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates raise what they like on conversations they refuse
            continue
        for piece in re.split(r"\x07\d+\x07", text):
            markers.update(line.strip() for line in piece.splitlines() if len(line.strip()) >= 3)
    return markers


class ChatTokens:
    """One conversation as token ids the model saw, kept exact turn by turn.

    `start(messages)` renders the first messages with the generation prompt. `add_turn(ids, new)` keeps
    the engine's `ids` as they are, appends the assistant turn (rendered from the model's own text) and
    the new messages to the conversation and renders it again: if that rendering starts with the text
    the model saw (the previous rendering plus the decoded ids), only the rest is tokenized and appended.
    That rest starts with whatever of the template's end-of-turn text the model did not generate itself
    (all of it when a length limit cut the turn; only the newline after a generated `<|im_end|>`).
    Otherwise the template rewrote something the model saw, and a new sequence starts with the whole
    rendering (`divergences` counts these).
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, max_result_tokens: int | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a conversation env needs a tokenizer with a chat template; set model.tokenizer_path to "
                             "one that has")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.guard = ToolTextGuard(tokenizer)
        self.max_result_tokens = max_result_tokens  # a tool message's text cut to this many tokens (None: whole)
        self.messages: list[dict] = []
        self.text = ""  # the text of `ids`: what the model has seen
        self.ids: list[int] = []
        self.divergences = 0

    def render(self, messages: list[dict]) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=True,
                                                  tokenize=False)

    def encode(self, text: str) -> list[int]:
        """A rendered piece on its own; the template writes any BOS itself."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def start(self, messages: list[dict]) -> list[int]:
        self.messages = [dict(m) for m in messages]
        self.text = self.render(self.messages)
        self.ids = self.encode(self.text)
        self.divergences = 0
        return list(self.ids)

    def assistant_text(self, action_ids: list[int]) -> str:
        """The turn's content as the template gets it: the model's text without special tokens (the stop
        token is the template's to write)."""
        return self.decode(action_ids, skip_special_tokens=True)

    def tool_text(self, text: str) -> str:
        """A tool message's text as the model gets it: guarded (`ToolTextGuard`), then cut to `max_result_tokens`."""
        text = self.guard(text)
        if self.max_result_tokens is not None:
            ids = self.encode(text)
            if len(ids) > self.max_result_tokens:
                text = self.decode(ids[:self.max_result_tokens], skip_special_tokens=False)
        return text

    def add_turn(self, action_ids: list[int], new_messages: list[dict]) -> list[int]:
        """The ids of the next state: the current sequence extended, or a new one (a divergence). Tool messages'
        text goes through `ToolTextGuard`."""
        new_messages = [{**m, "content": self.tool_text(m["content"])} if m.get("role") == "tool" and
                        isinstance(m.get("content"), str) else dict(m) for m in new_messages]
        self.messages += [{"role": "assistant", "content": self.assistant_text(action_ids)}, *new_messages]
        seen = self.text + self.decode(action_ids, skip_special_tokens=False)
        rendered = self.render(self.messages)
        if rendered.startswith(seen):
            self.ids = self.ids + list(action_ids) + self.encode(rendered[len(seen):])
        else:
            self.divergences += 1
            self.ids = self.encode(rendered)
        self.text = rendered
        return list(self.ids)


@dataclass
class ChatSetup:
    """What the framework gives conversation envs: the tokenizer (its chat template renders), the tools
    (None: no tools) and the parser of the model's tool calls."""

    tokenizer: Any
    toolbox: Toolbox | None
    parser: Callable[[str], list[ToolCall]]
    max_result_tokens: int | None = None  # each tool message cut to this many tokens

    @classmethod
    def build(cls, tokenizer: Any, tools: list[str], parser: str = "hermes", timeout_s: float = 30.0,
              max_threads: int = 8, max_concurrent: int = 8, max_result_tokens: int | None = None) -> "ChatSetup":
        """From the env config's `tools` (import paths), `tool_parser`, `tool_timeout_s`, `tool_concurrency` and
        `max_result_tokens`."""
        toolbox = Toolbox.from_paths(list(tools), timeout_s=timeout_s, max_threads=max_threads,
                                     max_concurrent=max_concurrent) if tools else None
        for function in (toolbox.functions.values() if toolbox else ()):
            said = getattr(function, "start_check", lambda: None)()  # a tool that cannot work here stops the job now
            if said:
                logger.info(said)  # e.g. which limits the sandbox enforces on this host
        if toolbox is not None and not template_renders_tools(tokenizer, toolbox.schemas):
            logger.warning("the tokenizer's chat template ignores `tools`: the model is not shown env.tools; use a "
                           "template that renders them, or describe them in the env's system prompt")
        return cls(tokenizer, toolbox, load_parser(parser), max_result_tokens)


def template_renders_tools(tokenizer: Any, schemas: list[dict]) -> bool:
    """Whether the tokenizer's chat template shows `tools` at all (many plain templates drop them)."""
    if not getattr(tokenizer, "chat_template", None):
        return False
    probe = [{"role": "user", "content": "hi"}]
    render = lambda tools: tokenizer.apply_chat_template(probe, tools=tools, add_generation_prompt=True,  # noqa: E731
                                                         tokenize=False)
    return render(schemas) != render(None)


class ChatEnvAdapter(Env):
    """Presents a `ChatEnv` as a token-level `Env`: messages in, token ids out (`ChatTokens`), with the
    model's tool calls parsed by `parse` and the env's tool use and template divergences in `info`."""

    def __init__(self, env: ChatEnv, tokenizer: Any, parse: Callable[[str], list[ToolCall]],
                 max_result_tokens: int | None = None):
        self.env = env
        self.parse = parse
        self.tokens = ChatTokens(tokenizer, env.toolbox.schemas if env.toolbox else None, max_result_tokens)

    async def reset(self, sample: dict) -> list[int]:
        self.env.tool_stats = ToolStats()
        messages = await self.env.reset(sample)
        if not messages:
            raise ValueError(f"{type(self.env).__name__}.reset returned no messages")
        return self.tokens.start(messages)

    async def step(self, action: Action) -> StepResult:
        text = self.tokens.assistant_text(action.token_ids)
        message = AssistantMessage(text, list(action.token_ids), self.parse(text), action.finish_reason)
        turn = await self.env.step(message)
        if turn.done or not turn.messages:
            return StepResult(None, turn.reward, True, self._info(turn))
        ids = self.tokens.add_turn(action.token_ids, turn.messages)
        return StepResult(ids, turn.reward, False, self._info(turn))

    def _info(self, turn: ChatStep) -> dict:
        return {**turn.info, **self.env.tool_stats.info(), "template_divergences": self.tokens.divergences}

    async def close(self) -> None:
        await self.env.close()
