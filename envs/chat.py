"""Conversation environments: the policy talks in chat messages, calls tools and reads their results.

    messages = await env.reset(sample)        # [system?, user]: the conversation so far
    turn = await env.step(assistant)          # AssistantMessage: the model's text, token ids, parsed tool calls
    turn.messages                             # what comes back: tool results (role "tool"), or a user turn
    turn.reward, turn.done

Tools are plain functions and MCP servers' tools listed in the config (`env.tools`, see envs/tools.py and
envs/mcp_tools.py); their schemas go to the chat template as `apply_chat_template(tools=...)` does, and the
model's calls are parsed from its text by `env.tool_parser`. A `ChatEnv` gets the job's `Toolbox` at construction and runs the calls it accepts
with `await self.call_tools(message.tool_calls)`, which counts calls, errors by kind and time.

The tokens are the framework's job (`ChatTokens`), and they are exact: the model's own ids are kept as
the engine sampled them, and each turn adds only the rendered conversation's suffix beyond what the
model already saw, tokenized on its own. A template that is not append-only (one that drops earlier
`<think>` blocks, or re-renders an earlier turn) is detected and the trajectory continues in a new
sequence holding the whole re-rendered conversation, counted as a template divergence (envs/chat_tokens.py).
"""

from __future__ import annotations

import asyncio
import logging
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from envs.base import Action, Env, StepResult
from envs.chat_tokens import ChatTokens, ToolTextGuard, template_markers  # noqa: F401 - the chat API in one place
from envs.chat_tokens import special_strings
from envs.tools import ERROR_KINDS, ToolCall, Toolbox, ToolResult
from envs.turns import ParsedTurn, TurnParser

logger = logging.getLogger(__name__)


@dataclass
class AssistantMessage:
    """One assistant turn: its text (special tokens left out), the engine's ids, the calls parsed from it, and,
    read by `env.reasoning_parser`, its content without reasoning and calls and its reasoning (None: none).

    Attributes:
        text: The turn as the model wrote it, special tokens left out.
        token_ids: The ids the engine sampled.
        tool_calls: The calls `env.tool_parser` read from the turn, in order; one that did not parse has its
            `problem` set (`ChatEnv.call_tools` answers it with an error).
        finish_reason: "stop" (EOS or a stop token) or "length" (cut by the token limit).
        content: The answer without reasoning and calls; None when nothing was parsed out (then `text`).
        reasoning_content: The reasoning (`env.reasoning_parser`); None when there is none.
    """

    text: str
    token_ids: list[int]
    tool_calls: list[ToolCall]
    finish_reason: str = "stop"
    content: str | None = None  # None: not parsed, the text is the content
    reasoning_content: str | None = None

    @property
    def message(self) -> dict:
        """The turn as an OpenAI-style assistant message: `role`, `content` and, when parsed, `reasoning_content`."""
        message = {"role": "assistant", "content": self.text if self.content is None else self.content}
        if self.reasoning_content is not None:
            message["reasoning_content"] = self.reasoning_content
        return message


