"""Async HTTP client for an SGLang-compatible engine or the router in front of engines.

Every call has a deadline. Failures raise `EngineError` (URL, status, server message) and
deadlines raise `EngineTimeout` (URL, seconds), so a dead engine surfaces as a clear error
instead of a hung rollout.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
from typing import Any, Iterator, Sequence

import aiohttp
import orjson

from rl_core.errors import UserError
from workers.trace import span

# What SGLang 0.5.23 serves of a model's context (its scheduler: max_req_len = context - 1), and so the embedded
# engine too: an input of context - INPUT_RESERVE tokens or more is refused (HTTP 400), and a request generates
# at most context - OUTPUT_RESERVE - input tokens (a larger max_new_tokens is cut there and finishes "length").
INPUT_RESERVE = 6
OUTPUT_RESERVE = 2
KEEPALIVE_S = 2.0  # idle connections are dropped after this, before a server's own idle close (SGLang: 5 s)
# How a kept-alive connection that the server closed while idle shows up when a request is sent on it.
CLOSED_UNDER_US = (aiohttp.ServerDisconnectedError, aiohttp.ClientConnectionResetError)


def _json_text(payload: Any) -> str:
    """A request body by orjson, which SGLang's server also uses; by json what orjson refuses (an integer past
    64 bits, e.g. a user's sampling seed)."""
    try:
        return orjson.dumps(payload).decode()
    except TypeError:
        return json.dumps(payload)


def max_input_length(context_len: int) -> int:
    """The longest input an engine accepts for a model of `context_len` positions."""
    return context_len - INPUT_RESERVE - 1


def max_output_length(context_len: int, input_len: int) -> int:
    """The most tokens an engine generates after an input of `input_len` tokens."""
    return max(0, context_len - OUTPUT_RESERVE - input_len)


class EngineError(UserError, RuntimeError):
    """An engine or router answered with an error, or could not be reached."""

    def __init__(self, url: str, status: int | None, message: str):
        self.url, self.status, self.message = url, status, message
        where = f"HTTP {status}" if status is not None else "no HTTP answer"
        super().__init__(f"{url}: {where}: {message}")


class EngineTimeout(EngineError):
    """A call did not finish within its deadline."""

    def __init__(self, url: str, deadline_s: float):
        self.deadline_s = deadline_s
        super().__init__(url, None, f"no answer within the {deadline_s:g}s deadline")


def _json_or_text(body: str) -> Any:
    """An answer's JSON, read by orjson (4x json's speed on a batch's tokens and logprobs); by json what only it
    reads (NaN, as a server writing with json's defaults puts it); the text itself when it is no JSON."""
    try:
        return orjson.loads(body)
    except ValueError:
        pass
    try:
        return json.loads(body)
    except ValueError:
        return body


def _error_message(body: str) -> str:
    """SGLang errors look like {"error": {"message": ...}} or {"message": ...}; else raw text."""
    data = _json_or_text(body)
    if isinstance(data, dict):
        error = data.get("error")
        if isinstance(error, dict) and "message" in error:
            return str(error["message"])
        if "message" in data:
            return str(data["message"])
    return body.strip()[:2000]


@contextlib.contextmanager
def _as_engine_errors(url: str, deadline: float) -> Iterator[None]:
    """aiohttp's failures of one request as this module's errors, naming the URL."""
    try:
        yield
    except asyncio.TimeoutError:
        raise EngineTimeout(url, deadline) from None
    except aiohttp.ClientError as err:
        raise EngineError(url, None, f"{type(err).__name__}: {err}") from err


