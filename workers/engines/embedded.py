"""Embedded inference engine: a small aiohttp server speaking a subset of SGLang's native API.

    python -m workers.engines.embedded --model-path DIR --port P [--device cpu] [--dtype float32]

It runs a Hugging Face causal LM on CPU (or one small GPU) so that the router, the rollout
client and the tests are the same as with a real SGLang server. Concurrent requests are
decoded together (continuous batching): between two decode steps, waiting requests are
left-padded and prefilled together, then merged into the running batch (its KV cache
left-padded to a common length); finished rows leave the batch and their cache is dropped.
The model runs in one worker thread so the event loop keeps accepting requests.

Differences from SGLang worth knowing:
- `/health` stays 200 while paused or released (SGLang answers 503); the framework also turns
  the router's health checks off, so nothing flaps either way.
- Weight updates take effect between two decode steps, even unpaused (SGLang waits for
  in-flight requests unless paused); the framework pauses first, as with SGLang.
- `stop` strings, penalties, min_p and constrained decoding are refused with 400; only token
  stops exist here, because tokens, never text, cross the engine boundary.
- `/weights_checksum` is our extension (see `weights.py`).
"""

from __future__ import annotations

import argparse
import asyncio
import concurrent.futures
import dataclasses
import logging
import os
import queue
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import torch
from aiohttp import web

from workers.engines import weights as weight_io
from workers.procs import ManagedProcesses, free_port, start_process, stop_process, wait_http_ok

LOG = logging.getLogger("embedded_engine")
GREEDY_TEMPERATURE = 1e-6
MEMORY_TAGS = ("weights", "kv_cache", "cuda_graph")

# Sampling keys SGLang 0.5.23 knows, with the value meaning "feature off" for those we do not implement.
IMPLEMENTED_SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "stop_token_ids",
                             "ignore_eos", "skip_special_tokens", "n", "sampling_seed"}
NEUTRAL_SAMPLING_VALUES = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "stop": None, "stop_regex": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None,
}
IGNORED_SAMPLING_KEYS = {"no_stop_trim", "spaces_between_special_tokens", "stream_interval"}


class BadRequest(ValueError):
    """The request is malformed; answered with 400 {"error": {"message"}}."""


# ---------------------------------------------------------------- request parsing

