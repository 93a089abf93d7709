"""Prompt datasets: loading and validation, prompt encoding, a resumable loader.

A prompt is plain text, or a chat (a list of `{role, content}` messages) rendered with the
tokenizer's own chat template; the prompt column is named by the caller or found among
`messages`, `prompt`, `text`. Every other column of a row travels with the prompt (e.g. an
`answer` for a reward function). Prompt length is explicit (`PromptEncoder`): a prompt longer
than `max_length` is skipped and counted, or refused, never silently cut, except in OpenAI's
fixed-length query mode (`QueryProcessor`), which cuts by design.

Rank 0 drives the rollout, so nothing here is distributed: one `PromptLoader` yields batches
of prompts in a seeded order, and its `state_dict()` goes into the checkpoint so a resumed run
continues with the very next prompt. (A little over 450 lines: the whole prompt path, from file
to token ids, stays readable in one place.)
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Sequence

LOADERS_BY_SUFFIX = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}
MALFORMED_POLICIES = ("error", "skip")
LONG_PROMPT_POLICIES = ("skip", "error", "truncate")
PROMPT_KEYS = ("messages", "prompt", "text")  # looked for in this order when no key is given


class PromptDataError(ValueError):
    """A prompt file or dataset that cannot be used as it is; the message says how to fix it."""


@dataclass(frozen=True)
class ConfigKeys:
    """The config keys behind a prompt file, named in error messages (defaults: the PPO job's)."""

    path: str = "data.train_path"
    text_key: str = "data.prompt_key"
    on_malformed: str | None = "data.on_malformed"  # None: the job has no such switch

    @property
    def skip_hint(self) -> str:
        return f", or set {self.on_malformed}=skip to drop such rows" if self.on_malformed else ""


# --- loading -------------------------------------------------------------------------------------


@dataclass
class PromptDataset:
    """Valid prompt rows (every row has a non-empty string or message list under `text_key`)."""

    rows: Any  # datasets.Dataset
    source: str
    text_key: str = "text"
    skipped: int = 0  # malformed rows dropped when loaded with on_malformed="skip"

    def __len__(self) -> int:
        return len(self.rows)

    def __getitem__(self, index: int) -> dict:
        return self.rows[index]

    def texts(self) -> list[str]:
        return list(self.rows[self.text_key])


def load_prompt_dataset(path_or_name: str | Path, split: str = "train", text_key: str | None = "text",
                        on_malformed: str = "error", hub_config: str | None = None,
                        keys: "ConfigKeys | None" = None) -> PromptDataset:
    """Load prompts from a local .jsonl/.json/.csv/.parquet file, or a hub dataset when online.

    `split` and `hub_config` (e.g. "main" for openai/gsm8k) apply to hub datasets only (a local
    file is one split). `text_key=None` takes the first of `messages`, `prompt`, `text` the data
    has. With `on_malformed="skip"`, rows without a usable prompt (and unparseable JSON lines)
    are dropped and counted in `.skipped` instead of stopping the job. `keys` names the config
    keys that set path, prompt key and policy, so error messages point at what the user can change.
    """
    keys = keys or ConfigKeys()
    if on_malformed not in MALFORMED_POLICIES:
        raise PromptDataError(f"on_malformed={on_malformed!r} is not one of {MALFORMED_POLICIES}")
    path = Path(path_or_name).expanduser()
    if path.is_file():
        rows, skipped = _load_local(path, text_key, on_malformed, keys)
        source = str(path)
    elif _looks_like_a_path(str(path_or_name)):
        raise PromptDataError(f"prompt file {path} does not exist (resolved to {path.resolve()}); "
                              f"check {keys.path}, or set it to 'tiny' for the offline prompts")
    else:
        rows, skipped, source = _load_from_hub(str(path_or_name), split, hub_config, keys), 0, str(path_or_name)
        source = f"{source} (hub, split {split})"
    if text_key is None:
        text_key = _resolve_key(rows.column_names, source, keys)
    dataset, dropped = _validate_rows(rows, source, text_key, on_malformed, keys)
    dataset = PromptDataset(dataset, source, text_key, skipped + dropped)
    if len(dataset) == 0:
        raise PromptDataError(f"{source} has no usable prompt rows ({dataset.skipped} malformed "
                              f"skipped); every row needs a non-empty string field '{text_key}' ({keys.text_key})")
    return dataset


def _resolve_key(columns: Sequence[str], source: str, keys: "ConfigKeys") -> str:
    for key in PROMPT_KEYS:
        if key in columns:
            return key
    raise PromptDataError(f"{source} has none of the prompt fields {list(PROMPT_KEYS)} (fields: {list(columns)}); "
                          f"set {keys.text_key} to the field that holds the prompt")


def _looks_like_a_path(name: str) -> bool:
    return Path(name).suffix.lower() in LOADERS_BY_SUFFIX or name.startswith((".", "/", "~"))


def _load_local(path: Path, text_key: str, on_malformed: str, keys: "ConfigKeys"):
    """(datasets.Dataset, rows skipped while parsing) for one local file."""
    import datasets

    loader = LOADERS_BY_SUFFIX.get(path.suffix.lower())
    if loader is None:
        raise PromptDataError(f"{path}: unsupported extension '{path.suffix}'; "
                              f"use one of {sorted(LOADERS_BY_SUFFIX)}")
    if loader != "parquet" and (problem := utf8_problem(path)) is not None:
        raise PromptDataError(problem)
    if loader != "parquet" and not path.read_text(encoding="utf-8").strip():
        raise PromptDataError(f"{path} is empty; add prompt rows with a '{text_key or 'prompt'}' field")
    try:
        return datasets.load_dataset(loader, data_files=str(path), split="train"), 0
    except Exception as error:  # noqa: BLE001 - re-raised below with the file and line
        if loader == "json":
            return _load_json_by_hand(path, text_key, on_malformed, error, keys)
        if loader == "csv" and _count_nonblank_lines(path) <= 1:
            raise PromptDataError(f"{path} has a header but no rows; add prompt rows") from error
        raise PromptDataError(f"could not read {path} as {loader}: {error}") from error


def utf8_problem(path: Path) -> str | None:
    """Where a text data file stops being UTF-8, as "<file>, line N: ...; fix", or None when it is UTF-8.

    Checked before a parser reads the file: parsers name a bad byte by its offset alone, or not at all."""
    data = path.read_bytes()
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as bad:
        line = data.count(b"\n", 0, bad.start) + 1
        column = bad.start - data.rfind(b"\n", 0, bad.start)
        return (f"{path}, line {line}: byte 0x{data[bad.start]:02x} at column {column} is not UTF-8 ({bad.reason}); "
                "save the file as UTF-8 (e.g. `iconv -f latin1 -t utf-8`)")
    return None


def _count_nonblank_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())