@dataclass
class ChatStep:
    """The env's answer to an assistant turn: new messages (tool results, a user turn) or `done`.

    Attributes:
        messages: Messages that follow the turn, e.g. `call_tools`' tool messages or a next user turn; the
            framework renders them with the chat template. None or empty ends the trajectory, as `done` does.
        reward: Earned by this turn: put on its last token, and added to the trajectory's total reward.
        done: True ends the trajectory.
        info: Details kept with the trajectory, as `StepResult.info`.
    """

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
    The framework turns messages into tokens (the tokenizer's chat template, `env.chat_template_kwargs`) and
    the model's turns into `AssistantMessage`s (`env.tool_parser`, `env.reasoning_parser`); the env deals in
    messages only. `ToolUseEnv` below is a complete one.
    """

    def __init__(self, toolbox: Toolbox | None = None):
        self.toolbox = toolbox
        self.tool_stats = ToolStats()

    async def reset(self, sample: dict) -> list[dict]:
        """The conversation's first messages for one dataset row (system and user).

        Args:
            sample: The prompt's dataset row, as `envs.base.Env.reset` gets it.

        Returns:
            OpenAI-style messages (`{"role": ..., "content": ...}`), rendered with the tokenizer's chat
                template and the tools' schemas.
        """
        raise NotImplementedError

    async def step(self, message: AssistantMessage) -> ChatStep:
        """React to the model's turn: tool results or a next user turn, or `done` with a reward.

        Args:
            message: The model's turn, its tool calls parsed; run them with `call_tools`.
        """
        raise NotImplementedError

    async def close(self) -> None:
        """Release resources. Called once, when the pool drops the env."""

    async def call_tools(self, calls: list[ToolCall], max_calls: int | None = None) -> list[dict]:
        """Run `calls` concurrently; one `tool` message each, in order. Failures are messages too. Calls past
        the first `max_calls` are not run: each is answered with an error (`over_limit`).

        Every call is counted for the rollout's metrics: `rollout/tool_calls_mean`, `rollout/tool_errors_mean`
        and the errors by kind (`envs.tools.ERROR_KINDS`).

        Args:
            calls: The turn's calls (`AssistantMessage.tool_calls`).
            max_calls: How many of them run at most; None runs all.

        Returns:
            One `{"role": "tool", "tool_call_id", "name", "content"}` message per call, for `ChatStep.messages`.
        """
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
        """The sample's `prompt_key` column as the conversation (a text becomes the user turn), after
        `system_prompt` when the messages have no system turn."""
        self.tool_turns = 0
        if self.prompt_key not in sample:
            raise KeyError(f"ToolUseEnv needs a {self.prompt_key!r} column (env.kwargs.prompt_key), got {sorted(sample)}")
        prompt = sample[self.prompt_key]
        messages = [{"role": "user", "content": prompt}] if isinstance(prompt, str) else [dict(m) for m in prompt]
        if self.system_prompt is not None and (not messages or messages[0].get("role") != "system"):
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    async def step(self, message: AssistantMessage) -> ChatStep:
        """The turn's calls run and their results come back; a turn without calls, cut by the length limit or
        past `max_tool_turns` ends the episode (`info["answered"]` says whether it was an answer)."""
        if not message.tool_calls or message.finish_reason == "length":
            return ChatStep(done=True, info={"answered": bool(not message.tool_calls)})
        if self.tool_turns >= self.max_tool_turns:
            return ChatStep(done=True, info={"answered": False, "out_of_tool_turns": True})
        self.tool_turns += 1
        results = await self.call_tools(message.tool_calls, self.max_calls_per_turn)
        if self.max_result_chars is not None:
            results = [{**result, "content": result["content"][:self.max_result_chars]} for result in results]
        return ChatStep(results)


@dataclass
class ChatSetup:
    """What the framework gives conversation envs: the tokenizer (its chat template renders, with
    `template_kwargs`), the tools (None: no tools) and the reader of the model's turns (`TurnParser`)."""

    tokenizer: Any
    toolbox: Toolbox | None
    parser: TurnParser
    max_result_tokens: int | None = None  # each tool message cut to this many tokens
    template_kwargs: dict = field(default_factory=dict)  # env.chat_template_kwargs, e.g. {"enable_thinking": False}

    @classmethod
    def build(cls, tokenizer: Any, tools: list, parser: str = "hermes", reasoning_parser: str = "none",
              template_kwargs: dict | None = None, max_result_tokens: int | None = None,
              toolbox_options: dict | None = None) -> "ChatSetup":
        """From the env config's `tools` (import paths, MCP servers), `tool_parser`, `reasoning_parser`, `chat_template_kwargs`,
        `max_result_tokens`; `toolbox_options`: `Toolbox`'s timeout_s, max_threads, max_concurrent."""
        toolbox = Toolbox.from_paths(list(tools), **(toolbox_options or {})) if tools else None
        try:
            for function in (toolbox.functions.values() if toolbox else ()):
                said = getattr(function, "start_check", lambda: None)()  # a tool that cannot work here stops the job
                if said:
                    logger.info(said)  # e.g. which limits the sandbox enforces on this host
            if toolbox is not None and not template_renders_tools(tokenizer, toolbox.schemas):
                logger.warning("the tokenizer's chat template ignores `tools`: the model is not shown env.tools; use "
                               "a template that renders them, or describe them in the env's system prompt")
            turns = TurnParser(parser, reasoning_parser, toolbox.schemas if toolbox else None, tokenizer,
                               special_strings(tokenizer))
        except BaseException:
            if toolbox is not None:  # its MCP servers stop with the failed start
                toolbox.close()
            raise
        return cls(tokenizer, toolbox, turns, max_result_tokens, dict(template_kwargs or {}))

    def close(self) -> None:
        """At the job's end: the toolbox's MCP servers stop."""
        if self.toolbox is not None:
            self.toolbox.close()


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
    model's turns read by `parse` (`TurnParser`) and the env's tool use and template divergences in `info`.

    `info["conversation"]` holds the conversation so far for reward functions that score it
    (rl_core/rewards): `messages`, the rendered messages (the final assistant turn included; tool results
    as the model read them), and `tool_calls`, every call parsed from the model's turns as
    `{"id", "name", "arguments", "problem"}`. Nothing is tokenized again for it."""

    def __init__(self, env: ChatEnv, tokenizer: Any, parse: TurnParser, max_result_tokens: int | None = None,
                 template_kwargs: dict | None = None):
        self.env = env
        self.tokens = ChatTokens(tokenizer, env.toolbox.schemas if env.toolbox else None, max_result_tokens,
                                 template_kwargs, parse)

    async def reset(self, sample: dict) -> list[int]:
        self.env.tool_stats = ToolStats()
        self.calls: list[dict] = []  # every call the model wrote, for info["conversation"]
        messages = await self.env.reset(sample)
        if not messages:
            raise ValueError(f"{type(self.env).__name__}.reset returned no messages")
        return self.tokens.start(messages)

    async def step(self, action: Action) -> StepResult:
        turn: ParsedTurn = self.tokens.read_turn(action.token_ids)
        message = AssistantMessage(self.tokens.assistant_text(action.token_ids), list(action.token_ids),
                                   turn.tool_calls, action.finish_reason, turn.content, turn.reasoning)
        self.calls += [{"id": c.id, "name": c.name, "arguments": c.arguments, "problem": c.problem}
                       for c in turn.tool_calls]
        step = await self.env.step(message)
        if step.done or not step.messages:  # the last turn is in no rendering yet: added for the conversation
            final = self.tokens.messages + [self.tokens.assistant_message(action.token_ids, turn)]
            return StepResult(None, step.reward, True, self._info(step, final))
        ids = self.tokens.add_turn(action.token_ids, step.messages, turn)
        return StepResult(ids, step.reward, False, self._info(step, self.tokens.messages))

    def _info(self, step: ChatStep, messages: list[dict]) -> dict:
        return {**step.info, **self.env.tool_stats.info(), "template_divergences": self.tokens.divergences,
                "reprefill_tokens": self.tokens.reprefill_tokens,
                "conversation": {"messages": list(messages), "tool_calls": list(self.calls)}}

    async def close(self) -> None:
        await self.env.close()