@dataclasses.dataclass
class SamplingParams:
    max_new_tokens: int | None = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None

    @classmethod
    def from_request(cls, raw: dict | None) -> "SamplingParams":
        raw = dict(raw or {})
        known = IMPLEMENTED_SAMPLING_KEYS | set(NEUTRAL_SAMPLING_VALUES) | IGNORED_SAMPLING_KEYS
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BadRequest(f"unknown sampling_params keys {unknown}; allowed keys: {sorted(known)}")
        for key, neutral in NEUTRAL_SAMPLING_VALUES.items():
            value = raw.get(key, neutral)
            if value not in (neutral, None) and value != [] and value != "":
                raise BadRequest(f"sampling_params.{key}={value!r} is not supported by the embedded engine; "
                                 f"leave it at {neutral!r}")
        params = cls(**{k: v for k, v in raw.items() if k in IMPLEMENTED_SAMPLING_KEYS and v is not None})
        params.stop_token_ids = tuple(int(t) for t in (raw.get("stop_token_ids") or ()))
        params.validate()
        return params

    def validate(self) -> None:
        if self.max_new_tokens is not None and (not isinstance(self.max_new_tokens, int) or self.max_new_tokens < 0):
            raise BadRequest(f"max_new_tokens must be a non-negative integer, got {self.max_new_tokens!r}")
        if self.temperature < 0:
            raise BadRequest(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise BadRequest(f"top_p must be in (0, 1], got {self.top_p}")
        if not isinstance(self.top_k, int) or self.top_k < -1:
            raise BadRequest(f"top_k must be -1 (off) or a positive integer, got {self.top_k!r}")
        if not isinstance(self.n, int) or self.n < 1:
            raise BadRequest(f"n must be a positive integer, got {self.n!r}")

    @property
    def greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE


@dataclasses.dataclass(eq=False)
class GenRequest:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    return_logprob: bool
    future: asyncio.Future
    created: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    abort_message: str | None = None
    admitted: bool = False  # set by the decode thread once the request is in the batch
    finished: bool = False
    generator: torch.Generator | None = None  # own RNG when sampling_seed is set
    versions: list[str] = dataclasses.field(default_factory=list)  # weight version that produced each token


# ---------------------------------------------------------------- model runner (worker thread)

class ModelRunner:
    """Owns the HF model; `run_until_idle` decodes queued requests in a worker thread."""

    def __init__(self, model_path: str, device: str, dtype: torch.dtype, seed: int):
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype).to(self.device)
        self.model.eval()  # OpenAI detail: no dropout while sampling
        config = self.model.config
        self.context_len = int(getattr(config, "max_position_embeddings", None) or getattr(config, "n_positions"))
        self.vocab_size = int(config.vocab_size)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self.rng = torch.Generator().manual_seed(seed)
        self.forward_lock = threading.Lock()  # weight updates never interleave with a forward
        self.weight_version = "default"  # changed under forward_lock, so every forward knows its weights
        self.forward_version = self.weight_version
        self.step_gate = threading.Event()  # cleared by pause in_place/retract: decoding waits
        self.step_gate.set()
        self.stats = {"batches_run": 0, "forward_steps": 0, "max_batch_seen": 0, "rows_run": 0,
                      "requests_finished": 0, "tokens_generated": 0}

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {int(i) for i in ids if i is not None}

    # -- sampling

    def sample(self, logits: torch.Tensor, requests: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; return (token ids, their logprobs under logits/T over the full vocab)."""
        logits = logits.float()
        temps = torch.tensor([r.params.temperature for r in requests])
        greedy = temps < GREEDY_TEMPERATURE
        # OpenAI detail: logprobs come from logits / temperature (greedy rows stay unscaled).
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        logprobs = torch.log_softmax(scaled, dim=-1)
        filtered = scaled.clone()
        for row, request in enumerate(requests):
            top_k, top_p = request.params.top_k, request.params.top_p
            if 0 < top_k < filtered.shape[-1]:
                kth = torch.topk(filtered[row], top_k).values[-1]
                filtered[row][filtered[row] < kth] = float("-inf")
            if top_p < 1.0:
                probs, order = torch.sort(torch.softmax(filtered[row], -1), descending=True)
                drop = (torch.cumsum(probs, -1) - probs) >= top_p  # keep the smallest prefix reaching top_p
                filtered[row][order[drop]] = float("-inf")
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=self.rng).squeeze(-1)
        for row, request in enumerate(requests):
            if request.params.sampling_seed is not None:
                tokens[row] = torch.multinomial(probs[row], 1, generator=request.generator).item()
        tokens = torch.where(greedy, logits.argmax(-1), tokens)
        return tokens, logprobs.gather(-1, tokens[:, None]).squeeze(-1)

    # -- finishing

    def finish_reason(self, request: GenRequest) -> dict | None:
        """SGLang order: the length limit first, then EOS / stop tokens unless ignore_eos."""
        if request.abort_message is not None:
            return {"type": "abort", "message": request.abort_message}
        params = request.params
        if len(request.output_ids) >= params.max_new_tokens:
            return {"type": "length", "length": params.max_new_tokens}
        last = request.output_ids[-1] if request.output_ids else None
        if last is not None and not params.ignore_eos and (last in params.stop_token_ids or last in self.eos_ids):
            return {"type": "stop", "matched": last}
        return None

    # -- continuous batching

    def run_until_idle(self, incoming: "queue.SimpleQueue[GenRequest]", max_batch_size: int, on_finish) -> None:
        """Decode until no row is active and nothing is waiting; new requests join between steps."""
        with torch.inference_mode():
            batch: DecodeBatch | None = None
            while True:
                self.step_gate.wait()  # a pause in place holds here, between two decode steps
                room = max_batch_size - (len(batch.requests) if batch else 0)
                joining = self._take(incoming, room, on_finish)
                if joining:
                    batch = self._prefill(joining) if batch is None else batch.merge(self._prefill(joining))
                if batch is None:
                    return
                batch = self._sample_and_finish(batch, on_finish)
                if batch is not None:
                    batch.logits, batch.cache = self._forward(batch.last_tokens[:, None], batch.mask,
                                                              batch.next_position[:, None], batch.cache)
                    batch.next_position = batch.next_position + 1

    def _take(self, incoming, room: int, on_finish) -> list[GenRequest]:
        taken = []
        while len(taken) < room:
            try:
                request = incoming.get_nowait()
            except queue.Empty:
                break
            if not self._finish_if_done(request, on_finish):
                request.admitted = True
                taken.append(request)
        return taken

    def _prefill(self, requests: list[GenRequest]) -> "DecodeBatch":
        self.stats["batches_run"] += 1
        self.stats["rows_run"] += len(requests)
        for request in requests:
            if request.params.sampling_seed is not None:
                request.generator = torch.Generator().manual_seed(int(request.params.sampling_seed))
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding, so every row's last token is at -1
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids):] = 1
        # OpenAI detail: position ids are the exclusive cumsum of the mask, so pads don't shift positions.
        positions = torch.cumsum(mask, -1) - mask
        logits, cache = self._forward(input_ids, mask, positions, None)
        return DecodeBatch(list(requests), cache, mask, mask.sum(-1), logits, None)

    def _sample_and_finish(self, batch: "DecodeBatch", on_finish) -> "DecodeBatch | None":
        tokens, logprobs = self.sample(batch.logits, batch.requests)
        keep = []
        for row, request in enumerate(batch.requests):
            request.output_ids.append(int(tokens[row]))
            request.logprobs.append(float(logprobs[row]))
            request.versions.append(self.forward_version)
            self.stats["tokens_generated"] += 1
            if not self._finish_if_done(request, on_finish):
                keep.append(row)
        if not keep:
            return None
        batch.last_tokens = tokens
        if len(keep) < len(batch.requests):  # finished rows leave the batch and the KV cache
            batch.select(keep, self.device)
        batch.mask = torch.cat([batch.mask, torch.ones((len(keep), 1), dtype=torch.long)], dim=-1)
        return batch

    def _finish_if_done(self, request: GenRequest, on_finish) -> bool:
        if request.future.cancelled() and request.abort_message is None:
            request.abort_message = "client disconnected"
        reason = self.finish_reason(request)
        if reason is None:
            return False
        request.finished = True
        self.stats["requests_finished"] += 1
        on_finish(request, reason)
        return True

    def _forward(self, input_ids, mask, positions, cache):
        with self.forward_lock:
            self.forward_version = self.weight_version
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=cache, use_cache=True)
        self.stats["forward_steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], input_ids.shape[0])
        return out.logits[:, -1, :].to("cpu"), out.past_key_values


@dataclasses.dataclass
class DecodeBatch:
    """Rows being decoded together: left-aligned KV cache, attention mask and per-row next position."""
    requests: list[GenRequest]
    cache: Any
    mask: torch.Tensor
    next_position: torch.Tensor
    logits: torch.Tensor
    last_tokens: torch.Tensor | None

    def select(self, rows: list[int], device) -> None:
        """Keep only `rows`, then drop leading columns that no remaining row attends to."""
        index = torch.tensor(rows)
        self.cache.batch_select_indices(index.to(device))
        self.requests = [self.requests[i] for i in rows]
        self.mask, self.next_position = self.mask[index], self.next_position[index]
        self.last_tokens = self.last_tokens[index]
        first_used = int(self.mask.any(0).nonzero()[0])
        if first_used > 0:
            self.mask = self.mask[:, first_used:]
            for layer in self.cache.layers:
                layer.keys, layer.values = layer.keys[..., first_used:, :], layer.values[..., first_used:, :]

    def merge(self, other: "DecodeBatch") -> "DecodeBatch":
        """Append freshly prefilled rows; the shorter side is left-padded with masked zeros."""
        width = max(self.mask.shape[1], other.mask.shape[1])

        def left_pad(t: torch.Tensor, dim_from_end: int) -> torch.Tensor:
            missing = width - t.shape[-dim_from_end]
            if missing == 0:
                return t
            pad = [0, 0] * (dim_from_end - 1) + [missing, 0]
            return torch.nn.functional.pad(t, pad)

        for mine, theirs in zip(self.cache.layers, other.cache.layers):
            mine.keys = torch.cat([left_pad(mine.keys, 2), left_pad(theirs.keys, 2)], dim=0)
            mine.values = torch.cat([left_pad(mine.values, 2), left_pad(theirs.values, 2)], dim=0)
        self.mask = torch.cat([left_pad(self.mask, 1), left_pad(other.mask, 1)], dim=0)
        self.requests += other.requests
        self.next_position = torch.cat([self.next_position, other.next_position])
        self.logits = torch.cat([self.logits, other.logits])
        return self


# ---------------------------------------------------------------- HTTP server

def error_response(message: str, status: int = 400) -> web.Response:
    return web.json_response({"error": {"message": message}}, status=status)


class EmbeddedEngine:
    """HTTP front end, request queue and control state around one ModelRunner."""

    def __init__(self, runner: ModelRunner, max_batch_size: int = 64, collect_window_s: float = 0.003):
        self.runner = runner
        self.max_batch_size = max_batch_size
        self.collect_window_s = collect_window_s
        self.paused = False
        self.unpaused = asyncio.Event()
        self.unpaused.set()
        self.released_tags: set[str] = set()
        self.in_weight_session = False
        self.incoming: queue.SimpleQueue[GenRequest] = queue.SimpleQueue()  # handed to the decode thread
        self.work_available = asyncio.Event()
        self.live: set[GenRequest] = set()  # submitted and not yet answered
        self.executor = concurrent.futures.ThreadPoolExecutor(max_workers=1, thread_name_prefix="decode")
        self.loop: asyncio.AbstractEventLoop | None = None
        self.scheduler_task: asyncio.Task | None = None

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

    def build_app(self) -> web.Application:
        app = web.Application(client_max_size=1 << 30)
        app.on_startup.append(self.on_startup)
        app.on_shutdown.append(self.on_shutdown)
        routes = [
            ("GET", "/health", self.health), ("GET", "/health_generate", self.health),
            ("GET", "/get_model_info", self.model_info), ("GET", "/model_info", self.model_info),
            ("GET", "/get_server_info", self.server_info), ("GET", "/server_info", self.server_info),
            ("POST", "/generate", self.generate), ("PUT", "/generate", self.generate),
            ("GET", "/flush_cache", self.flush_cache), ("POST", "/flush_cache", self.flush_cache),
            ("POST", "/abort_request", self.abort_request),
            ("POST", "/pause_generation", self.pause_generation),
            ("POST", "/continue_generation", self.continue_generation),
            ("POST", "/release_memory_occupation", self.release_memory),
            ("POST", "/resume_memory_occupation", self.resume_memory),
            ("POST", "/begin_weight_update", self.begin_weight_update),
            ("POST", "/end_weight_update", self.end_weight_update),
            ("POST", "/update_weights_from_disk", self.update_weights_from_disk),
            ("POST", "/update_weights_from_tensor", self.update_weights_from_tensor),
            ("POST", "/update_weight_version", self.update_weight_version),
            ("GET", "/weights_checksum", self.weights_checksum),
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
            await asyncio.sleep(self.collect_window_s)  # let requests sent together start in one prefill
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
        tokenizer = self.runner.tokenizer
        meta: dict[str, Any] = {
            "id": request.rid, "finish_reason": reason, "prompt_tokens": len(request.prompt_ids),
            "completion_tokens": len(request.output_ids), "cached_tokens": 0,
            "e2e_latency": time.perf_counter() - request.created, "weight_version": self.runner.weight_version,
        }
        if request.return_logprob:
            meta["output_token_logprobs"] = [[lp, tok, None] for lp, tok in zip(request.logprobs, request.output_ids)]
        # Our extension: a weight update can land mid-request (partial rollout), so each token
        # says which weights sampled it; async training bounds staleness from the oldest one.
        meta["output_token_versions"] = list(request.versions)
        text = tokenizer.decode(request.output_ids, skip_special_tokens=request.params.skip_special_tokens)
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

    def _parse_prompts(self, body: dict) -> tuple[list[list[int]], bool]:
        if body.get("text") is not None:
            texts = body["text"]
            is_batch = isinstance(texts, list)
            texts = texts if is_batch else [texts]
            if not all(isinstance(t, str) for t in texts):
                raise BadRequest("text must be a string or a list of strings")
            return [self.runner.tokenizer(t)["input_ids"] for t in texts], is_batch
        ids = body.get("input_ids")
        if ids is None:
            raise BadRequest("send either input_ids (list[int] or list[list[int]]) or text")
        is_batch = bool(ids) and isinstance(ids[0], list)
        prompts = ids if is_batch else [ids]
        for prompt in prompts:
            if not prompt or not all(isinstance(t, int) and 0 <= t < self.runner.vocab_size for t in prompt):
                raise BadRequest(f"each prompt must be a non-empty list of token ids in [0, {self.runner.vocab_size})")
        return prompts, is_batch

    def _make_requests(self, body: dict) -> tuple[list[GenRequest], bool]:
        prompts, is_batch = self._parse_prompts(body)
        params = SamplingParams.from_request(body.get("sampling_params"))
        rids = self._rids(body.get("rid"), len(prompts), is_batch, params.n)
        requests = []
        for index, prompt in enumerate(p for p in prompts for _ in range(params.n)):  # grouped per prompt
            row_params = dataclasses.replace(params)
            room = self.runner.context_len - len(prompt)
            if row_params.max_new_tokens is None:
                row_params.max_new_tokens = max(room, 0)
            if len(prompt) + row_params.max_new_tokens > self.runner.context_len:
                raise BadRequest(f"prompt of {len(prompt)} tokens + max_new_tokens {row_params.max_new_tokens} "
                                 f"exceeds the model's context length {self.runner.context_len}")
            requests.append(GenRequest(rid=rids[index], prompt_ids=list(prompt), params=row_params,
                                       return_logprob=bool(body.get("return_logprob", False)),
                                       future=self.loop.create_future()))
        return requests, is_batch or params.n > 1

    @staticmethod
    def _rids(rid, num_prompts: int, is_batch: bool, n: int) -> list[str]:
        total = num_prompts * n
        if n > 1 or rid is None:  # SGLang replaces caller rids when n > 1
            return [uuid.uuid4().hex for _ in range(total)]
        if isinstance(rid, list):
            if len(rid) != num_prompts:
                raise BadRequest(f"rid list has {len(rid)} entries for {num_prompts} prompts")
            return [str(r) for r in rid]
        return [f"{rid}_{i}" for i in range(total)] if is_batch else [str(rid)]

    async def generate(self, request: web.Request) -> web.Response:
        try:
            body = await request.json()
        except ValueError:
            return error_response("request body is not valid JSON")
        if body.get("stream"):
            return error_response("stream=true is not supported by the embedded engine")
        await self.unpaused.wait()  # SGLang: new requests block while paused
        if self.released_tags & {"weights", "kv_cache"}:
            return error_response(f"memory released ({sorted(self.released_tags)}); "
                                  "call /resume_memory_occupation before generating")
        try:
            requests, return_list = self._make_requests(body)
        except BadRequest as err:
            return error_response(str(err))
        for gen_request in requests:
            self.live.add(gen_request)
            self.incoming.put(gen_request)
        self.work_available.set()
        results = await asyncio.gather(*(r.future for r in requests))
        return web.json_response(list(results) if return_list else results[0])

    # -- info

    async def health(self, request: web.Request) -> web.Response:
        if self.scheduler_task is None or self.scheduler_task.done():
            return web.Response(status=503, text="scheduler not running")
        return web.Response(text="ok")

    async def model_info(self, request: web.Request) -> web.Response:
        return web.json_response({"model_path": self.runner.model_path, "is_generation": True,
                                  "weight_version": self.runner.weight_version, "tokenizer_path": self.runner.model_path})

    async def server_info(self, request: web.Request) -> web.Response:
        runner = self.runner
        return web.json_response({
            "version": "embedded", "model_path": runner.model_path, "device": str(runner.device),
            "dtype": str(runner.dtype).removeprefix("torch."), "context_length": runner.context_len,
            "max_batch_size": self.max_batch_size, "weight_version": self.runner.weight_version, "paused": self.paused,
            "released_tags": sorted(self.released_tags), "queued": sum(not r.admitted for r in self.live),
            "running": sum(r.admitted for r in self.live), **runner.stats,
        })

    async def flush_cache(self, request: web.Request) -> web.Response:
        if self.live:  # SGLang refuses while requests are queued or running
            return web.Response(status=400, text="Cache not flushed: requests are queued or running")
        return web.Response(text="Cache flushed.")

    # -- control

    async def abort_request(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        rid, abort_all = str(body.get("rid") or ""), bool(body.get("abort_all", False))
        if not rid and not abort_all:
            return error_response("give rid (prefix match) or abort_all=true")
        count = self._abort(lambda r: abort_all or r.rid.startswith(rid), "aborted by /abort_request")
        LOG.info("abort_request rid=%r abort_all=%s matched=%d", rid, abort_all, count)
        return web.json_response({"success": True, "aborted": count})

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
        LOG.info("pause_generation mode=%s affected=%d", mode, count)
        return web.json_response({"success": True, "message": f"paused ({mode})"})

    async def continue_generation(self, request: web.Request) -> web.Response:
        self.paused = False
        self.runner.step_gate.set()
        self.unpaused.set()
        LOG.info("continue_generation")
        return web.json_response({"success": True, "message": "continued"})

    async def release_memory(self, request: web.Request) -> web.Response:
        tags = (await self._json(request)).get("tags") or list(MEMORY_TAGS)
        if bad := sorted(set(tags) - set(MEMORY_TAGS)):
            return error_response(f"unknown memory tags {bad}; use {list(MEMORY_TAGS)}")
        if self.live:
            return error_response("cannot release memory while requests are queued or running; pause first")
        if "weights" in tags and self.runner.device.type == "cuda":
            with self.runner.forward_lock:
                self.runner.model.to("cpu")  # keeps the contents, unlike SGLang without a CPU backup
            torch.cuda.empty_cache()
        self.released_tags.update(tags)
        LOG.info("release_memory_occupation tags=%s", ",".join(tags))
        return web.json_response({"success": True, "message": f"released {sorted(tags)}"})

    async def resume_memory(self, request: web.Request) -> web.Response:
        tags = (await self._json(request)).get("tags") or sorted(self.released_tags)
        if not_released := sorted(set(tags) - self.released_tags):
            return error_response(f"cannot resume {not_released}: not released (released: {sorted(self.released_tags)})")
        if "weights" in tags and self.runner.device.type == "cuda":
            with self.runner.forward_lock:
                self.runner.model.to(self.runner.device)
        self.released_tags.difference_update(tags)
        LOG.info("resume_memory_occupation tags=%s", ",".join(tags))
        return web.json_response({"success": True, "message": f"resumed {sorted(tags)}"})

    # -- weights

    async def begin_weight_update(self, request: web.Request) -> web.Response:
        self.in_weight_session = True
        LOG.info("begin_weight_update")
        return web.json_response({"success": True, "message": "weight update session started"})

    async def end_weight_update(self, request: web.Request) -> web.Response:
        self.in_weight_session = False
        LOG.info("end_weight_update")
        return web.json_response({"success": True, "message": "weight update session ended"})

    async def update_weights_from_disk(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        path = body.get("model_path")
        if not path:
            return error_response("model_path is required (a .safetensors file or a HF model directory)")
        return await self._load_weights(lambda: weight_io.read_weight_files(path), body, f"disk {path}")

    async def update_weights_from_tensor(self, request: web.Request) -> web.Response:
        body = await self._json(request)
        if not self.in_weight_session:  # SGLang >= 0.5.21 requires a session
            return error_response("update_weights_from_tensor must run between /begin_weight_update "
                                  "and /end_weight_update")
        entries = body.get("serialized_named_tensors") or []
        if len(entries) != 1:
            return error_response(f"serialized_named_tensors needs one entry per TP rank; this engine has 1, "
                                  f"got {len(entries)}")
        return await self._load_weights(lambda: dict(weight_io.deserialize_named_tensors(entries[0])),
                                        body, "tensor payload", partial=True)

    async def _load_weights(self, read, body: dict, source: str, partial: bool = False) -> web.Response:
        started = time.perf_counter()

        def load() -> int:
            state_dict = read()
            with self.runner.forward_lock:
                if partial:  # tensor buckets carry part of the model each
                    own = self.runner.model.state_dict()
                    unknown = sorted(set(state_dict) - set(own))
                    if unknown:
                        raise ValueError(f"unknown weight names {unknown[:5]}")
                    with torch.no_grad():
                        for name, tensor in state_dict.items():
                            own[name].copy_(tensor.to(own[name].device, own[name].dtype))
                    return len(state_dict)
                count = weight_io.load_into_model(self.runner.model, state_dict)
                if body.get("weight_version") is not None:  # under the lock: no forward sees new weights with the old label
                    self.runner.weight_version = str(body["weight_version"])
                return count

        try:
            count = await asyncio.to_thread(load)
        except (ValueError, FileNotFoundError, OSError, RuntimeError) as err:
            LOG.error("weight update from %s failed: %s", source, err)
            return web.json_response({"success": False, "message": f"weight update failed: {err}"}, status=400)
        if body.get("weight_version") is not None:
            self.runner.weight_version = str(body["weight_version"])
        LOG.info("loaded %d tensors from %s in %.3fs, weight_version=%s",
                 count, source, time.perf_counter() - started, self.runner.weight_version)
        return web.json_response({"success": True, "message": f"loaded {count} tensors",
                                  "num_tensors": count, "weight_version": self.runner.weight_version})

    async def update_weight_version(self, request: web.Request) -> web.Response:
        version = (await self._json(request)).get("new_version")
        if version is None:
            return error_response("new_version is required")
        self.runner.weight_version = str(version)
        LOG.info("update_weight_version %s", version)
        return web.json_response({"success": True, "message": f"weight_version={version}"})

    async def weights_checksum(self, request: web.Request) -> web.Response:
        def compute() -> str:
            with self.runner.forward_lock:
                return weight_io.weights_checksum(self.runner.model)

        return web.json_response({"weight_version": self.runner.weight_version, "checksum": await asyncio.to_thread(compute)})

    @staticmethod
    async def _json(request: web.Request) -> dict:
        if not request.can_read_body:
            return {}
        try:
            body = await request.json()
        except ValueError:
            return {}
        return body if isinstance(body, dict) else {}


# ---------------------------------------------------------------- launching

def build_engine_argv(model_path: str, port: int, host: str = "127.0.0.1", device: str = "cpu",
                      dtype: str = "float32", max_batch_size: int = 64, num_threads: int = 0,
                      seed: int = 0, python: str = sys.executable) -> list[str]:
    """Command line for `python -m workers.engines.embedded`."""
    return [python, "-m", "workers.engines.embedded", "--model-path", str(model_path), "--host", host,
            "--port", str(port), "--device", device, "--dtype", dtype, "--max-batch-size", str(max_batch_size),
            "--num-threads", str(num_threads), "--seed", str(seed)]


@dataclasses.dataclass
class EngineProcess:
    """A running embedded engine subprocess."""
    url: str
    proc: subprocess.Popen
    log_path: Path

    def wait_ready(self, deadline_s: float = 120.0) -> "EngineProcess":
        try:
            wait_http_ok(f"{self.url}/health", deadline_s, self.proc, self.log_path, name=f"embedded engine {self.url}")
        except BaseException:
            self.stop()
            raise
        return self

    def stop(self, timeout: float = 10.0) -> None:
        stop_process(self.proc, timeout)


def launch_embedded_engine(model_path: str, log_path: str | Path, host: str = "127.0.0.1",
                           port: int | None = None, processes: ManagedProcesses | None = None,
                           deadline_s: float = 120.0, wait: bool = True, env: dict | None = None,
                           **engine_args) -> EngineProcess:
    """Start an embedded engine; with `wait`, block until /health answers. `processes` (if given) owns it."""
    port = port or free_port(host)
    argv = build_engine_argv(model_path, port, host, **engine_args)
    url = f"http://{host}:{port}"
    proc = processes.start(f"embedded engine {url}", argv, log_path, env) if processes \
        else start_process(argv, log_path, env)
    engine = EngineProcess(url, proc, Path(log_path))
    return engine.wait_ready(deadline_s) if wait else engine


# ---------------------------------------------------------------- entry point

def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--max-batch-size", type=int, default=64)
    parser.add_argument("--num-threads", type=int, default=0, help="torch CPU threads (0: all cores)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--log-level", default="info")
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    torch.set_num_threads(args.num_threads or os.cpu_count() or 1)
    runner = ModelRunner(args.model_path, args.device, getattr(torch, args.dtype), args.seed)
    engine = EmbeddedEngine(runner, max_batch_size=args.max_batch_size)
    LOG.info("serving %s on http://%s:%d (%s, %s)", args.model_path, args.host, args.port, args.device, args.dtype)
    web.run_app(engine.build_app(), host=args.host, port=args.port, access_log=None, print=None,
                shutdown_timeout=1.0)


if __name__ == "__main__":
    main()
