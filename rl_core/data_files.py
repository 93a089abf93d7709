"""A job's data file, read the same way for every job: a local .jsonl, .json, .csv or .parquet file, or
a dataset on the Hugging Face hub, through `datasets`.

What can be wrong with the file itself (missing, an unknown extension, not UTF-8, empty, unparseable, a
hub dataset out of reach) ends the job here with one line naming the file and the config key that set
it. What the rows must hold, each job checks itself: prompts in `rl_core/data.py`, SFT rows in
`rl_core/sft/data.py`, comparisons in `rl_core/preferences.py`.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

READERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet"}  # suffix -> datasets builder


@dataclass(frozen=True)
class DataSource:
    """Where a job's rows come from.

    `path`: a local file, or a hub dataset's name (`split` and `hub_config` apply to those; a local
    file is one split). `key`: the config key that set it, named in every error line. `what`: the
    file's role in those lines ("prompt file"). `hint`: what else the key may be set to ("'tiny' for
    the offline prompts"). `error`: the job's exception type for those lines."""

    path: str
    key: str
    what: str = "data file"
    hint: str = ""
    split: str = "train"
    hub_config: str | None = None
    error: type[Exception] = ValueError

    def fail(self, line: str) -> Exception:
        return self.error(line)


def looks_like_a_file(name: str) -> bool:
    """Whether `name` is meant as a local file (a known extension or a path prefix), not a hub dataset."""
    return Path(name).suffix.lower() in READERS or name.startswith((".", "/", "~"))


def read_table(source: DataSource, csv_as_text: bool = False,
               on_parse_error: Callable[[Path, Exception], object] | None = None):
    """`(datasets.Dataset, description)` of `source`: every row with its columns; the description is the
    file's path, or the hub name with its split.

    `csv_as_text`: CSV cells stay strings ('NA' is text, '007' keeps its zeros). `on_parse_error(path,
    error)`: what to do when `datasets` cannot parse a local JSON file (e.g. find the bad line and
    say which it is, or skip it); by default one line with the parser's message."""
    import datasets

    path = Path(source.path).expanduser()
    if not path.is_file():
        if looks_like_a_file(source.path):
            raise source.fail(f"{source.what} {path} does not exist (resolved to {path.resolve()}); check "
                              f"{source.key}" + (f", or set it to {source.hint}" if source.hint else ""))
        return _read_hub(source), f"{source.path} (hub, split {source.split})"
    builder = READERS.get(path.suffix.lower())
    if builder is None:
        raise source.fail(f"{path}: unsupported extension '{path.suffix}'; use one of {sorted(READERS)} "
                          f"({source.key})")
    if builder != "parquet":
        if (problem := utf8_problem(path)) is not None:
            raise source.fail(problem)
        if not path.read_text(encoding="utf-8").strip():
            raise source.fail(f"{path} is empty; add rows to it ({source.key})")
    options = {}
    if builder == "csv" and csv_as_text:
        options = {"features": datasets.Features({column: datasets.Value("string") for column in _csv_header(path)}),
                   "na_filter": False}
    try:
        return datasets.load_dataset(builder, data_files=str(path), split="train", **options), str(path)
    except Exception as error:  # noqa: BLE001 - datasets wraps parser errors in several types
        if builder == "json" and on_parse_error is not None:
            return on_parse_error(path, error), str(path)
        if builder == "csv" and _count_nonblank_lines(path) <= 1:
            raise source.fail(f"{path} has a header but no rows; add rows to it ({source.key})") from error
        raise source.fail(f"could not read {path} as {builder}: {error}; check that it is valid {builder} "
                          f"with one record per row") from error


def _read_hub(source: DataSource):
    import datasets

    try:
        return datasets.load_dataset(source.path, source.hub_config, split=source.split)
    except Exception as error:  # noqa: BLE001 - offline, unknown name, unknown split
        raise source.fail(
            f"'{source.path}' is not an existing local file, and loading it from the Hugging Face hub "
            f"failed ({type(error).__name__}: {error}); the hub may be unreachable (offline); "
            f"set {source.key} to a local {'/'.join(sorted(READERS))} path instead") from error


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


def _csv_header(path: Path) -> list[str]:
    import csv

    with open(path, newline="", encoding="utf-8") as handle:
        return next(csv.reader(handle), [])


def _count_nonblank_lines(path: Path) -> int:
    return sum(1 for line in path.read_text(encoding="utf-8").splitlines() if line.strip())
