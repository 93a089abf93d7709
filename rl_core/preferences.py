"""Preference data for reward-model and DPO training: three file formats, one normalised example.

Formats (columns), read from local jsonl / json / csv / parquet files or hub datasets (`rl_core/data_files.py`):

- ``pairwise``: ``prompt``, ``chosen``, ``rejected``.
- ``llama2``: ``prompt``, ``response_1``, ``response_2``, ``chosen_response`` (1 or 2), and
  optionally ``prefer_degree`` and the safety fields ``response_1_safe``, ``response_2_safe``
  (yes/no) and ``safer_response`` (1 or 2). The degree can set a margin in the Bradley-Terry
  loss (LLaMA-2, section 3.2.2); margins are off unless a ``margin_map`` is given.
- ``openai``: ``query``, ``sample0`` .. ``sample3`` and ``best`` (0-3), as in
  lm-human-preferences, where a labeler picks the best of four continuations.

Every format becomes a `PreferenceExample` whose ``best`` indexes ``responses``.
"""

from __future__ import annotations

import logging
import math
import re
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping, Sequence

from rl_core.data_files import DataSource, read_table
from rl_core.errors import PreferenceDataError

logger = logging.getLogger(__name__)

FORMATS = ("pairwise", "llama2", "openai")

PAIRWISE_COLUMNS = ("prompt", "chosen", "rejected")
LLAMA2_REQUIRED = ("prompt", "response_1", "response_2", "chosen_response")
LLAMA2_OPTIONAL = ("prefer_degree", "response_1_safe", "response_2_safe", "safer_response")
OPENAI_REQUIRED = ("query", "sample0", "sample1", "best")
SAMPLE_COLUMN = re.compile(r"^sample(\d+)$")

EXPECTED_COLUMNS = {
    "pairwise": "prompt, chosen, rejected",
    "llama2": "prompt, response_1, response_2, chosen_response "
              "[, prefer_degree, response_1_safe, response_2_safe, safer_response]",
    "openai": "query, sample0, sample1 [, sample2, sample3, ...], best",
}

NEGLIGIBLE = "negligibly better or unsure"
# LLaMA-2's "margin large" values (Touvron et al. 2023, table 28). Read-only on purpose.
DEFAULT_MARGIN_MAP: Mapping[str, float] = MappingProxyType({
    "significantly better": 3.0,
    "better": 2.0,
    "slightly better": 1.0,
    NEGLIGIBLE: 0.0,
})
_DEGREE_ALIASES = {"negligibly better/unsure": NEGLIGIBLE, "negligibly better": NEGLIGIBLE,
                   "unsure": NEGLIGIBLE}

MAX_ERRORS_SHOWN = 10


@dataclass
class PreferenceExample:
    """One comparison: ``responses[best]`` was preferred to the others for ``prompt``.

    ``margin`` is the Bradley-Terry margin (LLaMA-2 degree), 0 when margins are off.
    ``responses_safe`` / ``safer`` carry LLaMA-2 safety labels when the file has them
    (``safer`` is 0-based like ``best``).
    """

    prompt: str
    responses: list[str]
    best: int
    margin: float = 0.0
    responses_safe: tuple[bool | None, ...] | None = None
    safer: int | None = None


@dataclass
class TokenizedPreference:
    """Token ids of prompt+response for each response of one example."""

    input_ids: list[list[int]]
    prompt_length: int
    best: int
    margin: float


class _RowError(Exception):
    """A problem with one row; turned into a file/row message by the loader."""


# ----------------------------------------------------------------------------- format detection

def _distinctive_columns(fmt: str, columns: Sequence[str]) -> set[str]:
    """Columns that only the format `fmt` uses (``prompt`` is shared, so not distinctive)."""
    present = set(columns)
    if fmt == "pairwise":
        return present & {"chosen", "rejected"}
    if fmt == "llama2":
        return present & (set(LLAMA2_REQUIRED[1:]) | set(LLAMA2_OPTIONAL))
    return {c for c in present if c in ("query", "best") or SAMPLE_COLUMN.match(c)}


def _expected_columns_text() -> str:
    return "; ".join(f"{fmt}: {cols}" for fmt, cols in EXPECTED_COLUMNS.items())