def _load_json_by_hand(path: Path, text_key: str, on_malformed: str, error: Exception, keys: "ConfigKeys"):
    """The `datasets` JSON reader failed: find the bad line ourselves and say which it is."""
    import datasets

    text = path.read_text(encoding="utf-8")
    if text.lstrip().startswith("["):  # one JSON document: a bad line cannot be skipped
        try:
            json.loads(text)
        except json.JSONDecodeError as bad:
            raise PromptDataError(f"{path}, line {bad.lineno}: invalid JSON ({bad.msg}); "
                                  "fix that line") from error
        raise PromptDataError(f"could not read {path} as JSON: {error}") from error
    rows, skipped = [], 0
    for line_number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as bad:
            if on_malformed == "skip":
                skipped += 1
                continue
            raise PromptDataError(f"{path}, line {line_number}: invalid JSON ({bad.msg}); fix or "
                                  f"remove that line{keys.skip_hint}") from error
        rows.append(row if isinstance(row, dict) else {})
    if text_key is None:
        text_key = _resolve_key(sorted({key for row in rows for key in row}), str(path), keys)
    # Drop rows without a usable text here: Arrow cannot hold a column of mixed types.
    good = []
    for index, row in enumerate(rows):
        problem = _row_problem(row.get(text_key), text_key)
        if problem is None:
            good.append(row)
        elif on_malformed == "error":
            raise PromptDataError(f"{path}, row {index + 1}: {problem}; give every row a "
                                  f"non-empty string '{text_key}'{keys.skip_hint}") from error
    skipped += len(rows) - len(good)
    try:
        return datasets.Dataset.from_list(good), skipped
    except Exception:  # noqa: BLE001 - other fields of mixed types: keep the prompt text only
        return datasets.Dataset.from_list([{text_key: row[text_key]} for row in good]), skipped


