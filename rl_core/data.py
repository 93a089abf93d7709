"""Prompt datasets: loading and validation. The prompt path goes on in `rl_core/prompt_encoding.py`
(a row's prompt to token ids) and `rl_core/rollout/prompts.py` (seeded, resumable batches).

A prompt is plain text, or a chat (a list of `{role, content}` messages) rendered with the
tokenizer's own chat template; the prompt column is named by the caller or found among
`messages`, `prompt`, `text`. Every other column of a row travels with the prompt (e.g. an
`answer` for a reward function). A malformed row stops the load with its file and line, or is
skipped and counted (`on_malformed`).

Images (vision-language models): a row shows images through an `images` column (a path, a data URL, bytes, a
`datasets` Image, or a list of them; a relative path is relative to the prompt file) and/or chat messages whose
content is a list of parts, `{"type": "image"}` (the next image of `images`) or `{"type": "image", "image": path}`,
and `{"type": "text", "text": ...}`. Images without any image part go before the first user message's text.
Every image is read at load: an unreadable or missing one is a malformed row, named with the image.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

from rl_core.data_files import DataSource, read_table
from rl_core.errors import UserError

MALFORMED_POLICIES = ("error", "skip")
LONG_PROMPT_POLICIES = ("skip", "error", "truncate")
PROMPT_KEYS = ("messages", "prompt", "text")  # looked for in this order when no key is given
IMAGES_KEY = "images"

logger = logging.getLogger(__name__)


class PromptDataError(UserError, ValueError):
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
    """Valid prompt rows (every row has a non-empty string or message list under `text_key`).

    Attributes:
        rows: The rows, a `datasets.Dataset`; each a dict of every column.
        source: The file or hub name they came from, for messages.
        text_key: The prompt's column: a string (plain text) or a list of `{role, content}` messages (a chat).
        skipped: Malformed rows dropped when loaded with `on_malformed="skip"`.
    """

    rows: Any  # datasets.Dataset
    source: str
    text_key: str = "text"
    skipped: int = 0  # malformed rows dropped when loaded with on_malformed="skip"
    image_dir: str | None = None  # what a relative image path is relative to: the prompt file's folder

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
    skipped = 0

    def read_json_by_hand(path: Path, error: Exception):  # names the bad line, or skips it
        nonlocal skipped
        rows, skipped = _load_json_by_hand(path, text_key, on_malformed, error, keys)
        return rows

    rows, source = read_table(DataSource(str(path_or_name), keys.path, "prompt file", "'tiny' for the offline prompts",
                                         split, hub_config, PromptDataError), on_parse_error=read_json_by_hand)
    if text_key is None:
        text_key = _resolve_key(rows.column_names, source, keys)
    image_dir = str(Path(source).expanduser().parent) if Path(source).expanduser().is_file() else None
    dataset, dropped = _validate_rows(rows, source, text_key, on_malformed, keys, image_dir)
    dataset = PromptDataset(dataset, source, text_key, skipped + dropped, image_dir)
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


def _row_problem(value: Any, text_key: str) -> str | None:
    if value is None:
        return f"missing '{text_key}'"
    if isinstance(value, list) and value:  # a chat: [{role, content}, ...], content a string or a list of parts
        for message in value:
            if not isinstance(message, dict) or not isinstance(message.get("role"), str) \
                    or not (isinstance(message.get("content"), str) or _parts(message.get("content"))):
                return (f"'{text_key}' is a list but not of {{'role': str, 'content': str or [{{'type': ...}}, ...]}} "
                        "messages")
        return None
    if not isinstance(value, str):
        return f"'{text_key}' is a {type(value).__name__}, not a string or a list of chat messages"
    if not value.strip():
        return f"'{text_key}' is empty"
    return None


def _parts(content: Any) -> bool:
    """A message content that is a list of typed parts (`{"type": "text" | "image", ...}`)."""
    return isinstance(content, list) and bool(content) and all(
        isinstance(part, dict) and isinstance(part.get("type"), str) for part in content)


def _is_image_part(part: dict) -> bool:
    return part.get("type") in ("image", "image_url")


def _own_source(part: dict) -> Any:
    """An image part's own image (transformers: `image`, `url`, `path`; OpenAI: `image_url.url`), or None."""
    for key in ("image", "url", "path"):
        if part.get(key) is not None:
            return part[key]
    url = part.get("image_url")
    return url.get("url") if isinstance(url, dict) else url