def detect_format(columns: Sequence[str], source: str = "the file") -> str:
    """Pick the format whose columns the file has; error when none or several match."""
    hits = {fmt: _distinctive_columns(fmt, columns) for fmt in FORMATS}
    matched = [fmt for fmt, cols in hits.items() if cols]
    if len(matched) > 1:
        found = "; ".join(f"{fmt} ({', '.join(sorted(hits[fmt]))})" for fmt in matched)
        raise PreferenceDataError(
            f"{source} mixes columns of several preference formats: {found}. Use the columns "
            f"of exactly one format ({_expected_columns_text()}), or set format= explicitly."
        )
    if not matched:
        raise PreferenceDataError(
            f"{source} has columns {sorted(columns)}, which match no preference format. "
            f"Expected columns: {_expected_columns_text()}."
        )
    return matched[0]


def _check_required_columns(fmt: str, columns: Sequence[str], source: str) -> None:
    required = {"pairwise": PAIRWISE_COLUMNS, "llama2": LLAMA2_REQUIRED,
                "openai": OPENAI_REQUIRED}[fmt]
    missing = [c for c in required if c not in columns]
    if missing:
        raise PreferenceDataError(
            f"{source} is read as format '{fmt}' but lacks column(s) {missing}. "
            f"Expected columns for '{fmt}': {EXPECTED_COLUMNS[fmt]}."
        )
    if fmt == "openai":
        _sample_columns(columns, source)


def _sample_columns(columns: Sequence[str], source: str) -> list[str]:
    """The contiguous ``sample0..sampleK`` columns of an OpenAI-style file."""
    indices = sorted(int(m.group(1)) for c in columns if (m := SAMPLE_COLUMN.match(c)))
    if indices != list(range(len(indices))):
        raise PreferenceDataError(
            f"{source} has sample columns {['sample%d' % i for i in indices]}; they must run "
            f"without gaps from sample0 (e.g. sample0, sample1, sample2, sample3)."
        )
    return [f"sample{i}" for i in indices]


# ----------------------------------------------------------------------------- field parsing

def _text(row: Mapping[str, Any], column: str) -> str:
    value = row.get(column)
    if value is None:
        raise _RowError(f"'{column}' is missing; give it a non-empty string")
    if not isinstance(value, str):
        raise _RowError(f"'{column}' must be a string, got {type(value).__name__} {value!r}")
    if not value.strip():
        raise _RowError(f"'{column}' is empty; give it a non-empty string")
    return value


def _as_int(value: Any) -> int | None:
    """Integer value of an int, an integral float or a digit string (csv), else None."""
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    if isinstance(value, str) and value.strip().lstrip("-").isdigit():
        return int(value.strip())
    return None


def _choice(row: Mapping[str, Any], column: str, allowed: Sequence[int]) -> int:
    value = row.get(column)
    if value is None:
        raise _RowError(f"'{column}' is missing; it must be one of {list(allowed)}")
    number = _as_int(value)
    if number is None or number not in allowed:
        raise _RowError(f"'{column}' must be one of {list(allowed)}, got {value!r}")
    return number


def normalize_degree(degree: str) -> str:
    """Lower-case, single-spaced degree; 'unsure' spellings map to one key."""
    key = " ".join(degree.lower().split())
    return _DEGREE_ALIASES.get(key, key)


def _safe_flag(row: Mapping[str, Any], column: str) -> bool | None:
    value = row.get(column)
    if value is None or value == "":
        return None
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.strip().lower() in ("yes", "true", "no", "false"):
        return value.strip().lower() in ("yes", "true")
    raise _RowError(f"'{column}' must be 'yes' or 'no', got {value!r}")


def _degree_margin(row: Mapping[str, Any], margin_map: Mapping[str, float] | None) -> float:
    """Validate ``prefer_degree`` and return its margin (0 when margins are off)."""
    allowed = margin_map if margin_map is not None else DEFAULT_MARGIN_MAP
    value = row.get("prefer_degree")
    if value is None or value == "":
        if margin_map is not None:
            raise _RowError("'prefer_degree' is missing but margins are enabled; give one of "
                            f"{sorted(allowed)} or turn margins off")
        return 0.0
    if not isinstance(value, str) or normalize_degree(value) not in allowed:
        raise _RowError(f"'prefer_degree' {value!r} is unknown; use one of {sorted(allowed)}")
    return float(margin_map[normalize_degree(value)]) if margin_map is not None else 0.0