def _load_from_hub(name: str, split: str, hub_config: str | None, keys: "ConfigKeys"):
    import datasets

    try:
        return datasets.load_dataset(name, hub_config, split=split)
    except Exception as error:  # noqa: BLE001 - offline, unknown name, unknown split
        raise PromptDataError(
            f"'{name}' is not an existing local file, and loading it from the Hugging Face hub "
            f"failed ({type(error).__name__}: {error}); the hub may be unreachable (offline); "
            f"set {keys.path} to a local .jsonl/.json/.csv/.parquet path instead") from error


def _row_problem(value: Any, text_key: str) -> str | None:
    if value is None:
        return f"missing '{text_key}'"
    if isinstance(value, list) and value:  # a chat: [{role, content}, ...]
        for message in value:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not isinstance(message.get("content"), str):
                return f"'{text_key}' is a list but not of {{'role': str, 'content': str}} messages"
        return None
    if not isinstance(value, str):
        return f"'{text_key}' is a {type(value).__name__}, not a string or a list of chat messages"
    if not value.strip():
        return f"'{text_key}' is empty"
    return None


def _validate_rows(rows, source: str, text_key: str, on_malformed: str, keys: "ConfigKeys"):
    """Keep rows whose `text_key` is a non-empty string; error on the first bad one unless skipping."""
    if len(rows) == 0:
        return rows, 0
    if text_key not in rows.column_names:
        raise PromptDataError(f"{source} has no '{text_key}' field in any row (fields: "
                              f"{rows.column_names}); set {keys.text_key} to one of them")
    keep = []
    for index, value in enumerate(rows[text_key]):
        problem = _row_problem(value, text_key)
        if problem is None:
            keep.append(index)
        elif on_malformed == "error":
            raise PromptDataError(f"{source}, row {index + 1}: {problem}; give every row a "
                                  f"non-empty string '{text_key}'{keys.skip_hint}")
    if len(keep) == len(rows):
        return rows, 0
    return rows.select(keep), len(rows) - len(keep)


# --- query preprocessing (OpenAI lm-human-preferences) -------------------------------------------


def _find(tokens: list[int], pattern: list[int], last: bool = False) -> int:
    """Index of the first (or last) occurrence of `pattern` in `tokens`, or -1."""
    starts = range(len(tokens) - len(pattern), -1, -1) if last else range(len(tokens) - len(pattern) + 1)
    for start in starts:
        if tokens[start:start + len(pattern)] == pattern:
            return start
    return -1


