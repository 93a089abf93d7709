"""The embedded engine's model side: one Hugging Face causal LM, decoded with continuous batching.

Concurrent requests are decoded together: between two decode steps, waiting requests are
left-padded and prefilled together, then merged into the running batch (its KV cache
left-padded to a common length); finished rows leave the batch and their cache is dropped.
Everything here runs in one worker thread, so the server's event loop keeps accepting requests.
"""

from __future__ import annotations

import asyncio
import dataclasses
import queue
import threading
import time
from typing import Any, Callable

import torch

GREEDY_TEMPERATURE = 1e-6  # SGLang: a temperature below this samples greedily


@dataclasses.dataclass
class SamplingParams:
    """SGLang's sampling parameters this engine implements (validated by the server)."""
    max_new_tokens: int = 128
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    n: int = 1
    sampling_seed: int | None = None

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
    logprob_start_len: int = -1  # >= 0: also return the prompt's logprobs from that position
    created: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    abort_message: str | None = None
    admitted: bool = False  # set by the decode thread once the request is in the batch
    finished: bool = False
    generator: torch.Generator | None = None  # own RNG when sampling_seed is set


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
        self.forward_lock = threading.Lock()  # weight changes never interleave with a forward
        self.weight_version = "default"  # SGLang's initial version; changed under forward_lock
        self.step_gate = threading.Event()  # cleared by pause in_place/retract: decoding waits
        self.step_gate.set()
        self.released_shapes: dict[str, torch.Size] | None = None
        self.stats = {"batches_run": 0, "forward_steps": 0, "max_batch_seen": 0, "rows_run": 0,
                      "requests_finished": 0, "tokens_generated": 0}

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

    def resume_weights(self) -> None:
        """Allocate the weights again (zeros): they must be pushed before the next generation."""
        with self.forward_lock:
            for name, param in self.unique_parameters().items():
                param.data = torch.zeros(self.released_shapes[name], dtype=param.dtype, device=param.device)
            self.released_shapes = None

    def load_tensors(self, named_tensors: list[tuple[str, torch.Tensor]], version: str | None) -> int:
        """Copy tensors into the live weights by HF name (any subset), under the forward lock."""
        with self.forward_lock:
            own = self.model.state_dict()
            unknown = sorted(name for name, _ in named_tensors if name not in own)
            if unknown:
                raise ValueError(f"unknown weight names {unknown[:5]} (the model's look like {sorted(own)[:3]})")
            with torch.no_grad():
                for name, tensor in named_tensors:
                    if tuple(own[name].shape) != tuple(tensor.shape):
                        raise ValueError(f"shape mismatch for {name}: engine {tuple(own[name].shape)}, "
                                         f"sent {tuple(tensor.shape)}")
                    own[name].copy_(tensor)
            if version is not None:  # under the lock: no forward sees new weights with the old label
                self.weight_version = str(version)
        return len(named_tensors)

    # -- sampling

    def sample(self, logits: torch.Tensor, requests: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor]:
        """Sample one token per row; return (token ids, their logprobs under logits/T over the full vocab)."""
        logits = logits.float()
        temps = torch.tensor([r.params.temperature for r in requests])
        greedy = temps < GREEDY_TEMPERATURE
        # OpenAI detail (and SGLang): logprobs come from logits / temperature (greedy rows stay unscaled).
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

    def run_until_idle(self, incoming: "queue.SimpleQueue[GenRequest]", max_batch_size: int,
                       on_finish: Callable[[GenRequest, dict], None]) -> None:
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
                    batch.logits, batch.cache, _ = self._forward(batch.last_tokens[:, None], batch.mask,
                                                                 batch.next_position[:, None], batch.cache)
                    batch.next_position = batch.next_position + 1

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

    def _left_padded(self, requests: list[GenRequest]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        width = max(len(r.prompt_ids) for r in requests)
        input_ids = torch.full((len(requests), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(requests), width), dtype=torch.long)
        for row, request in enumerate(requests):  # left padding, so every row's last token is at -1
            input_ids[row, width - len(request.prompt_ids):] = torch.tensor(request.prompt_ids)
            mask[row, width - len(request.prompt_ids):] = 1
        # OpenAI detail: position ids are the exclusive cumsum of the mask, so pads don't shift positions.
        return input_ids, mask, torch.cumsum(mask, -1) - mask

    def _prefill(self, requests: list[GenRequest]) -> "DecodeBatch":
        self.stats["batches_run"] += 1
        self.stats["rows_run"] += len(requests)
        for request in requests:
            if request.params.sampling_seed is not None:
                request.generator = torch.Generator().manual_seed(int(request.params.sampling_seed))
        input_ids, mask, positions = self._left_padded(requests)
        wants_input = [r.logprob_start_len >= 0 for r in requests]
        logits, cache, all_logits = self._forward(input_ids, mask, positions, None, keep_all=any(wants_input))
        for row, request in enumerate(requests):
            if wants_input[row]:
                request.input_logprobs = self._input_logprobs(all_logits[row], request)
        return DecodeBatch(list(requests), cache, mask, mask.sum(-1), logits, None)

    def _prefill_only(self, request: GenRequest, on_finish) -> None:
        input_ids, mask, positions = self._left_padded([request])
        if request.logprob_start_len >= 0:
            _, _, all_logits = self._forward(input_ids, mask, positions, None, keep_all=True)
            request.input_logprobs = self._input_logprobs(all_logits[0], request)
        request.finished = True
        self.stats["requests_finished"] += 1
        on_finish(request, {"type": "length", "length": 0})

    @staticmethod
    def _input_logprobs(row_logits: torch.Tensor, request: GenRequest) -> list[float | None]:
        """SGLang: log_softmax of the raw logits (no temperature) for prompt[start:], first entry null."""
        ids = request.prompt_ids
        row_logits = row_logits[-len(ids):].float()  # the row is left-padded
        logprobs = torch.log_softmax(row_logits[:-1], dim=-1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        values: list[float | None] = [None] + logprobs.tolist()
        start = request.logprob_start_len
        return [None] + values[start + 1:] if start < len(ids) else []

    def _sample_and_finish(self, batch: "DecodeBatch", on_finish) -> "DecodeBatch | None":
        tokens, logprobs = self.sample(batch.logits, batch.requests)
        keep = []
        for row, request in enumerate(batch.requests):
            request.output_ids.append(int(tokens[row]))
            request.logprobs.append(float(logprobs[row]))
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

    def _forward(self, input_ids, mask, positions, cache, keep_all: bool = False):
        with self.forward_lock:
            if self.released_shapes is not None:
                raise RuntimeError("weights are released; resume them before generating")
            out = self.model(input_ids=input_ids.to(self.device), attention_mask=mask.to(self.device),
                             position_ids=positions.to(self.device), past_key_values=cache, use_cache=True)
        self.stats["forward_steps"] += 1
        self.stats["max_batch_seen"] = max(self.stats["max_batch_seen"], input_ids.shape[0])
        all_logits = out.logits.to("cpu") if keep_all else None
        return out.logits[:, -1, :].to("cpu"), out.past_key_values, all_logits


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
