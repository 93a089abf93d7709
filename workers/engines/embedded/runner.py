"""The embedded engine's model side: one Hugging Face causal LM, decoded with continuous batching.

Concurrent requests are decoded together. Between two decode steps, waiting requests are
left-padded and prefilled together straight into the shared KV cache (`kv_cache.SlotCache`);
finished rows leave the batch. A decode step costs a fixed number of tensor operations
whatever the batch size: sampling is vectorised (`sampling.py`), sampled tokens and logprobs
stay in per-row tensors until their request finishes, and a request finishing by length is
known on the host without reading the device. Only stop tokens (EOS, `stop_token_ids`) need
the sampled ids on the host, and only when some running row can stop on them.
Everything here runs in one worker thread, so the server's event loop keeps accepting requests.
"""

from __future__ import annotations

import inspect
import logging
import queue
import threading
import time
from typing import Callable

import torch

from workers.engines.embedded.batch import DecodeBatch, GenRequest, SamplingParams
from workers.engines.embedded.images import (VisionPrompt, checkpoint_aliases, load_model, prefill_inputs,
                                             vision_prompt)
from workers.engines.embedded.kv_cache import SlotCache
from workers.engines.embedded.sampling import RowSampling, draw_uniforms, sample
from workers.engines.embedded.validation import BadRequest
from workers.loading import cache_keyword, context_length

LOG = logging.getLogger("embedded_engine")
# An idle engine's first prefill waits for the rest of a burst (_rest_of_burst). 5 ms between arrivals, not 2:
# an async rollout client sends its batch beside a computing trainer, and on 2 cores 2 ms gaps split the
# gpu86m batch's first prefill 5 times in 8 (8 + 248 rows: up to 9 decode steps more).
BURST_GAP_S, BURST_MAX_S = 0.005, 0.05


