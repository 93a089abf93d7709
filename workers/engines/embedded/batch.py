"""The embedded engine's requests and its running batch: what a /generate call asks for (`SamplingParams`,
`GenRequest`) and the rows being decoded together with their per-row tensors (`DecodeBatch`)."""

from __future__ import annotations

import asyncio
import dataclasses
import time

import torch

from workers.engines.embedded.kv_cache import SlotCache
from workers.engines.embedded.sampling import GREEDY_TEMPERATURE, RowSampling, cat_padded


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
    vision: object = None  # images.VisionPrompt: the prompt's images (prompt_ids are then its expanded ids)
    created: float = dataclasses.field(default_factory=time.perf_counter)
    output_ids: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    input_logprobs: list[float | None] | None = None
    abort_message: str | None = None
    admitted: bool = False  # set by the decode thread once the request is in the batch
    finished: bool = False
    joined_step: int = 0  # the batch's step counter when it joined: its k-th token is sampled at joined_step + k

    def abort_reason(self) -> dict | None:
        """SGLang's abort finish reason when the request was aborted or its client went away, else None."""
        if self.future.cancelled() and self.abort_message is None:
            self.abort_message = "client disconnected"
        return None if self.abort_message is None else {"type": "abort", "message": self.abort_message}


class DecodeBatch:
    """The running rows: their requests, KV cache, and per-row tensors in the same row order."""

    def __init__(self, cache: SlotCache):
        self.cache = cache
        self.requests: list[GenRequest] = []
        self.step = 0
        self.due: dict[int, list[GenRequest]] = {}  # step -> requests reaching max_new_tokens then
        self.can_stop = False  # some running row has stop tokens (else no device read per step)
        self.logits = self.positions = self.counts = self.last_tokens = None
        self.out_ids = self.out_logprobs = self.stop_table = None
        self.sampling: RowSampling | None = None

    @property
    def size(self) -> int:
        return len(self.requests)

    def add(self, requests: list[GenRequest], logits: torch.Tensor, positions: torch.Tensor,
            sampling: RowSampling, stop_table: torch.Tensor) -> None:
        """Append freshly prefilled rows."""
        device = logits.device
        width = sampling.uniforms.shape[1]
        counts = torch.zeros(len(requests), dtype=torch.long, device=device)
        out_ids = torch.zeros((len(requests), width), dtype=torch.long, device=device)
        out_logprobs = torch.zeros((len(requests), width), dtype=torch.float32, device=device)
        for request in requests:
            request.joined_step = self.step
            self.due.setdefault(self.step + request.params.max_new_tokens, []).append(request)
        self.can_stop = self.can_stop or bool((stop_table >= 0).any())
        if not self.requests:
            self.logits, self.positions, self.counts, self.sampling = logits, positions, counts, sampling
            self.out_ids, self.out_logprobs, self.stop_table = out_ids, out_logprobs, stop_table
            self.last_tokens = None
        else:
            self.logits = torch.cat([self.logits, logits])
            self.positions = torch.cat([self.positions, positions])
            self.counts = torch.cat([self.counts, counts])
            self.sampling = self.sampling.cat(sampling)
            self.out_ids = cat_padded(self.out_ids, out_ids)
            self.out_logprobs = cat_padded(self.out_logprobs, out_logprobs)
            self.stop_table = cat_padded(self.stop_table, stop_table, value=-1)
        self.requests = self.requests + requests

    def finished_rows(self, tokens: torch.Tensor) -> dict[int, dict]:
        """Rows done after this step's tokens -> SGLang finish reason (abort, then length, then stop)."""
        finished: dict[int, dict] = {}
        for row, request in enumerate(self.requests):  # attribute reads only: cheap even for big batches
            reason = request.abort_reason()
            if reason is not None:
                finished[row] = reason
        due = [request for request in self.due.pop(self.step, ()) if not request.finished]
        if due:
            row_of = {id(request): row for row, request in enumerate(self.requests)}
            for request in due:
                finished.setdefault(row_of[id(request)], {"type": "length", "length": request.params.max_new_tokens})
        if self.can_stop:
            hit = (self.stop_table == tokens[:, None]).any(-1)
            for row in hit.nonzero().flatten().tolist():
                finished.setdefault(row, {"type": "stop", "matched": None})
        return finished

    def remove(self, rows: list[int]) -> None:
        source = self.cache.remove(rows)
        index = torch.tensor(source, dtype=torch.long, device=self.logits.device)
        self.requests = [self.requests[i] for i in source]
        self.logits, self.positions, self.counts = self.logits[index], self.positions[index], self.counts[index]
        self.out_ids, self.out_logprobs = self.out_ids[index], self.out_logprobs[index]
        self.stop_table, self.last_tokens = self.stop_table[index], self.last_tokens[index]
        self.sampling = self.sampling.select(index)
        if not self.requests:
            self.can_stop = False