class QueryProcessor:
    """Text -> query ids of at most `query_length`, as OpenAI's `lm-human-preferences` builds its queries.

    Steps: keep tokens after the first `start_text`; truncate to `query_length` (keeping the
    beginning by default, as OpenAI does); keep tokens up to and including the last `end_text`.
    The query stays unpadded: padding (with [PAD], which must differ from EOS) happens only when
    micro-batches are collated. A text lacking a configured start/end text gives `None` (OpenAI
    skips such samples).
    """

    def __init__(self, tokenizer, query_length: int, start_text: str | None = None,
                 end_text: str | None = None, truncate_side: str = "right"):
        if query_length < 1:
            raise ValueError(f"query_length must be >= 1, got {query_length}")
        if truncate_side not in ("left", "right"):
            raise ValueError(f"truncate_side must be 'left' or 'right', got {truncate_side!r}")
        pad_id = tokenizer.pad_token_id
        if pad_id is None or pad_id == tokenizer.eos_token_id:
            raise ValueError("the tokenizer needs a pad token distinct from EOS (OpenAI detail); "
                             "add one with tokenizer.add_special_tokens({'pad_token': '[PAD]'})")
        self.tokenizer = tokenizer
        self.query_length = query_length
        self.truncate_side = truncate_side
        self.start_ids = self._marker_ids(start_text, "start_text")
        self.end_ids = self._marker_ids(end_text, "end_text")

    def _marker_ids(self, text: str | None, name: str) -> list[int] | None:
        if text is None:
            return None
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if not ids:
            raise ValueError(f"{name}={text!r} tokenizes to nothing; use None or a visible text")
        return ids

    def __call__(self, text: str) -> list[int] | None:
        return self.from_ids(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def from_ids(self, tokens: list[int]) -> list[int] | None:
        tokens = list(tokens)
        if self.start_ids is not None:
            start = _find(tokens, self.start_ids)
            if start < 0:
                return None
            after = start + len(self.start_ids)
            if after < len(tokens):  # as OpenAI: nothing after the marker keeps the text whole
                tokens = tokens[after:]
        if self.truncate_side == "right":
            tokens = tokens[:self.query_length]
        else:
            tokens = tokens[-self.query_length:]
        if self.end_ids is not None:
            end = _find(tokens, self.end_ids, last=True)
            if end < 0:
                return None
            tokens = tokens[:end + len(self.end_ids)]
        return tokens or None


class PromptEncoder:
    """A prompt (text or chat messages) -> its token ids, with an explicit length rule.

    Chat messages are rendered with the tokenizer's own chat template and the generation
    prompt (`apply_chat_template(..., add_generation_prompt=True)`); `chat_template=True` also
    wraps a plain-text prompt as one user message (after `system_prompt`, if any).
    `on_long="skip"` returns None for a prompt over `max_length` tokens (the loader skips and
    counts it), `"error"` refuses it; `"truncate"` is OpenAI's fixed-length query mode, left to
    `QueryProcessor` for plain text. Returns the prompt's token ids, as `QueryProcessor` does, so the
    loader treats both alike. `template_kwargs` (`env.chat_template_kwargs`, e.g. `enable_thinking: false`)
    go to the chat template, as in every other rendering of the job's conversations.
    """

    def __init__(self, tokenizer, max_length: int, on_long: str = "skip", chat_template: bool | None = None,
                 system_prompt: str | None = None, query_processor: QueryProcessor | None = None,
                 template_kwargs: dict | None = None):
        if on_long not in LONG_PROMPT_POLICIES:
            raise ValueError(f"on_long={on_long!r} is not one of {LONG_PROMPT_POLICIES}")
        self.tokenizer, self.max_length, self.on_long = tokenizer, max_length, on_long
        self.chat_template, self.system_prompt = chat_template, system_prompt
        self.query_processor = query_processor
        self.template_kwargs = dict(template_kwargs or {})
        self.too_long = 0  # prompts skipped for length by this encoder

    def messages(self, prompt: str | list) -> list[dict] | None:
        """The chat to render, or None for a prompt used as plain text."""
        if isinstance(prompt, list):
            if self.chat_template is False:
                raise PromptDataError("a prompt is a list of chat messages but data.apply_chat_template=false; "
                                      "set it to true (or null) or give plain-text prompts")
            messages = [dict(m) for m in prompt]
        elif self.chat_template:
            messages = [{"role": "user", "content": prompt}]
        else:
            return None
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, prompt: str | list) -> str:
        """The prompt as the model will read it (the chat template applied when it is a chat)."""
        messages = self.messages(prompt)
        if messages is None:
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptDataError(f"the tokenizer ({getattr(self.tokenizer, 'name_or_path', '?')}) has no chat template "
                                  "but the prompts are chats; use a chat model's tokenizer (model.tokenizer_path) "
                                  "or set data.apply_chat_template=false with plain-text prompts")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)

    def __call__(self, prompt: str | list) -> list[int] | None:
        messages = self.messages(prompt)
        if messages is None and self.on_long == "truncate" and self.query_processor is not None:
            return self.query_processor(prompt)
        # A rendered chat carries its own special tokens; plain text gets the tokenizer's usual ones (BOS).
        ids = self.tokenizer(self.render(prompt), add_special_tokens=messages is None)["input_ids"]
        if len(ids) > self.max_length:
            if self.on_long == "error":
                raise PromptDataError(f"the prompt has {len(ids)} tokens, more than data.max_prompt_length="
                                      f"{self.max_length}: raise data.max_prompt_length or set "
                                      "data.on_long_prompt=skip to skip (and count) such prompts")
            if self.on_long == "skip":
                self.too_long += 1
                return None
            ids = ids[:self.max_length]
        return list(ids) or None


def encode_row(encode: PromptEncoder, dataset: PromptDataset, index: int) -> list[int] | None:
    """`encode` of one dataset row; a refusal names the file and the row."""
    try:
        return encode(dataset[index][dataset.text_key])
    except PromptDataError as error:
        raise PromptDataError(f"{dataset.source}, row {index + 1}: {error}") from None


def refuse_long_prompts(dataset: PromptDataset, encode: PromptEncoder) -> None:
    """With `on_long="error"`, encode every row now: a long prompt stops the job while the data is
    read, before any engine starts, not at the step that first draws it."""
    if encode.on_long == "error":
        for index in range(len(dataset)):
            encode_row(encode, dataset, index)


# --- deterministic, resumable prompt batches -----------------------------------------------------


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