class ModelRunner:
    """Owns the HF model; `run_until_idle` decodes queued requests in a worker thread."""

    def __init__(self, model_path: str, device: str, dtype: torch.dtype, seed: int):
        from transformers import AutoTokenizer

        self.model_path = model_path
        self.device = torch.device(device)
        self.dtype = dtype
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        model, self.processor = load_model(model_path, dtype)  # a processor for a vision-language model
        self.model = model.to(self.device)
        self.model.eval()  # OpenAI detail: no dropout while sampling
        # A vision-language model's checkpoint names (SGLang's) differ from its parameters': pushes take both.
        self.aliases = checkpoint_aliases(self.model) if self.processor is not None else {}
        config = self.model.config
        self.context_len = context_length(config)  # the trainer checks its lengths against the same number
        if self.context_len is None:
            raise ValueError(f"the model at {model_path} gives no context length (max_position_embeddings or "
                             "n_positions in its config.json); add it there")
        self.vocab_size = int(config.get_text_config().vocab_size)  # a multimodal config: its language model's
        self.num_layers = int(config.get_text_config().num_hidden_layers)
        # Prefill computes the vocabulary projection for the last position only, when the model can.
        self.keeps_last_logits = "logits_to_keep" in inspect.signature(self.model.forward).parameters
        self.cache_keyword = cache_keyword(self.model)
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else 0
        self.eos_ids = self._eos_ids()
        self.rng = torch.Generator().manual_seed(seed)
        self.forward_lock = threading.Lock()  # weight changes never interleave with a forward
        self.weight_version = "default"  # SGLang's initial version; changed under forward_lock
        self.step_gate = threading.Event()  # cleared by pause in_place/retract: decoding waits
        self.step_gate.set()
        self.released_shapes: dict[str, torch.Size] | None = None
        self.adopted: dict[str, int] = {}  # parameter -> weight-update session whose buffer holds it
        self.stats = {"batches_run": 0, "forward_steps": 0, "max_batch_seen": 0, "rows_run": 0,
                      "requests_finished": 0, "tokens_generated": 0, "kv_relayouts": 0,
                      "prompts_prefilled": 0}

    def vision_prompt(self, ids: list[int], images: list[str]) -> VisionPrompt:
        """`ids` with one pad per image, expanded for `images` (images.vision_prompt); not under the forward
        lock: the processor and the 3-D positions read no weights."""
        if self.processor is None:
            raise BadRequest(f"image_data was sent but the model at {self.model_path} is not a vision-language model")
        return vision_prompt(self.model, self.processor, ids, images)

    def check_no_image_pads(self, ids: list[int]) -> None:
        """A prompt sent without images holds no image pad (the model would find no features for it)."""
        if self.processor is not None:
            pads = sum(1 for token in ids if token == self.model.config.image_token_id)
            if pads:
                raise BadRequest(f"prompt has {pads} image placeholder token(s) but 0 image(s) were provided")

    def _eos_ids(self) -> set[int]:
        ids = {self.tokenizer.eos_token_id}
        gen_eos = getattr(self.model.generation_config, "eos_token_id", None)
        ids.update(gen_eos if isinstance(gen_eos, list) else [gen_eos])
        return {int(i) for i in ids if i is not None}

    # -- weights

    def unique_parameters(self) -> dict[str, torch.nn.Parameter]:
        """Parameters by first name; tied ones (GPT-2 lm_head = wte) once."""
        return dict(self.model.named_parameters())

    def release_weights(self) -> None:
        """Drop the weights' memory, as SGLang's memory saver does: the contents are lost."""
        with self.forward_lock:
            params = self.unique_parameters()
            self.released_shapes = {name: p.shape for name, p in params.items()}
            for param in params.values():
                param.data = torch.empty(0, dtype=param.dtype, device=param.device)
            self.adopted.clear()

    def resume_weights(self) -> None:
        """Allocate the weights again (zeros): they must be pushed before the next generation."""
        with self.forward_lock:
            for name, param in self.unique_parameters().items():
                param.data = torch.zeros(self.released_shapes[name], dtype=param.dtype, device=param.device)
            self.released_shapes = None

    def load_tensors(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | None,
                     session: int = 0) -> int:
        """Take tensors as the live weights by HF name (any subset), under the forward lock.

        A shared-memory CPU tensor of the parameter's dtype and shape is adopted as it is (the
        parameter now lives in the sender's staging buffer: no copy); anything else is copied in.
        `session` tags adopted parameters for `settle_weights`.
        """
        named_tensors = [(self.aliases.get(name, name), tensor) for name, tensor in named_tensors]
        with self.forward_lock:
            own = self.model.state_dict()
            params = self.unique_parameters()
            unknown = sorted(name for name, _ in named_tensors if name not in own)
            if unknown:
                raise ValueError(f"unknown weight names {unknown[:5]} (the model's look like {sorted(own)[:3]})")
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if tuple(own[name].shape) != tuple(tensor.shape):
                        raise ValueError(f"shape mismatch for {name}: engine {tuple(own[name].shape)}, "
                                         f"sent {tuple(tensor.shape)}")
                    param = params.get(name)
                    if param is not None and _adoptable(tensor, param):
                        param.data = tensor
                        self.adopted[name] = session
                    else:
                        own[name].copy_(tensor)
                        self.adopted.pop(name, None)
            if version is not None:  # under the lock: no forward sees new weights with the old label
                self.weight_version = str(version)
        return len(named_tensors)

    def settle_weights(self, session: int) -> int:
        """After a weight-update session: copy out every parameter still living in the buffers of an
        older session, so the engine holds no sender buffer but the latest session's (which the
        sender rewrites only after the next push). Returns how many were copied."""
        with self.forward_lock, torch.no_grad():
            params = self.unique_parameters()
            stale = [name for name, tagged in self.adopted.items() if tagged != session]
            for name in stale:
                params[name].data = params[name].data.clone()
                del self.adopted[name]
        return len(stale)

    # -- finishing

    def stop_ids(self, params: SamplingParams) -> set[int]:
        """Tokens that end this request: none with ignore_eos (SGLang), else EOS and stop_token_ids."""
        return set() if params.ignore_eos else set(params.stop_token_ids) | self.eos_ids

    # -- continuous batching

    def run_until_idle(self, incoming: "queue.SimpleQueue[GenRequest]", max_batch_size: int,
                       on_finish: Callable[[GenRequest, dict], None]) -> None:
        """Decode until no row is active and nothing is waiting; new requests join between steps."""
        prefills, decode_steps = [], 0  # this busy period's shape, logged: how batch-shaped the arrivals were
        started = time.perf_counter()
        with torch.inference_mode():
            batch = DecodeBatch(SlotCache(self.num_layers, self.device, max_batch_size))
            while True:
                self.step_gate.wait()  # a pause in place holds here, between two decode steps
                joining = self._take(incoming, max_batch_size - batch.size, on_finish)
                if joining and not prefills:
                    joining += self._rest_of_burst(incoming, max_batch_size - len(joining), on_finish)
                if joining:
                    self._prefill(batch, joining)
                    prefills.append(len(joining))
                if batch.size == 0:
                    self.stats["kv_relayouts"] += batch.cache.relayouts
                    if prefills:
                        LOG.info("busy period: %d sequences, prefills %s, %d decode steps, %.3f s", sum(prefills),
                                 prefills[:16], decode_steps, time.perf_counter() - started)
                    return
                self._sample_and_finish(batch, on_finish)
                if batch.size:
                    self._decode(batch)
                    decode_steps += 1

    def _rest_of_burst(self, incoming, room: int, on_finish) -> list[GenRequest]:
        """The requests still arriving with the first of an idle engine's work: a rollout sends its batch at
        once, but the HTTP front end queues it one request at a time, and a first prefill of the first few
        would have the rest join a step later. Waits while requests keep coming (BURST_GAP_S apart), at most
        BURST_MAX_S; a lone request waits one gap."""
        taken: list[GenRequest] = []
        deadline = time.perf_counter() + BURST_MAX_S
        while len(taken) < room and time.perf_counter() < deadline:
            time.sleep(BURST_GAP_S)  # lets the server's thread queue what has arrived
            more = self._take(incoming, room - len(taken), on_finish)
            if not more:
                break
            taken += more
        return taken

    def _take(self, incoming, room: int, on_finish) -> list[GenRequest]:
        taken = []
        while len(taken) < room:
            try:
                request = incoming.get_nowait()
            except queue.Empty:
                break
            if request.params.max_new_tokens == 0 and request.abort_message is None:
                self._prefill_only(request, on_finish)  # SGLang: prompt logprobs, nothing generated
            elif not self._finish_if_done(request, on_finish):
                request.admitted = True
                taken.append(request)
        return taken

    def _finish_if_done(self, request: GenRequest, on_finish) -> bool:
        """For requests not in the batch (yet): aborted or cancelled before decoding."""
        reason = request.abort_reason()
        if reason is None:
            return False
        request.finished = True
        self.stats["requests_finished"] += 1
        on_finish(request, reason)
        return True

    def _left_padded(self, requests: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding, so every row's last token is at -1
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids):] = 1
        # OpenAI detail: position ids are the exclusive cumsum of the mask, so pads don't shift positions.
        return input_ids, mask, torch.cumsum(mask, -1) - mask

    def _prefill(self, batch: "DecodeBatch", requests: list[GenRequest]) -> None:
        """Prefill joining requests into new rows of the running batch."""
        self.stats["batches_run"] += 1
        self.stats["rows_run"] += len(requests)
        params = [r.params for r in requests]
        # A prompt shared by several joining requests (a GRPO group's responses) is computed once and its
        # keys and values copied to the other rows, as SGLang's radix cache computes a shared prefix once.
        distinct, source = _distinct_prompts(requests)
        self.stats["prompts_prefilled"] += len(distinct)
        input_ids, distinct_mask, positions = self._left_padded(distinct)
        positions, images, deltas = prefill_inputs([r.vision for r in distinct], distinct_mask, positions, self.dtype)
        mask = distinct_mask[source]
        wants_input = [r.logprob_start_len >= 0 for r in requests]
        batch.cache.begin_join(len(requests), mask, max(p.max_new_tokens for p in params), computed_rows=len(distinct))
        logits = self._forward(input_ids, distinct_mask, positions, batch.cache, last_only=not any(wants_input),
                               **images)
        shared = len(distinct) < len(requests)
        batch.cache.end_join(len(requests), source if shared else None)
        logits = logits[source] if shared else logits
        for row, request in enumerate(requests):
            if wants_input[row]:
                request.input_logprobs = self._input_logprobs(logits[row], request)
        stops = [sorted(self.stop_ids(p)) for p in params]
        width = max(1, max(len(s) for s in stops))
        stop_table = torch.tensor([s + [-1] * (width - len(s)) for s in stops], dtype=torch.long)
        sampling = RowSampling.build(params, draw_uniforms(params, self.rng), self.vocab_size, self.device)
        # Decoding goes on from each prompt's last position + 1: its length, plus its rope delta with images.
        batch.add(requests, logits[:, -1].float(), (mask.sum(-1) + deltas[source]).to(self.device), sampling,
                  stop_table.to(self.device))
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], batch.size)

    def _prefill_only(self, request: GenRequest, on_finish) -> None:
        if request.logprob_start_len >= 0:
            input_ids, mask, positions = self._left_padded([request])
            positions, images, _ = prefill_inputs([request.vision], mask, positions, self.dtype)
            logits = self._forward(input_ids, mask, positions, None, last_only=False, **images)
            request.input_logprobs = self._input_logprobs(logits[0], request)
        request.finished = True
        self.stats["requests_finished"] += 1
        on_finish(request, {"type": "length", "length": 0})

    @staticmethod
    def _input_logprobs(row_logits: torch.Tensor, request: GenRequest) -> list[float | None]:
        """SGLang: log_softmax of the raw logits (no temperature) for prompt[start:], first entry null."""
        ids = request.prompt_ids
        row_logits = row_logits[-len(ids):].float()  # the row is left-padded
        targets = torch.tensor(ids[1:], device=row_logits.device)[:, None]
        logprobs = torch.log_softmax(row_logits[:-1], dim=-1).gather(-1, targets).squeeze(-1)
        values: list[float | None] = [None] + logprobs.tolist()
        start = request.logprob_start_len
        return [None] + values[start + 1:] if start < len(ids) else []

    def _sample_and_finish(self, batch: "DecodeBatch", on_finish) -> None:
        """Sample every row, record the tokens in the per-row tensors, finish the rows that are done."""
        batch.step += 1
        steps = batch.counts
        tokens, logprobs = sample(batch.logits, batch.sampling, steps)
        rows = torch.arange(batch.size, device=self.device)
        batch.out_ids[rows, steps] = tokens
        batch.out_logprobs[rows, steps] = logprobs
        batch.counts = steps + 1
        batch.last_tokens = tokens
        self.stats["tokens_generated"] += batch.size
        finished = batch.finished_rows(tokens)
        if finished:
            self._finish_rows(batch, finished, on_finish)

    def _finish_rows(self, batch: "DecodeBatch", finished: dict[int, dict], on_finish) -> None:
        rows = sorted(finished)
        index = torch.tensor(rows, device=self.device)
        ids, logprobs = batch.out_ids[index].tolist(), batch.out_logprobs[index].tolist()  # one transfer each
        for k, row in enumerate(rows):
            request = batch.requests[row]
            count = batch.step - request.joined_step
            request.output_ids, request.logprobs = ids[k][:count], logprobs[k][:count]
            reason = finished[row]
            if reason["type"] == "stop":
                reason["matched"] = request.output_ids[-1]
            request.finished = True
            self.stats["requests_finished"] += 1
            on_finish(request, reason)
        batch.remove(rows)

    def _decode(self, batch: "DecodeBatch") -> None:
        """One forward of every running row's last token."""
        mask = batch.cache.begin_decode()
        batch.logits = self._forward(batch.last_tokens[:, None], mask, batch.positions[:, None], batch.cache,
                                     last_only=True)[:, -1].float()
        batch.cache.end_decode()
        batch.positions = batch.positions + 1

    def _forward(self, input_ids, mask, positions, cache, last_only: bool, **images) -> torch.Tensor:
        extra = {"logits_to_keep": 1} if last_only and self.keeps_last_logits else {}
        with self.forward_lock:
            if self.released_shapes is not None:
                raise RuntimeError("weights are released; resume them before generating")
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), use_cache=cache is not None,
                             **{self.cache_keyword: cache}, **extra,
                             **{name: value.to(self.device) for name, value in images.items()})
        self.stats["forward_steps"] += 1
        return out.logits


def _distinct_prompts(requests: list[GenRequest]) -> tuple[list[GenRequest], torch.Tensor]:
    """The first request of each distinct prompt (its ids and images), and for every request the index of its
    prompt's."""
    index_of: dict[tuple, int] = {}
    distinct, source = [], []
    for request in requests:
        key = (tuple(request.prompt_ids), request.vision.key if request.vision is not None else None)
        if key not in index_of:
            index_of[key] = len(distinct)
            distinct.append(request)
        source.append(index_of[key])
    return distinct, torch.tensor(source, dtype=torch.long)


def _adoptable(tensor: torch.Tensor, param: torch.Tensor) -> bool:
    """A received tensor the engine can serve from directly: shared CPU memory, the parameter's dtype."""
    return (tensor.device.type == "cpu" and param.device.type == "cpu" and tensor.dtype == param.dtype
            and tensor.is_shared())