class EngineClient:
    """One pooled aiohttp session per client; create and use it inside a running event loop.

    `label` names what answers ("engine", "router") in a profiled step's trace: each call is a range
    such as `engine POST /update_weights_from_tensor` (workers.trace)."""

    def __init__(self, base_url: str, timeout_s: float = 600.0, control_timeout_s: float = 60.0,
                 max_connections: int = 1024, label: str = "engine"):
        self.base_url = base_url.rstrip("/")
        self.label = label
        self.timeout_s = timeout_s
        self.control_timeout_s = control_timeout_s
        self.max_connections = max_connections
        self._session: aiohttp.ClientSession | None = None

    def _get_session(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            # Connections are kept alive: a batch's requests go out at once instead of each waiting for a
            # connect. Servers close idle connections on their own clock (SGLang's uvicorn after 5 s), so
            # the pool drops its idle ones after KEEPALIVE_S, well before, and a call that still meets a
            # connection closed under it is sent once more on a new one (`request`).
            connector = aiohttp.TCPConnector(limit=self.max_connections, limit_per_host=self.max_connections,
                                             keepalive_timeout=KEEPALIVE_S)
            self._session = aiohttp.ClientSession(connector=connector, json_serialize=_json_text)
        return self._session

    async def request(self, method: str, path: str, payload: Any = None,
                      timeout_s: float | None = None) -> Any:
        """Send one request; return the JSON body (or text when it is not JSON). A POST without a payload sends
        `{}`."""
        url = f"{self.base_url}{path}"
        if method == "POST" and payload is None:
            payload = {}
        timeout = aiohttp.ClientTimeout(total=timeout_s if timeout_s is not None else self.control_timeout_s)
        # Ends when the answer is read: concurrent calls on one loop are overlapping ranges of one thread.
        with span(f"{self.label} {method} {path}"), _as_engine_errors(url, timeout.total):
            try:
                async with self._get_session().request(method, url, json=payload, timeout=timeout) as response:
                    status, body = response.status, await response.text()
            except CLOSED_UNDER_US:  # a kept-alive connection the server had closed: the request never ran,
                # so it is sent once more on a new connection (closed under us again: the server is going away)
                async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(force_close=True),
                                                 json_serialize=_json_text) as fresh:
                    async with fresh.request(method, url, json=payload, timeout=timeout) as response:
                        status, body = response.status, await response.text()
        if status >= 400:
            raise EngineError(url, status, _error_message(body))
        return _json_or_text(body) if body else None

    # Thin names for the two methods (partials: no frame of their own between a caller and its request).
    post = functools.partialmethod(request, "POST")
    get = functools.partialmethod(request, "GET")

    # ------------------------------------------------------------ generation

    async def generate(self, input_ids: Sequence[int] | Sequence[Sequence[int]], sampling_params: dict,
                       return_logprob: bool = True, rid: str | list[str] | None = None,
                       timeout_s: float | None = None, image_data: Any = None) -> dict | list[dict]:
        """POST /generate with token ids; a list of lists gives a list of results in order, and so does
        `n` > 1 in the sampling params (grouped per prompt). `image_data` (SGLang's field: for one prompt its
        images, for a batch one list per prompt; each a path, a data URL or base64) goes with ids holding one
        image pad per image, which the engine expands."""
        payload: dict[str, Any] = {"input_ids": list(input_ids), "sampling_params": dict(sampling_params),
                                   "return_logprob": return_logprob}
        if rid is not None:
            payload["rid"] = rid
        if image_data is not None:
            payload["image_data"] = image_data
        return await self.post("/generate", payload, timeout_s if timeout_s is not None else self.timeout_s)

    async def prompt_logprobs(self, input_ids: Sequence[int]) -> list[float] | None:
        """Prefill only (`max_new_tokens: 0`, `logprob_start_len: 0`): the engine's logprob of each token of
        `input_ids` after the first, from raw logits; None when the answer does not cover exactly those tokens.
        A distillation teacher's server answers this."""
        answer = await self.post("/generate", {
            "input_ids": list(input_ids), "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0}}, timeout_s=self.timeout_s)
        entries = (answer.get("meta_info") or {}).get("input_token_logprobs") or []
        if len(entries) != len(input_ids) or [int(e[1]) for e in entries] != list(input_ids):
            return None
        return [float(e[0]) for e in entries[1:]]  # the first token has no logprob (null)

    # ------------------------------------------------------------ info and control

    async def health(self, timeout_s: float = 5.0) -> bool:
        await self.get("/health", timeout_s)
        return True

    async def model_info(self) -> dict:
        """SGLang deprecates /get_model_info for /model_info; an older server may have only the former."""
        try:
            return await self.get("/model_info")
        except EngineError as err:
            if err.status != 404:
                raise
            return await self.get("/get_model_info")

    async def server_info(self) -> dict:
        return await self.get("/server_info")

    async def flush_cache(self) -> Any:
        return await self.post("/flush_cache")

    async def close(self) -> None:
        if self._session is not None:
            await self._session.close()
            self._session = None

    async def __aenter__(self) -> "EngineClient":
        return self

    async def __aexit__(self, *exc_info) -> None:
        await self.close()
