"""Rank 0's prompt samples: the endless, resumable training stream (each prompt repeated
`group_size` times, one `group_id` per prompt) and the fixed list of held-out eval prompts.

Rank 0 drives the rollout, so nothing here is distributed: one `PromptLoader` yields batches of prompts in
a seeded order, and its `state_dict()` goes into the checkpoint so a resumed run continues with the very
next prompt.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from typing import Iterator, Sequence

from rl_core.data import ConfigKeys, PromptDataError, PromptDataset, load_prompt_dataset
from rl_core.prompt_encoding import PromptEncoder, QueryProcessor, encode_row, encode_with_images, refuse_long_prompts


@dataclass(frozen=True)
class PromptItem:
    """One prompt of a batch: its dataset index, its row, its token ids when the loader encodes, and the images it
    shows (RGB PIL images, one image pad each in `prompt_ids`)."""

    index: int
    row: dict
    prompt_ids: list[int] | None = None
    images: tuple = ()


@dataclass
class _Position:
    epoch: int = 0
    position: int = 0
    skipped: int = 0
    order: list[int] = field(default_factory=list)


class PromptLoader:
    """Endless batches of prompts in a seeded order, reshuffled every epoch, resumable.

    Batches run across epoch boundaries so every batch is full. With an `encode` (a row's text -> its prompt ids,
    or None: `PromptEncoder` or `QueryProcessor`), rows that yield none (too long, missing start/end text) are
    skipped and counted in `skipped`.
    """

    def __init__(self, dataset: PromptDataset | Sequence[dict], batch_size: int, seed: int,
                 encode: PromptEncoder | QueryProcessor | None = None, shuffle: bool = True,
                 text_key: str | None = None):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if len(dataset) == 0:
            raise PromptDataError("the prompt dataset is empty")
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.encode = encode
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
            prompt_ids, images = None, []
            if self.encode is not None:
                prompt_ids, images = encode_with_images(self.encode, row, self.text_key,
                                                        getattr(self.dataset, "image_dir", None))
                if prompt_ids is None:
                    self._state.skipped += 1
                    misses += 1
                    if misses > 2 * len(self.dataset):  # two epochs' worth: none is usable
                        raise PromptDataError(
                            "no prompt yields a query: every row is longer than data.max_prompt_length "
                            "or lacks the configured start_text/end_text; fix the dataset or the settings")
                    continue
            misses = 0  # (a usable row can sit at both ends of two reshuffled epochs)
            batch.append(PromptItem(index=index, row=row, prompt_ids=prompt_ids, images=tuple(images)))
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


class PromptSamples:
    """Prompt batches as rollout samples. Queries go to the engine unpadded: with position ids
    from the exclusive cumsum of the mask, OpenAI's fixed-length left padding changes no logit,
    so padding happens only when micro-batches are collated.

    Every sample carries its dataset row (so extra columns such as `answer` reach envs and
    reward functions), `prompt_ids`, and `group_id`: the same for the `group_size` responses of
    one prompt and unique over the run, so group baselines find their groups by id, whatever
    the order and whatever failed.

    A sample, as `envs.base.Env.reset` and the reward functions get it, is the row's columns plus:

    - `prompt_ids`: the prompt's token ids (chat template applied, `data.max_prompt_length` enforced);
    - `index`: the row's index in the dataset;
    - `group_id`: the prompt's group;
    - `sampling_seed`: the engine's seed for this sample, when samples are seeded (`rollout.seeded`);
    - `images`: the images the prompt shows, as RGB PIL images (only a prompt with images has the key).

    A held-out sample (`eval_samples`) has the same, without `sampling_seed`, with the row's index as its
    `group_id`."""

    def __init__(self, loader: PromptLoader, group_size: int, seed: int, seeded: bool = True):
        self.loader, self.group_size, self.seed, self.seeded = loader, group_size, seed, seeded
        self.served = 0  # samples handed out so far: each gets its own engine sampling seed
        self.prompts_served = 0  # prompts handed out so far: the next group id

    def __iter__(self):
        return self

    def __next__(self) -> list[dict]:
        return [sample for item in self.loader.next_batch() for sample in self._group(item)]

    def _group(self, item) -> list[dict]:
        group = []
        for _ in range(self.group_size):
            # A per-sample seed makes a resumed run sample what the uninterrupted run would have.
            # Unseeded where the engines would ignore the seed: the group then goes out as one call (n).
            seed = (self.seed * 1_000_003 + self.served * 7_919) % (2**31 - 1)
            group.append({**item.row, "prompt_ids": item.prompt_ids, "index": item.index,
                          **({"sampling_seed": seed} if self.seeded else {}), "group_id": self.prompts_served,
                          **({"images": list(item.images)} if item.images else {})})
            self.served += 1
        self.prompts_served += 1
        return group

    def groups(self) -> Iterator[list[dict]]:
        """One prompt's group of samples at a time (dynamic sampling draws as many as it needs)."""
        while True:  # one prompt at a time: a prompt drawn is a prompt used
            yield self._group(self.loader.next_batch(1)[0])

    @property
    def skipped(self) -> int:
        """Prompts skipped so far (too long, or without the OpenAI start/end text)."""
        return self.loader.skipped

    def state_dict(self) -> dict:
        """Where the stream is (the loader's position, samples and prompts served), for a checkpoint."""
        return {"loader": self.loader.state_dict(), "served": self.served, "prompts_served": self.prompts_served}

    def load_state_dict(self, state: dict) -> None:
        """Continue from a checkpoint's `state_dict`: the next sample is the one the saved run would have drawn."""
        self.loader.load_state_dict(state["loader"])
        self.served = state["served"]
        self.prompts_served = state.get("prompts_served", 0)


