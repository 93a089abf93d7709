"""The embedded engine's HTTP side: exactly the subset of SGLang's native API the job uses.

Endpoints (SGLang's names, bodies and answers; reference: SGLang 0.5.23 native API):
`/generate`, `/health`, `/health_generate`, `/get_server_info` (`/server_info`),
`/get_model_info` (`/model_info`), `/flush_cache`, `/pause_generation`,
`/continue_generation`, `/release_memory_occupation`, `/resume_memory_occupation`,
`/begin_weight_update`, `/update_weights_from_tensor`, `/end_weight_update`. Nothing else:
anything that works against this engine must work against a real SGLang server.

Semantics kept strict, so CI exercises the GPU control flow:
- `release_memory_occupation` really drops the weights (their contents are lost, as with
  SGLang's memory saver) and refuses while requests are queued or running (SGLang asserts);
  `/generate` is refused until every released tag is resumed; resuming a tag that was not
  released is an error.
- `update_weights_from_tensor` needs a `begin/end_weight_update` session (SGLang >= 0.5.21)
  and takes flattened buckets of shared tensors; `weight_version` moves with the bucket that
  carries it. Shared CPU tensors are served from as they arrive, not copied (the pusher
  rewrites a staging buffer only two pushes later); `/end_weight_update` copies out any weight
  still held from an older session.
- `/health` stays 200 while paused or released, as SGLang does with
  `SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION=false` (how the job launches SGLang).
- `stop` strings, penalties, min_p and constrained decoding are refused with 400: tokens,
  never text, cross the engine boundary.
- Every /generate field is checked before it reaches the decode batch (validation.py), so a
  malformed request gets its own 400 and never fails the requests decoded with it.
- `image_data` (a vision-language model): SGLang's one pad per image, expanded here (images.py);
  an unreadable image or a pad count that is not the image count is a 400 before decoding.

Every control call and the first call of every path are logged, so the engine's log is a
record of what the job asked of it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import logging
import queue
import time
from typing import Any

import orjson
from aiohttp import web

from workers.engines.embedded.batch import GenRequest
from workers.engines.embedded.runner import ModelRunner
from workers.engines.embedded.validation import (MAX_BODY_BYTES, BadRequest, GenerateBody, fit_to_context,
                                                 longest_token_chars, parse_generate)
from workers.engines.weights import deserialize_for_engine, unflatten_bucket

LOG = logging.getLogger("embedded_engine")
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")


def json_response(data: Any, status: int = 200) -> web.Response:
    """A JSON answer written by orjson, as SGLang's server writes its own (NaN and infinities as null): a
    batch's tokens and logprobs in under a tenth of json's time, which the rollout otherwise waits for."""
    return web.Response(body=orjson.dumps(data), status=status, content_type="application/json")


def error_response(message: str, status: int = 400) -> web.Response:
    return json_response({"error": {"message": message}}, status=status)


class EmbeddedEngine:
    """HTTP front end, request queue and control state around one ModelRunner."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 64, collect_window_s: float = 0.0):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.collect_window_s = collect_window_s
        self.paused = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.released_tags: set[str] = set()
        self.in_weight_session = False
        # Weight-update sessions, and the buckets received in the last two: holding them keeps the
        # sender's shared-memory staging buffers (it alternates two sets) mapped here, so a push
        # that reuses a set skips re-mapping it (and the page faults of touching a fresh mapping).
        self.weight_session = 0
        self.received_buckets: dict[int, list] = {}
        self.incoming: queue.SimpleQueue[GenRequest] = queue.SimpleQueue()  # handed to the decode thread
        self.work_available = asyncio.Event()
        self.live: set[GenRequest] = set()  # submitted and not yet answered
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.scheduler_task: asyncio.Task | None = None
        self.paths_seen: set[str] = set()
        self.max_token_chars: int | None = None  # longest token in characters, computed on first text request

    # -- lifecycle

    async def on_startup(self, app: web.Application) -> None:
        self.loop = asyncio.get_running_loop()
        self.scheduler_task = asyncio.create_task(self.schedule_forever())

    async def on_shutdown(self, app: web.Application) -> None:
        self._abort(lambda r: True, "server shutting down")
        self.runner.step_gate.set()
        if self.scheduler_task:
            self.scheduler_task.cancel()
        self.executor.shutdown(wait=True, cancel_futures=True)

    @web.middleware
    async def record_paths(self, request: web.Request, handler):
        if request.path not in self.paths_seen:
            self.paths_seen.add(request.path)
            LOG.info("first call of %s %s", request.method, request.path)
        return await handler(request)

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=MAX_BODY_BYTES, middlewares=[self.record_paths])
        app.on_startup.append(self.on_startup)
        app.on_shutdown.append(self.on_shutdown)
        routes = [
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health),
            ("GET", "/get_model_info", self.model_info), ("GET", "/model_info", self.model_info),
            ("GET", "/get_server_info", self.server_info), ("GET", "/server_info", self.server_info),
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/release_memory_occupation", self.release_memory),
            ("POST", "/resume_memory_occupation", self.resume_memory),
            ("POST", "/begin_weight_update", self.begin_weight_update),
            ("POST", "/end_weight_update", self.end_weight_update),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
        ]
        for method, path, handler in routes:
            app.router.add_route(method, path, handler)
        return app

    # -- scheduling

    async def schedule_forever(self) -> None:
        """Run the decode loop in the worker thread whenever requests are waiting."""
        while True:
            await self.work_available.wait()
            self.work_available.clear()  # cleared before the loop drains `incoming`, so no wake-up is lost
            # No fixed wait (a lone request starts at once): one yield lets requests already read
            # from their sockets join the first prefill; later ones join between decode steps.
            await asyncio.sleep(self.collect_window_s)
            try:
                await self.loop.run_in_executor(self.executor, self.runner.run_until_idle, self.incoming,
                                                self.max_batch_size, self._finish_threadsafe)
            except Exception as err:  # a crash fails the requests in flight, not the server
                LOG.exception("decode loop failed")
                for request in list(self.live):
                    request.finished = True
                    if not request.future.done():
                        request.future.set_exception(err)
                self.live.clear()

    def _finish_threadsafe(self, request: GenRequest, reason: dict) -> None:
        self.loop.call_soon_threadsafe(self._finish, request, reason)

    def _finish(self, request: GenRequest, reason: dict) -> None:
        self.live.discard(request)
        if request.future.done():
            return
        request.future.set_result(self._result(request, reason))

    def _result(self, request: GenRequest, reason: dict) -> dict:
        meta: dict[str, Any] = {
            "id": request.rid, "finish_reason": reason, "prompt_tokens": len(request.prompt_ids),
            "completion_tokens": len(request.output_ids), "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - request.created, "weight_version": self.runner.weight_version,
        }
        if request.vision is not None:  # SGLang reports it only for a prompt with images
            meta["image_tokens"] = request.vision.image_tokens
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(request.logprobs, request.output_ids)]
            if request.input_logprobs is not None:
                start = max(request.logprob_start_len, 0)
                meta["input_token_logprobs"] = [[lp, tok, None] for lp, tok in
                                                zip(request.input_logprobs, request.prompt_ids[start:])]
        text = self.runner.tokenizer.decode(request.output_ids, skip_special_tokens=request.params.skip_special_tokens)
        return {"text": text, "output_ids": list(request.output_ids), "meta_info": meta}

    def _abort(self, matches, message: str) -> int:
        """Mark matching requests aborted; those not yet decoding answer right away."""
        count = 0
        for request in list(self.live):
            if not request.finished and matches(request):
                request.abort_message = message
                count += 1
                if not request.admitted:
                    self._finish(request, {"type": "abort", "message": message})
        return count

    # -- /generate

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = json.loads(await request.read())  # over MAX_BODY_BYTES: aiohttp answers 413 here
        except (ValueError, UnicodeDecodeError):
            return error_response("request body is not valid JSON")
        try:
            parsed = parse_generate(body, self.runner.vocab_size)
            prompts = parsed.input_ids if parsed.input_ids is not None else await self._tokenize(parsed.texts)
            visions = await self._vision_prompts(parsed, prompts)
            prompts = [prompt if vision is None else vision.ids for prompt, vision in zip(prompts, visions)]
        except BadRequest as err:
            return error_response(str(err))
        await self.unpaused.wait()  # SGLang: new requests block while paused
        if self.released_tags:
            return error_response(f"memory released ({sorted(self.released_tags)}); "
                                  "call /resume_memory_occupation before generating")
        try:
            requests = self._make_requests(parsed, prompts, visions)
        except BadRequest as err:
            return error_response(str(err))
        for gen_request in requests:
            self.live.add(gen_request)
            self.incoming.put(gen_request)
        self.work_available.set()
        results = await asyncio.gather(*(r.future for r in requests))
        return json_response(list(results) if parsed.is_batch or parsed.n > 1 else results[0])

    async def _tokenize(self, texts: list[str]) -> list[list[int]]:
        """Texts to ids off the event loop (a long text must not stall /health or other requests)."""
        if self.max_token_chars is None:
            self.max_token_chars = longest_token_chars(self.runner.tokenizer)
        # No token covers more than max_token_chars characters, so a longer text cannot fit the
        # context (4x slack for normalisers that shrink text); refused without tokenizing it.
        limit = 4 * self.runner.context_len * self.max_token_chars
        for index, text in enumerate(texts):
            if len(text) > limit:
                raise BadRequest(f"text{f'[{index}]' if len(texts) > 1 else ''} has {len(text)} characters, "
                                 f"more than the model's context of {self.runner.context_len} tokens can hold")
        ids = await asyncio.to_thread(lambda: self.runner.tokenizer(texts)["input_ids"])
        for index, row in enumerate(ids):
            if not row:
                raise BadRequest(f"text{f'[{index}]' if len(texts) > 1 else ''} tokenizes to no tokens")
        return ids

    async def _vision_prompts(self, parsed: GenerateBody, prompts: list[list[int]]) -> list:
        """Per prompt, its images expanded (images.VisionPrompt) or None; off the event loop (image decoding
        and the processor take milliseconds per image)."""
        images = parsed.images or [[]] * len(prompts)
        for prompt, entries in zip(prompts, images):
            if not entries:  # pads without images would fail the model's forward, and every row decoded with it
                self.runner.check_no_image_pads(prompt)
        if parsed.images is None:
            return [None] * len(prompts)
        return await asyncio.to_thread(lambda: [self.runner.vision_prompt(prompt, entries) if entries else None
                                                for prompt, entries in zip(prompts, images)])

    def _make_requests(self, parsed: GenerateBody, prompts: list[list[int]], visions: list) -> list[GenRequest]:
        requests = []
        for index in range(len(prompts) * parsed.n):  # rows grouped per prompt, as SGLang orders them
            which = index // parsed.n
            prompt = prompts[which]
            row = f"prompt {which}" if len(prompts) > 1 else "prompt"
            params = fit_to_context(parsed.sampling[which], len(prompt), self.runner.context_len, row)
            requests.append(GenRequest(rid=parsed.rids[index], prompt_ids=list(prompt), params=params,
                                       return_logprob=parsed.return_logprob, future=self.loop.create_future(),
                                       logprob_start_len=parsed.logprob_start_len if parsed.return_logprob else -1,
                                       vision=visions[which]))
        return requests

    # -- info

    async def health(self, request: web.Request) -> web.Response:
        if self.scheduler_task is None or self.scheduler_task.done():
            return web.Response(status=503, text="scheduler not running")
        return web.Response(text="ok")

    async def model_info(self, request: web.Request) -> web.Response:
        return json_response({"model_path": self.runner.model_path, "is_generation": True,
                              "weight_version": self.runner.weight_version, "tokenizer_path": self.runner.model_path})

    async def server_info(self, request: web.Request) -> web.Response:
        runner = self.runner
        return json_response({
            "version": "embedded", "model_path": runner.model_path, "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."), "context_length": runner.context_len,
            "max_running_requests": self.max_batch_size, "weight_version": runner.weight_version,
            "internal_states": [{"paused": self.paused, "released_tags": sorted(self.released_tags),
                                 "queued": sum(not r.admitted for r in self.live),
                                 "running": sum(r.admitted for r in self.live), **runner.stats}],
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.live:  # SGLang refuses while requests are queued or running
            return web.Response(status=400, text="Cache not flushed: requests are queued or running")
        return web.Response(text="Cache flushed.")

    # -- control

    async def pause_generation(self, request: web.Request) -> web.Response:
        mode = (await self._json(request)).get("mode", "abort")
        if mode not in ("abort", "retract", "in_place"):
            return error_response(f"mode must be abort, retract or in_place, got {mode!r}")
        self.paused = True
        self.unpaused.clear()
        if mode == "abort":
            count = self._abort(lambda r: True, "aborted by /pause_generation")
            self.runner.step_gate.set()  # let aborted rows leave even if an in_place pause held them
        else:  # retract and in_place both hold in-flight requests between steps here
            count = len(self.live)
            self.runner.step_gate.clear()
        LOG.info("call /pause_generation mode=%s affected=%d", mode, count)
        return json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self.runner.step_gate.set()
        self.unpaused.set()
        LOG.info("call /continue_generation")
        return json_response({"success": True, "message": "continued"})

    async def release_memory(self, request: web.Request) -> web.Response:
        try:
            tags = self._tags(await self._json(request))
        except BadRequest as err:
            return error_response(str(err))
        if bad := sorted(set(tags) - set(MEMORY_TAGS)):
            return error_response(f"unknown memory tags {bad}; use {list(MEMORY_TAGS)}")
        if self.live:
            return error_response("cannot release memory while requests are queued or running "
                                  "(SGLang asserts it is idle); pause or drain first")
        if "weights" in tags and "weights" not in self.released_tags:
            await asyncio.to_thread(self.runner.release_weights)
        self.released_tags.update(tags)
        LOG.info("call /release_memory_occupation tags=%s", ",".join(tags))
        return json_response(None)

    async def resume_memory(self, request: web.Request) -> web.Response:
        try:
            tags = self._tags(await self._json(request))
        except BadRequest as err:
            return error_response(str(err))
        if not_released := sorted(set(tags) - self.released_tags):
            return error_response(f"cannot resume {not_released}: not released (released: {sorted(self.released_tags)})")
        if "weights" in tags:
            await asyncio.to_thread(self.runner.resume_weights)
        self.released_tags.difference_update(tags)
        LOG.info("call /resume_memory_occupation tags=%s", ",".join(tags))
        return json_response(None)

    # -- weights

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self.in_weight_session = True
        self.weight_session += 1
        self.received_buckets[self.weight_session] = []
        LOG.info("call /begin_weight_update")
        return json_response({"success": True, "message": "weight update session started"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self.in_weight_session = False
        session = self.weight_session
        copied = await asyncio.to_thread(self.runner.settle_weights, session)
        self.received_buckets = {s: b for s, b in self.received_buckets.items() if s >= session - 1}
        LOG.info("call /end_weight_update copied_out=%d", copied)
        return json_response({"success": True, "message": "weight update session ended"})

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not self.in_weight_session:  # SGLang >= 0.5.21 requires a session
            return error_response("update_weights_from_tensor must run between /begin_weight_update "
                                  "and /end_weight_update")
        if "weights" in self.released_tags:
            return error_response("weights are released; /resume_memory_occupation {tags: [weights]} first")
        entries = body.get("serialized_named_tensors") or []
        if not isinstance(entries, list) or not all(isinstance(e, str) for e in entries):
            return error_response("serialized_named_tensors must be a list of strings (one per TP rank)")
        if len(entries) != 1:
            return error_response(f"serialized_named_tensors needs one entry per TP rank; this engine has 1, "
                                  f"got {len(entries)}")
        if body.get("load_format") not in (None, "flattened_bucket"):
            return error_response(f"load_format {body.get('load_format')!r} is not supported; "
                                  "use flattened_bucket or null")
        if body.get("abort_all_requests"):
            self._abort(lambda r: True, "aborted by update_weights_from_tensor")
        version = body.get("weight_version")
        started = time.perf_counter()

        def load() -> int:
            payload = deserialize_for_engine(entries[0])
            named = unflatten_bucket(payload) if isinstance(payload, dict) else list(payload)
            self.received_buckets.setdefault(self.weight_session, []).append(payload)
            return self.runner.load_tensors(named, version, self.weight_session)

        try:
            count = await asyncio.to_thread(load)
        except (ValueError, RuntimeError, OSError) as err:
            LOG.error("weight update failed: %s", err)
            return json_response({"success": False, "message": f"weight update failed: {err}"}, status=400)
        LOG.info("call /update_weights_from_tensor tensors=%d seconds=%.3f weight_version=%s",
                 count, time.perf_counter() - started, self.runner.weight_version)
        return json_response({"success": True, "message": f"loaded {count} tensors"})

    @staticmethod
    def _tags(body: dict) -> list[str]:
        tags = body.get("tags") or list(MEMORY_TAGS)
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise BadRequest(f"tags must be a list of strings from {list(MEMORY_TAGS)}")
        return tags

    @staticmethod
    async def _json(request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}
