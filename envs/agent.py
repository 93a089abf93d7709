"""Outside agent code, trained: the user's agent drives the conversation through an OpenAI-compatible endpoint,
and every model call it makes is one action of the trajectory.

    env:
      cls: envs.agent:AgentEnv
      kwargs: {agent: my_pkg.my_agent:run}      # async def run(base_url: str, sample: dict) -> float | dict

Each env serves `POST <base_url>/chat/completions` from an aiohttp server on 127.0.0.1, on the rollout's event
loop (rank 0), where `base_url` is `http://127.0.0.1:PORT/sessions/<id>/v1` and `<id>` names one trajectory. To
the rollout the agent looks like any env: `reset` starts the agent and returns the prompt ids of its first
request, `step(action)` answers that request with the engine's tokens (tool calls parsed with `env.tool_parser`,
reasoning with `env.reasoning_parser`) and returns the prompt ids of the next request, or `done` with the
agent's return as the reward. So every engine call goes through the rollout's own `/generate` path (policy
versions per token, first-turn waves, abort retries), and the trainer sees ordinary trajectories.

The prompt ids are exact (`ChatTokens`): while the agent sends back the conversation as it got it (its
messages, then the answer, then new tool results or user turns), the next prompt is the previous prompt, the
sampled ids as they are, and the rendering's new suffix tokenized on its own: one sequence. A conversation the
agent rewrote (a message dropped or edited, other tools) starts a new sequence, counted in
`rollout/template_divergences` like a template that rewrites its history.
"""

from __future__ import annotations

import asyncio
import copy
import inspect
import json
import uuid
from collections import deque
from dataclasses import dataclass
from typing import Any, Callable

from envs.base import Action, Env, StepResult
from envs.chat_tokens import ChatTokens
from envs.openai_api import AgentServer, ApiError, ChatRequest, completion, same_message, template_messages
from envs.plugins import load_by_path
from envs.turns import ParsedTurn


@dataclass
class AgentCall:
    """One model call of the agent, as the engine saw and answered it."""

    prompt_ids: list[int]
    output_ids: list[int]
    logprobs: list[float]


@dataclass
class _Request:
    """A request waiting for its action: what the engine is sent, and the future its HTTP handler awaits."""

    request: ChatRequest
    prompt_ids: list[int]
    stop_ids: list[int]
    answer: asyncio.Future


def load_agent(path: str) -> Callable:
    """The agent function at `path` ("pkg.module:function"); it must be `async def fn(base_url, sample)`.

    The function runs one trajectory: `base_url` is an OpenAI-compatible endpoint (`.../v1`) of its own,
    whose every `chat/completions` request is one action sampled by the policy, and `sample` the prompt's
    dataset row. It returns the reward, a number, or a dict with `reward` and other numbers, each logged as
    `rollout/agent/<key>`. What it raises fails its trajectory, like an env's error. A trajectory is one
    conversation: the agent sends its requests one at a time (parallel conversations are separate trajectories).
    """
    fn = load_by_path(path, "agent", "my_pkg.my_agent:run")
    if not inspect.iscoroutinefunction(fn):
        raise TypeError(f"{path!r} is {fn!r}, not an async function: the agent must be "
                        "`async def fn(base_url: str, sample: dict) -> float | dict`")
    return fn


def agent_reward(result: Any) -> tuple[float, dict[str, float]]:
    """(reward, metrics) from the agent's return: a number, or a dict with `reward` and numeric metrics."""
    if isinstance(result, (int, float)) and not isinstance(result, bool):
        return float(result), {}
    if isinstance(result, dict) and "reward" in result:
        try:
            return float(result["reward"]), {f"agent/{k}": float(v) for k, v in result.items() if k != "reward"}
        except (TypeError, ValueError):
            pass
    raise TypeError(f"the agent returned {result!r}: return the reward (a number) or a dict with 'reward' and "
                    "numeric metrics")


