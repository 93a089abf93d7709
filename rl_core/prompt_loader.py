"""Deterministic, resumable prompt batches.

Rank 0 drives the rollout, so nothing here is distributed: one `PromptLoader` yields batches of prompts in
a seeded order, and its `state_dict()` goes into the checkpoint so a resumed run continues with the very
next prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from rl_core.data import PromptDataError, PromptDataset
from rl_core.prompt_encoding import QueryProcessor


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a batch: its dataset index, its row, and its token ids when a processor is set."""

    index: int
    row: dict
    prompt_ids: list[int] | None = None


@dataclass
class _Position:
    epoch: int = 0
    position: int = 0
    skipped: int = 0
    order: list[int] = field(default_factory=list)


class PromptLoader:
    """Endless batches of prompts in a seeded order, reshuffled every epoch, resumable.

    Batches run across epoch boundaries so every batch is full. With a `processor`, rows that
    yield no query (missing start/end text) are skipped and counted in `skipped`.
    """

    def __init__(self, dataset: PromptDataset | Sequence[dict], batch_size: int, seed: int,
                 processor: QueryProcessor | None = None, shuffle: bool = True,
                 text_key: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise PromptDataError("the prompt dataset is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.processor = processor
        self.shuffle = shuffle
        self.text_key = text_key or getattr(dataset, "text_key", "text")
        self._state = _Position(order=self._order(0))

    def _order(self, epoch: int) -> list[int]:
        order = list(range(len(self.dataset)))
        if self.shuffle:
            # A string seed is hashed with SHA-512: the same order in every process and Python run.
            random.Random(f"prompts:{self.seed}:{epoch}").shuffle(order)
        return order

    @property
    def epoch(self) -> int:
        return self._state.epoch

    @property
    def skipped(self) -> int:
        return self._state.skipped

    def _next_index(self) -> int:
        state = self._state
        if state.position == len(state.order):
            state.epoch += 1
            state.position = 0
            state.order = self._order(state.epoch)
        state.position += 1
        return state.order[state.position - 1]

    def next_batch(self, size: int | None = None) -> list[PromptItem]:
        """The next `size` (default `batch_size`) usable prompts."""
        batch, misses = [], 0
        while len(batch) < (size or self.batch_size):
            index = self._next_index()
            row = self.dataset[index]
            prompt_ids = None
            if self.processor is not None:
                prompt_ids = self.processor(row[self.text_key])
                if prompt_ids is None:
                    self._state.skipped += 1
                    misses += 1
                    if misses > 2 * len(self.dataset):  # two epochs' worth: none is usable
                        raise PromptDataError(
                            "no prompt yields a query: every row is longer than data.max_prompt_length "
                            "or lacks the configured start_text/end_text; fix the dataset or the settings")
                    continue
            misses = 0  # (a usable row can sit at both ends of two reshuffled epochs)
            batch.append(PromptItem(index=index, row=row, prompt_ids=prompt_ids))
        return batch

    def __iter__(self) -> Iterator[list[PromptItem]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict:
        state = self._state
        return {"seed": self.seed, "epoch": state.epoch, "position": state.position,
                "skipped": state.skipped, "dataset_size": len(self.dataset),
                "shuffle": self.shuffle}

    def load_state_dict(self, state: dict) -> None:
        if state["dataset_size"] != len(self.dataset):
            raise PromptDataError(
                f"the checkpoint's prompt loader saw {state['dataset_size']} rows but the dataset "
                f"now has {len(self.dataset)}; resume with the same prompt file")
        self.seed = state["seed"]
        self.shuffle = state["shuffle"]
        self._state = _Position(epoch=state["epoch"], position=state["position"],
                                skipped=state["skipped"], order=self._order(state["epoch"]))