def prompt_encoder(data_cfg, tokenizer, template_kwargs: dict | None = None) -> PromptEncoder:
    """The `data` section's prompt rule: chat template (given `template_kwargs`), length limit, OpenAI query mode."""
    openai_queries = None
    if data_cfg.on_long_prompt == "truncate":
        openai_queries = QueryProcessor(tokenizer, data_cfg.max_prompt_length, data_cfg.start_text, data_cfg.end_text)
    return PromptEncoder(tokenizer, data_cfg.max_prompt_length, data_cfg.on_long_prompt,
                         data_cfg.apply_chat_template, data_cfg.system_prompt, openai_queries, template_kwargs)


def prompt_samples(data_cfg, prompts_path: str, tokenizer, batch_size: int, group_size: int, seed: int,
                   seeded: bool = True, template_kwargs: dict | None = None) -> PromptSamples:
    """The PPO job's prompt stream from its `data` config section (`template_kwargs`: env.chat_template_kwargs)."""
    dataset = load_prompt_dataset(prompts_path, split=data_cfg.train_split, text_key=data_cfg.prompt_key,
                                  on_malformed=data_cfg.on_malformed, hub_config=data_cfg.hub_config)
    if dataset.skipped:
        print(f"skipped {dataset.skipped} malformed prompt rows in {dataset.source}")
    encode = prompt_encoder(data_cfg, tokenizer, template_kwargs)
    refuse_long_prompts(dataset, encode)
    loader = PromptLoader(dataset, batch_size // group_size, seed=seed, encode=encode)
    return PromptSamples(loader, group_size, seed, seeded)


def eval_samples(data_cfg, eval_path: str, tokenizer, n: int, max_prompts: int | None,
                 template_kwargs: dict | None = None) -> tuple[list[dict], int]:
    """The held-out prompts in file order (`n` samples each, one group per prompt) and how many were
    skipped for length; the same list at every evaluation, so the numbers are comparable."""
    dataset = load_prompt_dataset(eval_path, split=data_cfg.eval_split, text_key=data_cfg.prompt_key,
                                  on_malformed=data_cfg.on_malformed, hub_config=data_cfg.hub_config,
                                  keys=ConfigKeys(path="data.eval_path"))
    encode = prompt_encoder(data_cfg, tokenizer, template_kwargs)
    samples, skipped = [], 0
    for index in range(len(dataset)):
        if max_prompts is not None and len(samples) >= max_prompts * n:
            break
        row = dataset[index]
        prompt_ids, images = encode_row(encode, dataset, index)
        if prompt_ids is None:
            skipped += 1
            continue
        samples += [{**row, "prompt_ids": prompt_ids, "index": index, "group_id": index,
                     **({"images": images} if images else {})} for _ in range(n)]
    if not samples:
        raise ValueError(f"no usable eval prompt in {dataset.source} ({skipped} skipped as longer than "
                         "data.max_prompt_length); raise it or check data.eval_path")
    return samples, skipped
