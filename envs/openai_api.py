"""The OpenAI chat-completions surface of `AgentEnv` (envs/agent.py): requests read and checked, messages put in
the shape chat templates take, responses and errors in OpenAI's shape, and the aiohttp server on loopback.

Only what a policy under training can honour is accepted: one choice (`n` 1), no streaming, stop strings that
are single tokens (the engine's `output_ids` are trained as sampled, so a stop is a token id, never a cut in
text). `temperature` and `top_p` are read and not used: the tokens are sampled, and their logprobs trained, at
the job's `rollout.temperature`.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

from aiohttp import web


class ApiError(Exception):
    """A request refused with `status` and one line (OpenAI's error body)."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.kind = status, message, kind


def error_response(err: ApiError) -> web.Response:
    return web.json_response({"error": {"message": err.message, "type": err.kind, "param": None, "code": None}},
                             status=err.status)


@dataclass
class ChatRequest:
    messages: list[dict]  # as the chat template takes them (`template_messages`)
    tools: list[dict] | None
    max_tokens: int | None
    stop: list[str]
    model: str


def parse_request(body: Any) -> ChatRequest:
    """A /v1/chat/completions body, or ApiError(400) naming the field."""
    if not isinstance(body, dict):
        raise ApiError(400, "the body must be a JSON object")
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages or not all(isinstance(m, dict) and "role" in m for m in messages):
        raise ApiError(400, "'messages' must be a non-empty list of {role, content} objects")
    if body.get("stream"):
        raise ApiError(400, "streaming is not supported by this endpoint: send stream=false")
    if body.get("n") not in (None, 1):
        raise ApiError(400, f"'n' must be 1 (one trajectory per session), got {body['n']!r}")
    tools = body.get("tools") or None
    if tools is not None and not (isinstance(tools, list) and all(isinstance(t, dict) and "function" in t
                                                                  for t in tools)):
        raise ApiError(400, "'tools' must be a list of {type: function, function: {name, parameters}} objects")
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None and (isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1):
        raise ApiError(400, f"'max_tokens' must be a positive integer, got {max_tokens!r}")
    stop = body.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop):
        raise ApiError(400, "'stop' must be a string or a list of strings")
    return ChatRequest(template_messages(messages), tools, max_tokens, stop, str(body.get("model") or "policy"))


def _text(content: Any) -> str:
    """OpenAI content (a string, null, or a list of parts) as text."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    raise ApiError(400, f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _arguments(call: dict) -> dict:
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise ApiError(400, "each tool_calls entry must be {id, type: function, function: {name, arguments}}")
    arguments = function.get("arguments") or "{}"
    try:
        return json.loads(arguments) if isinstance(arguments, str) else dict(arguments)
    except (json.JSONDecodeError, TypeError, ValueError):
        raise ApiError(400, f"tool call {function['name']!r} has arguments that are not a JSON object") from None


def template_messages(messages: list[dict]) -> list[dict]:
    """Messages as chat templates take them: text content, tool-call arguments as dicts, and a tool result's
    `name` filled from the call it answers (OpenAI clients send only `tool_call_id`)."""
    names: dict[str, str] = {}
    out = []
    for message in messages:
        m = {"role": message["role"], "content": _text(message.get("content"))}
        if message.get("tool_calls"):
            m["tool_calls"] = [{"id": c.get("id"), "type": "function",
                                "function": {"name": c["function"]["name"], "arguments": _arguments(c)}}
                               for c in message["tool_calls"]]
            names.update({c["id"]: c["function"]["name"] for c in m["tool_calls"] if c["id"]})
        if message["role"] == "tool":
            m["tool_call_id"] = message.get("tool_call_id")
            m["name"] = message.get("name") or names.get(message.get("tool_call_id"), "")
        elif message.get("name"):
            m["name"] = message["name"]
        out.append(m)
    return out


def same_message(sent: dict, got: dict) -> bool:
    """Whether the agent sent back a message as it was: role, text and calls (by name and arguments)."""
    def key(m: dict) -> tuple:
        calls = [(c["function"]["name"], json.dumps(c["function"]["arguments"], sort_keys=True))
                 for c in m.get("tool_calls") or []]
        return m["role"], m["content"].strip(), calls
    return key(sent) == key(got)


def completion(message: dict, finish_reason: str, model: str, usage: tuple[int, int]) -> dict:
    """An OpenAI chat.completion object with one choice."""
    return {"id": f"chatcmpl-{uuid.uuid4().hex}", "object": "chat.completion", "created": int(time.time()),
            "model": model, "choices": [{"index": 0, "message": message, "finish_reason": finish_reason,
                                         "logprobs": None}],
            "usage": {"prompt_tokens": usage[0], "completion_tokens": usage[1], "total_tokens": sum(usage)}}


Handler = Callable[[str, ChatRequest], Awaitable[dict]]


class AgentServer:
    """`POST /sessions/<id>/v1/chat/completions` (and `GET .../v1/models`) on 127.0.0.1, on the running loop.
    `handle(session, request)` answers a completion or raises ApiError."""

    def __init__(self, handle: Handler):
        self.handle = handle
        self.runner: web.AppRunner | None = None
        self.port: int | None = None

    def base_url(self, session: str) -> str:
        return f"http://127.0.0.1:{self.port}/sessions/{session}/v1"

    async def start(self) -> None:
        if self.runner is not None:
            return
        app = web.Application()
        app.router.add_post("/sessions/{session}/v1/chat/completions", self._completions)
        app.router.add_get("/sessions/{session}/v1/models", self._models)
        runner = web.AppRunner(app, access_log=None)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)  # loopback only: the agent runs in this process
        await site.start()
        self.runner, self.port = runner, site._server.sockets[0].getsockname()[1]

    async def stop(self) -> None:
        if self.runner is not None:
            runner, self.runner = self.runner, None
            await runner.cleanup()

    async def _completions(self, request: web.Request) -> web.Response:
        try:
            try:
                body = await request.json()
            except (json.JSONDecodeError, UnicodeDecodeError):
                raise ApiError(400, "the body is not JSON") from None
            return web.json_response(await self.handle(request.match_info["session"], parse_request(body)))
        except ApiError as err:
            return error_response(err)

    async def _models(self, request: web.Request) -> web.Response:
        return web.json_response({"object": "list", "data": [{"id": "policy", "object": "model", "owned_by": "rl_core"}]})