# ----------------------------------------------------------------------------- row parsers

def _parse_pairwise(row: Mapping[str, Any], margin_map: Mapping[str, float] | None):
    return PreferenceExample(prompt=_text(row, "prompt"),
                             responses=[_text(row, "chosen"), _text(row, "rejected")], best=0)


def _parse_llama2(row: Mapping[str, Any], margin_map: Mapping[str, float] | None):
    example = PreferenceExample(
        prompt=_text(row, "prompt"),
        responses=[_text(row, "response_1"), _text(row, "response_2")],
        best=_choice(row, "chosen_response", (1, 2)) - 1,
        margin=_degree_margin(row, margin_map),
    )
    safe = (_safe_flag(row, "response_1_safe"), _safe_flag(row, "response_2_safe"))
    if any(flag is not None for flag in safe):
        example.responses_safe = safe
    if row.get("safer_response") not in (None, ""):
        example.safer = _choice(row, "safer_response", (1, 2)) - 1
    return example


def _openai_parser(sample_columns: list[str]):
    def parse(row: Mapping[str, Any], margin_map: Mapping[str, float] | None):
        return PreferenceExample(
            prompt=_text(row, "query"),
            responses=[_text(row, c) for c in sample_columns],
            best=_choice(row, "best", range(len(sample_columns))),
        )
    return parse


# ----------------------------------------------------------------------------- file reading

def _row_labels(path: Path, n_rows: int) -> list[str]:
    """Human row references: jsonl rows also give their line (blank lines are skipped)."""
    if path.suffix.lower() != ".jsonl":
        return [f"row {i + 1}" for i in range(n_rows)]
    with open(path, encoding="utf-8") as handle:
        lines = [n + 1 for n, line in enumerate(handle) if line.strip()]
    if len(lines) != n_rows:
        return [f"row {i + 1}" for i in range(n_rows)]
    return [f"row {i + 1} (line {line})" for i, line in enumerate(lines)]


def _check_margin_map(margin_map: Mapping[str, float] | None) -> dict[str, float] | None:
    if margin_map is None:
        return None
    checked = {}
    for degree, margin in margin_map.items():
        if not isinstance(margin, (int, float)) or isinstance(margin, bool) \
                or not math.isfinite(margin):
            raise PreferenceDataError(
                f"margin_map[{degree!r}] = {margin!r} must be a finite number")
        checked[normalize_degree(str(degree))] = float(margin)
    return checked


def load_preference_dataset(
    path: str | Path,
    format: str = "auto",
    margin_map: Mapping[str, float] | None = None,
    on_malformed: str = "error",
    key: str = "data.train_path",
) -> tuple[list[PreferenceExample], int]:
    """Load and validate a preference file (or hub dataset); return ``(examples, n_skipped)``.

    ``format``: "auto" (from the columns), "pairwise", "llama2" or "openai".
    ``margin_map``: prefer_degree -> margin; None keeps margins at 0 (e.g. pass
    `DEFAULT_MARGIN_MAP` to enable LLaMA-2 margins). ``on_malformed``: "error" raises one
    error listing each bad row with its file and 1-based row; "skip" drops them and counts.
    ``key``: the config key that named the file, in the lines about the file itself.
    """
    path = Path(path)
    if format != "auto" and format not in FORMATS:
        raise PreferenceDataError(f"format={format!r} is unknown; use 'auto' or one of {FORMATS}")
    if on_malformed not in ("error", "skip"):
        raise PreferenceDataError(
            f"on_malformed={on_malformed!r} is unknown; use 'error' or 'skip'")
    margins = _check_margin_map(margin_map)
    # CSV cells stay strings: 'NA' is text, and a degree or choice is read by the parsers below.
    table, _ = read_table(DataSource(str(path), key, "preference file", "'tiny' for the offline preferences",
                                     error=PreferenceDataError), csv_as_text=True)
    rows = table.to_list()
    if not rows:
        raise PreferenceDataError(f"{path} has no rows; give at least one comparison")
    columns = list(rows[0].keys())
    fmt = detect_format(columns, str(path)) if format == "auto" else format
    _check_required_columns(fmt, columns, str(path))
    parse: Callable = {"pairwise": _parse_pairwise, "llama2": _parse_llama2}.get(fmt) \
        or _openai_parser(_sample_columns(columns, str(path)))

    examples, problems = [], []
    for label, row in zip(_row_labels(path, len(rows)), rows):
        try:
            examples.append(parse(row, margins))
        except _RowError as exc:
            problems.append(f"{path}: {label}: {exc}")
    _report_problems(problems, on_malformed, path, n_rows=len(rows))
    return examples, len(problems)


