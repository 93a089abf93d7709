"""Prompt datasets: loading and validation. The prompt path goes on in `rl_core/prompt_encoding.py`
(a row's prompt to token ids) and `rl_core/prompt_loader.py` (seeded, resumable batches).

A prompt is plain text, or a chat (a list of `{role, content}` messages) rendered with the
tokenizer's own chat template; the prompt column is named by the caller or found among
`messages`, `prompt`, `text`. Every other column of a row travels with the prompt (e.g. an
`answer` for a reward function). A malformed row stops the load with its file and line, or is
skipped and counted (`on_malformed`).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

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