class AgentEnv(Env):
    """The user's agent (`agent`: "pkg.module:fn") as an env; see the module's docstring."""

    wants_chat = True  # make_env_factory passes the job's ChatSetup (tokenizer, parsers, template kwargs)

    def __init__(self, agent: str, chat: Any = None):
        if chat is None:
            raise ValueError("AgentEnv renders chats: build it with make_env_factory(..., chat=envs.chat.ChatSetup)")
        self.agent_path, self.agent = agent, load_agent(agent)
        self.chat = chat
        self.server = AgentServer(self._complete)
        self.session: str | None = None
        self.ended: deque[str] = deque(maxlen=64)  # recent sessions, told apart from unknown ones in errors
        self.task: asyncio.Task | None = None
        self.waiting: asyncio.Queue = asyncio.Queue()
        self.pending: _Request | None = None  # the request the next action answers
        self._clear()

    @classmethod
    def check_kwargs(cls, kwargs: dict) -> None:
        """At job start: the agent's import path resolves to an async function (else one line naming the key)."""
        from rl_core.errors import JobError

        if set(kwargs) != {"agent"}:
            raise JobError("env.cls=envs.agent:AgentEnv takes one key, env.kwargs.agent: the agent function as "
                           f"'pkg.module:fn' (async def fn(base_url, sample) -> float | dict); got {sorted(kwargs)}")
        try:
            load_agent(kwargs["agent"])
        except (ImportError, ValueError, TypeError) as err:
            raise JobError(f"env.kwargs.agent: {err}") from None

    def _clear(self) -> None:
        self.tokens: ChatTokens | None = None
        self.sent: list[dict] = []  # the conversation the model has seen, its last answer included
        self.last: tuple[list[int], ParsedTurn] | None = None  # the last answer's ids, parsed
        self.calls: list[AgentCall] = []
        self.rewrites = self.rewrite_tokens = self.tool_calls = self.unparsed = 0

    async def reset(self, sample: dict) -> list[int]:
        await self.finish()
        await self.server.start()
        self._clear()
        self.session = uuid.uuid4().hex
        self.task = asyncio.ensure_future(self.agent(self.server.base_url(self.session), dict(sample)))
        if await self._next() is None:
            raise RuntimeError(f"the agent {self.agent_path} returned before calling the model: nothing to train on; "
                               "it must call chat.completions at the base_url it is given")
        return self.pending.prompt_ids

    def next_sampling(self) -> dict:
        wanted = self.pending.request.max_tokens if self.pending else None
        return {"max_new_tokens": wanted, "stop_token_ids": self.pending.stop_ids if self.pending else []}

    async def step(self, action: Action) -> StepResult:
        pending, self.pending = self.pending, None
        self.calls.append(AgentCall(pending.prompt_ids, list(action.token_ids), list(action.logprobs)))
        turn = self.tokens.read_turn(action.token_ids)
        message, reason = self._message(turn, action.finish_reason)
        self.sent = pending.request.messages + template_messages([message])
        self.last = (list(action.token_ids), turn)
        if not pending.answer.done():
            usage = (len(pending.prompt_ids), len(action.token_ids))
            pending.answer.set_result(completion(message, reason, pending.request.model, usage))
        if await self._next() is None:
            reward, metrics = agent_reward(self.task.result())
            return StepResult(None, reward, True, {**metrics, **self._info()})
        return StepResult(self.pending.prompt_ids, 0.0, False, self._info())

    async def finish(self) -> None:
        """End the session: a request still waiting gets 410, the agent (if still running) is cancelled."""
        if self.session is not None:
            self.ended.append(self.session)
            self.session = None
        ended = ApiError(410, f"session {self.ended[-1] if self.ended else ''} is over: its trajectory ended (the agent returned, or it ran "
                              "out of rollout.max_turns or of context); a session serves one trajectory")
        waiting = [self.pending] if self.pending else []
        while not self.waiting.empty():
            waiting.append(self.waiting.get_nowait())
        self.pending = None
        for request in waiting:
            if not request.answer.done():
                request.answer.set_exception(ended)
        task, self.task = self.task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)

    async def close(self) -> None:
        await self.finish()
        await self.server.stop()

    async def _next(self) -> _Request | None:
        """The agent's next request (now `pending`), or None when it returned (its error raised: a failed trajectory)."""
        getter = asyncio.ensure_future(self.waiting.get())
        try:
            await asyncio.wait({getter, self.task}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            getter.cancel()
        if getter.done() and not getter.cancelled():
            self.pending = getter.result()
            return self.pending
        self.task.result()
        return None

    async def _complete(self, session: str, request: ChatRequest) -> dict:
        """The HTTP handler's side: check the session, compute the prompt ids, wait for the action's answer."""
        if session != self.session:
            if session in self.ended:
                raise ApiError(410, f"session {session} is over: its trajectory ended; a session serves one trajectory")
            raise ApiError(404, f"unknown session {session!r}: call the base_url the agent was given for this "
                                "trajectory", "not_found_error")
        if self.pending is not None or not self.waiting.empty():
            raise ApiError(409, "this session has a request in flight: a trajectory is one conversation, so send "
                                "its calls one at a time (run parallel conversations as separate trajectories)")
        stop_ids = self._stop_ids(request.stop)
        prompt_ids = self._prompt(request)
        answer = asyncio.get_running_loop().create_future()
        self.waiting.put_nowait(_Request(request, prompt_ids, stop_ids, answer))
        return await answer

    def _stop_ids(self, stop: list[str]) -> list[int]:
        ids = []
        for text in stop:
            encoded = self.chat.tokenizer.encode(text, add_special_tokens=False)
            if len(encoded) != 1:
                raise ApiError(400, f"stop string {text!r} is {len(encoded)} tokens: only single-token stops are "
                                    "supported (the engine's tokens are trained as sampled, never cut in text)")
            ids += encoded
        return ids

    def _prompt(self, request: ChatRequest) -> list[int]:
        """The prompt ids: the conversation so far extended (`ChatTokens`), or a new sequence when the agent
        rewrote it."""
        messages = request.messages
        try:
            if self._continues(request):
                action_ids, turn = self.last
                return self.tokens.add_turn(action_ids, messages[len(self.sent):], turn)
            if self.tokens is not None:  # the agent rewrote its conversation: a new sequence
                self.rewrites += 1
            parse = copy.copy(self.chat.parser)
            parse.schemas = request.tools or []  # calls' arguments typed by the request's tools
            tokens = ChatTokens(self.chat.tokenizer, request.tools, self.chat.max_result_tokens,
                                self.chat.template_kwargs, parse)
            ids = tokens.start(messages)
        except ApiError:
            raise
        except Exception as err:  # noqa: BLE001 - templates raise what they like on conversations they refuse
            raise ApiError(400, f"the chat template cannot render these messages: {err}") from None
        if self.tokens is not None:
            self.rewrite_tokens += len(ids) + self.tokens.reprefill_tokens
            self.rewrites += self.tokens.divergences
        self.tokens = tokens
        return ids

    def _continues(self, request: ChatRequest) -> bool:
        """Whether the request is the conversation so far (the last answer included) plus new messages."""
        return (self.tokens is not None and self.last is not None and request.tools == self.tokens.tools
                and len(request.messages) > len(self.sent)
                and all(same_message(a, b) for a, b in zip(self.sent, request.messages)))

    def _message(self, turn: ParsedTurn, finish_reason: str) -> tuple[dict, str]:
        """The OpenAI assistant message and finish reason; a call no parser could read is counted, not returned."""
        calls = [call for call in turn.tool_calls if call.problem is None]
        self.tool_calls += len(calls)
        self.unparsed += len(turn.tool_calls) - len(calls)
        message: dict = {"role": "assistant", "content": turn.content or (None if calls else "")}
        if calls:
            message["tool_calls"] = [{"id": call.id, "type": "function",
                                      "function": {"name": call.name, "arguments": json.dumps(call.arguments)}}
                                     for call in calls]
        if turn.reasoning is not None:
            message["reasoning_content"] = turn.reasoning
        reason = "length" if finish_reason == "length" else "tool_calls" if calls else "stop"
        return message, reason

    def _info(self) -> dict:
        tokens = self.tokens
        return {"agent_calls": len(self.calls), "tool_calls": self.tool_calls, "tool_errors": self.unparsed,
                "tool_errors/unparsed": self.unparsed, "tool_time_s": 0.0,
                "template_divergences": self.rewrites + (tokens.divergences if tokens else 0),
                "reprefill_tokens": self.rewrite_tokens + (tokens.reprefill_tokens if tokens else 0)}
