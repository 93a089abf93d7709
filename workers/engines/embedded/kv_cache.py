"""The embedded engine's KV cache: preallocated buffers shared by every running request.

Per layer, keys and values live in `[row_capacity, heads, time_capacity, head_dim]` buffers.
Running requests are rows `0 .. rows-1`. Every row writes its next token at the same column
`end`, and attends to the columns its row of `mask` marks, so a request that joined later
simply has masked columns on its left (left padding). A decode step reads the window
`[start, end]`, where `start` is the first column any running row uses.

Why not Hugging Face's DynamicCache: it concatenates on every decode step (a copy of the whole
cache per step) and merging joining requests into it copies the running cache again. Here a
decode step writes one column, a join writes only the new rows, and a finished row is filled
by the last row. Buffers are re-allocated only when rows or columns run out; columns are
reserved for every row's `max_new_tokens` when it joins, so a batch of requests that arrive
together never re-allocates.

`SlotCache` is a transformers `Cache`: the model writes through `update`, at the rows and
columns set by `begin_join` (prefill of joining rows) or `begin_decode` (one step of all rows).
"""

from __future__ import annotations

import weakref

import torch
from transformers.cache_utils import Cache, CacheLayerMixin


class SlotLayer(CacheLayerMixin):
    """One layer's buffers; `update` writes the new keys/values where its SlotCache says."""

    is_sliding = False

    def __init__(self, cache: "SlotCache"):
        super().__init__()
        # A weak reference: cache -> layer -> cache would be a cycle, which only Python's cyclic
        # collector frees, so every finished batch's KV buffers stayed alive until it ran.
        self.cache = weakref.proxy(cache)
        self.key_buffer: torch.Tensor | None = None
        self.value_buffer: torch.Tensor | None = None
        self.is_initialized = True

    def lazy_initialization(self, key_states: torch.Tensor, value_states: torch.Tensor) -> None:
        """Buffers are made on the first write, when heads and head size are known."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        cache = self.cache
        if self.key_buffer is None:
            self.key_buffer, self.value_buffer = cache.new_buffer(key_states), cache.new_buffer(value_states)
        rows = slice(cache.rows_from, cache.rows_to)
        stop = cache.write_at + key_states.shape[-2]
        self.key_buffer[rows, :, cache.write_at:stop] = key_states
        self.value_buffer[rows, :, cache.write_at:stop] = value_states
        self.keys = self.key_buffer[rows, :, cache.read_from:stop]
        self.values = self.value_buffer[rows, :, cache.read_from:stop]
        return self.keys, self.values

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.get_seq_length() + query_length, 0

    def get_seq_length(self) -> int:
        return self.cache.write_at - self.cache.read_from

    def get_max_length(self) -> int:
        return -1

    get_max_cache_shape = get_max_length  # its name up to transformers 5.12 (SGLang 0.5.17 pins it)

    def buffers(self) -> list[str]:
        return [name for name in ("key_buffer", "value_buffer") if getattr(self, name) is not None]


class SlotCache(Cache):
    """KV cache of the running batch: rows, the column window and the per-row attention mask."""

    def __init__(self, num_layers: int, device: torch.device, max_rows: int):
        super().__init__(layers=[SlotLayer(self) for _ in range(num_layers)])
        self.device = device
        self.max_rows = max_rows
        self.rows = 0
        self.start = self.end = 0  # the window running rows read: [start, end)
        self.reserved_end = 0  # the column past the last one any running row may still write
        self.row_capacity = self.time_capacity = 0
        self.mask = torch.zeros((0, 0), dtype=torch.bool, device=device)
        self.relayouts = 0
        # Where the next forward writes and reads (set by begin_join / begin_decode).
        self.rows_from = self.rows_to = self.write_at = self.read_from = 0

    def new_buffer(self, like: torch.Tensor) -> torch.Tensor:
        # Zeros, not empty: masked columns are multiplied by a zero attention weight, and 0 * NaN is NaN.
        return torch.zeros((self.row_capacity, like.shape[1], self.time_capacity, like.shape[3]),
                           dtype=like.dtype, device=like.device)

    # -- joining rows

    def begin_join(self, new_rows: int, prompt_mask: torch.Tensor, max_new_tokens: int,
                   computed_rows: int | None = None) -> None:
        """Make room for `new_rows` left-padded prompts ending at column `end`; the next forward
        (their prefill) writes rows `rows .. rows+computed_rows-1` (default all new rows), columns
        `end-width .. end-1`."""
        width = prompt_mask.shape[1]
        if self.rows == 0:  # nothing to keep: the prompts start at column 0
            self.start = self.end = self.reserved_end = width
        window = self.end - self.start
        needed_end = max(self.reserved_end, self.end + max_new_tokens)
        fits = (self.end >= width and self.rows + new_rows <= self.row_capacity
                and needed_end <= self.time_capacity)
        if not fits:
            new_end = max(window, width)  # the smallest layout: the window and the prompt end together
            shift = new_end - self.end
            needed_end = max(self.reserved_end + shift, new_end + max_new_tokens)
            rows = self.rows + new_rows
            self._relayout(max(rows, min(self.max_rows, 2 * self.row_capacity)),
                           needed_end + needed_end // 2, new_end - window)
        self.reserved_end = max(needed_end, self.reserved_end)
        first = self.end - width
        self.mask[self.rows:self.rows + new_rows] = False
        self.mask[self.rows:self.rows + new_rows, first:self.end] = prompt_mask.to(self.device, torch.bool)
        self.rows_from, self.rows_to = self.rows, self.rows + (computed_rows or new_rows)
        self.write_at = self.read_from = first

    def end_join(self, new_rows: int, source: torch.Tensor | None = None) -> None:
        """The joined rows are running; the window now also covers their prompts. With `source`, only
        distinct prompts were computed: joining row i takes the keys and values of computed row source[i]."""
        if source is not None:
            rows, computed = slice(self.rows, self.rows + new_rows), source.to(self.device) + self.rows
            for layer in self.layers:
                for name in layer.buffers():
                    buffer = getattr(layer, name)
                    buffer[rows, :, self.write_at:self.end] = buffer[computed, :, self.write_at:self.end]
        self.rows += new_rows
        self.start = min(self.start, self.write_at)

    # -- decoding

    def begin_decode(self) -> torch.Tensor:
        """Every running row writes column `end`; returns their attention mask over [start, end]."""
        if self.end >= self.time_capacity:
            raise RuntimeError(f"KV cache columns exhausted ({self.end} of {self.time_capacity}); "
                               "a request outlived its reserved max_new_tokens")
        self.mask[:self.rows, self.end] = True
        self.rows_from, self.rows_to = 0, self.rows
        self.write_at, self.read_from = self.end, self.start
        return self.mask[:self.rows, self.start:self.end + 1]

    def end_decode(self) -> None:
        self.end += 1

    # -- leaving rows

    def remove(self, rows: list[int]) -> list[int]:
        """Drop `rows`; the last running rows move into the holes (only their data is copied).

        Returns `source`: new row i holds what was row `source[i]`, for the caller's per-row state.
        """
        gone = set(rows)
        kept = self.rows - len(gone)
        holes = [row for row in sorted(gone) if row < kept]
        movers = [row for row in range(kept, self.rows) if row not in gone]
        if holes:
            to, src = torch.tensor(holes, device=self.device), torch.tensor(movers, device=self.device)
            for layer in self.layers:
                for name in layer.buffers():
                    buffer = getattr(layer, name)
                    buffer[to, :, self.start:self.end] = buffer[src, :, self.start:self.end]
            self.mask[to] = self.mask[src]  # whole rows: columns left of the window must stay correct too
        self.rows = kept
        source = list(range(kept))
        for hole, mover in zip(holes, movers):
            source[hole] = mover
        self.start = self._first_used() if kept else self.end
        return source

    # -- layout

    def _first_used(self) -> int:
        """The first column any running row attends to (columns left of it are dropped from reads)."""
        used = self.mask[:self.rows, :self.end].any(0)
        return int(used.int().argmax()) if self.rows else self.end

    def _relayout(self, row_capacity: int, time_capacity: int, new_start: int) -> None:
        """Move the running window to start at `new_start` in buffers of the given capacity."""
        self.relayouts += 1
        window = self.end - self.start
        old, new = slice(self.start, self.end), slice(new_start, new_start + window)
        self.row_capacity, self.time_capacity = row_capacity, time_capacity
        for layer in self.layers:
            for name in layer.buffers():
                buffer = getattr(layer, name)
                fresh = self.new_buffer(buffer)
                fresh[:self.rows, :, new] = buffer[:self.rows, :, old]
                setattr(layer, name, fresh)
        mask = torch.zeros((row_capacity, time_capacity), dtype=torch.bool, device=self.device)
        mask[:self.rows, new] = self.mask[:self.rows, old]
        self.mask = mask
        self.start, self.end = new_start, new_start + window