def _report_problems(problems: list[str], on_malformed: str, path: Path, n_rows: int) -> None:
    if not problems:
        return
    shown = "\n  ".join(problems[:MAX_ERRORS_SHOWN])
    more = f"\n  ... and {len(problems) - MAX_ERRORS_SHOWN} more" \
        if len(problems) > MAX_ERRORS_SHOWN else ""
    if on_malformed == "error":
        raise PreferenceDataError(
            f"{len(problems)} malformed row(s) in {path}:\n  {shown}{more}\n"
            f"Fix these rows, or set data.on_malformed=skip to drop them."
        )
    if len(problems) == n_rows:
        raise PreferenceDataError(f"every row of {path} is malformed:\n  {shown}{more}")
    logger.warning("skipped %d malformed row(s) of %d in %s:\n  %s%s",
                   len(problems), n_rows, path, shown, more)


# ----------------------------------------------------------------------------- tokenization

def tokenize_preferences(
    examples: Sequence[PreferenceExample], tokenizer, max_length: int
) -> list[TokenizedPreference]:
    """Token ids of prompt+response per response, truncating responses to fit ``max_length``.

    Prompt and responses are tokenized separately and their ids concatenated: tokenizing
    the joined text can merge tokens across the boundary, and the reward model must read the
    same ids the policy produced (design invariant "tokens, never text").
    """
    if max_length < 2:
        raise ValueError(f"max_length={max_length} must be at least 2 (a prompt token and a "
                         f"response token)")
    prompt_ids = _encode(tokenizer, [ex.prompt for ex in examples])
    response_ids = iter(_encode(tokenizer, [r for ex in examples for r in ex.responses]))
    rows = []
    for index, (example, prompt) in enumerate(zip(examples, prompt_ids)):
        if len(prompt) >= max_length:
            raise ValueError(
                f"example {index}: the prompt alone is {len(prompt)} tokens, leaving no room "
                f"for a response within max_length={max_length}; raise max_length or shorten "
                f"the prompt"
            )
        room = max_length - len(prompt)
        sequences = [prompt + next(response_ids)[:room] for _ in example.responses]
        rows.append(TokenizedPreference(sequences, len(prompt), example.best, example.margin))
    return rows


def _encode(tokenizer, texts: list[str]) -> list[list[int]]:
    if not texts:
        return []
    return tokenizer(texts, add_special_tokens=False)["input_ids"]


def load_preference_splits(cfg, train_path: str, test_path: str | None, tokenizer,
                           seed: int) -> tuple[list, list]:
    """Tokenized train and held-out comparisons; without a test file, a seeded split of train.

    `cfg`: a job's data section (`format`, `margin_map`, `on_malformed`, `max_length`, `heldout_fraction`)."""
    def load(path: str, key: str) -> list:
        examples, _ = load_preference_dataset(path, cfg.format, cfg.margin_map, cfg.on_malformed, key)
        return tokenize_preferences(examples, tokenizer, cfg.max_length)

    import torch

    train = load(train_path, "data.train_path")
    if test_path is not None:
        return train, load(test_path, "data.test_path")
    order = torch.randperm(len(train), generator=torch.Generator().manual_seed(seed)).tolist()
    n_test = max(1, round(len(train) * cfg.heldout_fraction))
    if n_test >= len(train):
        raise ValueError(f"{train_path} has {len(train)} comparisons, too few to hold out "
                         f"data.heldout_fraction={cfg.heldout_fraction}; give data.test_path")
    return [train[i] for i in order[n_test:]], [train[i] for i in order[:n_test]]