def prompt_images(row: dict, text_key: str, image_dir: str | None = None) -> list:
    """The images a row shows, in the order the prompt shows them (see the module docstring); a ValueError
    when its image parts and its `images` column disagree."""
    column = row.get(IMAGES_KEY)
    column = [] if column is None else list(column) if isinstance(column, (list, tuple)) else [column]
    prompt = row.get(text_key)
    parts = [part for message in (prompt if isinstance(prompt, list) else [])
             if _parts(message.get("content")) for part in message["content"] if _is_image_part(part)]
    if not parts:
        images = column
    else:
        placeholders = sum(_own_source(part) is None for part in parts)
        if placeholders != len(column):
            raise ValueError(f"its messages have {placeholders} image parts without an image of their own but its "
                             f"'{IMAGES_KEY}' field has {len(column)} images; give each such part one image")
        rest = iter(column)
        images = [next(rest) if _own_source(part) is None else _own_source(part) for part in parts]
    return [_resolved(image, image_dir) for image in images]


def _resolved(image: Any, image_dir: str | None) -> Any:
    """A `datasets` Image cell undecoded (`{"bytes", "path"}`) as its bytes or path; a relative path that is
    not there from here, relative to `image_dir`."""
    if isinstance(image, dict):
        image = image.get("bytes") or image.get("path")
    if isinstance(image, str) and not image.startswith("data:") and image_dir is not None:
        path = Path(image).expanduser()
        if not path.is_absolute() and not path.exists():
            return str(Path(image_dir) / path)
    return image


def _image_problem(row: dict, text_key: str, image_dir: str | None) -> str | None:
    """Why a row's images cannot be shown (one line, naming the image), or None."""
    from workers.vision import load_images

    try:
        load_images(prompt_images(row, text_key, image_dir))
    except ValueError as error:
        return " ".join(str(error).split())
    return None


def _validate_rows(rows, source: str, text_key: str, on_malformed: str, keys: "ConfigKeys",
                   image_dir: str | None = None):
    """Keep rows whose `text_key` is a non-empty string (and whose images read); error on the first bad one
    unless skipping (a row skipped for its images says so, one line)."""
    if len(rows) == 0:
        return rows, 0
    if text_key not in rows.column_names:
        raise PromptDataError(f"{source} has no '{text_key}' field in any row (fields: "
                              f"{rows.column_names}); set {keys.text_key} to one of them")
    keep = []
    images = IMAGES_KEY in rows.column_names or any(
        isinstance(value, list) and any(_parts(m.get("content")) for m in value if isinstance(m, dict))
        for value in rows[text_key])
    for index, value in enumerate(rows[text_key]):
        problem = _row_problem(value, text_key)
        if problem is None and images and (problem := _image_problem(rows[index], text_key, image_dir)) is not None:
            line = f"{source}, row {index + 1}: {problem}"
            if on_malformed == "error":
                raise PromptDataError(f"{line}; fix or remove the image{keys.skip_hint}")
            logger.warning("%s; row skipped (%s=skip)", line, keys.on_malformed)
        elif problem is None:
            keep.append(index)
        elif on_malformed == "error":
            raise PromptDataError(f"{source}, row {index + 1}: {problem}; give every row a "
                                  f"non-empty string '{text_key}'{keys.skip_hint}")
    if len(keep) == len(rows):
        return rows, 0
    return rows.select(keep), len(rows) - len(keep)
