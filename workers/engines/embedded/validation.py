"""`/generate` bodies of the embedded engine: SGLang's fields, defaults and 400 answers.

Every field is checked here (type, range, NaN and infinities) before a request can reach the
decode batch: rows of many clients are decoded together, so one malformed request (a NaN
temperature, a string where a number belongs, `true` as a token id) must get its own 400
naming the field and never fail the requests batched with it. Limits on `n`, on the prompts
of one call and on the body size keep one call from monopolising the engine.

Defaults follow SGLang 0.5.23 (`sampling/sampling_params.py`, `managers/scheduler.py`): an
absent `max_new_tokens` means 128, clamped to what the context leaves; `null` means up to
the context limit; an explicit number that does not fit the context is a 400.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

from workers.engines.client import INPUT_RESERVE, max_input_length, max_output_length
from workers.engines.embedded.batch import SamplingParams

DEFAULT_MAX_NEW_TOKENS = 128  # SGLang's default when the field is absent
MAX_N = 256  # samples per prompt
MAX_ROWS = 4096  # prompts x n in one call
MAX_BODY_BYTES = 32 << 20  # bigger bodies get 413 before they are read (aiohttp client_max_size)

# Sampling keys SGLang 0.5.23 knows, with the value meaning "feature off" for those we do not implement.
IMPLEMENTED_SAMPLING_KEYS = {f.name for f in dataclasses.fields(SamplingParams)}
NEUTRAL_SAMPLING_VALUES = {
    "min_p": 0.0, "frequency_penalty": 0.0, "presence_penalty": 0.0, "repetition_penalty": 1.0,
    "min_new_tokens": 0, "stop": None, "stop_regex": None, "json_schema": None, "regex": None,
    "ebnf": None, "structural_tag": None, "custom_params": None, "logit_bias": None,
}
IGNORED_SAMPLING_KEYS = {"no_stop_trim", "spaces_between_special_tokens", "stream_interval"}
KNOWN_SAMPLING_KEYS = IMPLEMENTED_SAMPLING_KEYS | set(NEUTRAL_SAMPLING_VALUES) | IGNORED_SAMPLING_KEYS


class BadRequest(ValueError):
    """The request is malformed; answered with 400 {"error": {"message"}}."""


def _shown(value: Any) -> str:
    """A value for an error message, cut short (a bad field may be megabytes long)."""
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _integer(value: Any, name: str, low: int | None = None, high: int | None = None) -> int:
    # bool is an int subclass in Python, but `true` is not a count or a token id.
    if isinstance(value, bool) or not isinstance(value, int):
        raise BadRequest(f"{name} must be an integer, got {_shown(value)}")
    if (low is not None and value < low) or (high is not None and value > high):
        bounds = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise BadRequest(f"{name} must be {bounds}, got {value}")
    return value


def _real(value: Any, name: str, ok, rule: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise BadRequest(f"{name} must be a number, got {_shown(value)}")
    value = float(value)
    if not math.isfinite(value) or not ok(value):  # NaN fails every comparison: test finiteness first
        raise BadRequest(f"{name} must be a finite number {rule}, got {value!r}")
    return value


def _boolean(value: Any, name: str) -> bool:
    if not isinstance(value, bool):
        raise BadRequest(f"{name} must be true or false, got {_shown(value)}")
    return value


def _token_ids(value: Any, name: str, vocab_size: int, allow_empty: bool) -> list[int]:
    if not isinstance(value, list) or (not value and not allow_empty):
        raise BadRequest(f"{name} must be a {'' if allow_empty else 'non-empty '}list of token ids, got {_shown(value)}")
    for index, token in enumerate(value):
        if isinstance(token, bool) or not isinstance(token, int) or not 0 <= token < vocab_size:
            raise BadRequest(f"{name}[{index}] must be a token id in [0, {vocab_size}), got {_shown(token)}")
    return value


@dataclasses.dataclass
class Sampling:
    """One prompt's sampling parameters; `length_given`: max_new_tokens was sent as a number."""

    params: SamplingParams
    length_given: bool


def parse_sampling_params(raw: Any, vocab_size: int, name: str = "sampling_params") -> Sampling:
    """SGLang's sampling parameters, every field checked; unknown keys are a 400 as in SGLang 0.5.23."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise BadRequest(f"{name} must be an object, got {_shown(raw)}")
    unknown = sorted(set(raw) - KNOWN_SAMPLING_KEYS)
    if unknown:
        raise BadRequest(f"unknown {name} keys {unknown}; allowed keys: {sorted(KNOWN_SAMPLING_KEYS)}")
    for key, neutral in NEUTRAL_SAMPLING_VALUES.items():
        value = raw.get(key, neutral)
        if value not in (neutral, None) and value != [] and value != "":
            raise BadRequest(f"{name}.{key}={_shown(value)} is not supported by the embedded engine; "
                             f"leave it at {neutral!r}")
    params = SamplingParams()
    length_given = False
    if "max_new_tokens" in raw:
        value = raw["max_new_tokens"]
        params.max_new_tokens = None if value is None else _integer(value, f"{name}.max_new_tokens", 0)
        length_given = value is not None
    else:
        params.max_new_tokens = DEFAULT_MAX_NEW_TOKENS
    if raw.get("temperature") is not None:
        params.temperature = _real(raw["temperature"], f"{name}.temperature", lambda v: v >= 0, ">= 0")
    if raw.get("top_p") is not None:
        params.top_p = _real(raw["top_p"], f"{name}.top_p", lambda v: 0 < v <= 1, "in (0, 1]")
    if raw.get("top_k") is not None:
        params.top_k = _integer(raw["top_k"], f"{name}.top_k", -1)
        if params.top_k == 0:
            raise BadRequest(f"{name}.top_k must be -1 (off) or at least 1, got 0")
    if raw.get("n") is not None:
        params.n = _integer(raw["n"], f"{name}.n", 1, MAX_N)
    for key in ("ignore_eos", "skip_special_tokens"):
        if raw.get(key) is not None:
            setattr(params, key, _boolean(raw[key], f"{name}.{key}"))
    if raw.get("stop_token_ids") is not None:
        params.stop_token_ids = tuple(_token_ids(raw["stop_token_ids"], f"{name}.stop_token_ids", vocab_size,
                                                 allow_empty=True))
    if raw.get("sampling_seed") is not None:
        params.sampling_seed = _integer(raw["sampling_seed"], f"{name}.sampling_seed", 0)
    return Sampling(params, length_given)


@dataclasses.dataclass
class GenerateBody:
    """A checked /generate body: prompts as token ids (or texts still to tokenize) and their settings."""

    input_ids: list[list[int]] | None
    texts: list[str] | None
    is_batch: bool
    sampling: list[Sampling]  # one per prompt
    n: int
    rids: list[str]  # one per row (prompt x n)
    return_logprob: bool
    logprob_start_len: int
    images: list[list[str]] | None = None  # per prompt, its image_data entries (one per image pad)

    @property
    def num_prompts(self) -> int:
        return len(self.input_ids if self.input_ids is not None else self.texts)


def parse_generate(body: Any, vocab_size: int) -> GenerateBody:
    """Check a /generate body (already JSON-decoded) field by field; raise BadRequest naming the field."""
    if not isinstance(body, dict):
        raise BadRequest(f"the request body must be a JSON object with input_ids or text, got {type(body).__name__}")
    if body.get("stream") is not None and _boolean(body["stream"], "stream"):
        raise BadRequest("stream=true is not supported by the embedded engine")
    input_ids, texts, is_batch = _parse_prompts(body, vocab_size)
    count = len(input_ids if input_ids is not None else texts)
    raw = body.get("sampling_params")
    if isinstance(raw, list):  # SGLang: one dict per prompt of a batch
        if len(raw) != count:
            raise BadRequest(f"sampling_params has {len(raw)} entries for {count} prompts")
        sampling = [parse_sampling_params(entry, vocab_size, f"sampling_params[{i}]") for i, entry in enumerate(raw)]
    else:
        sampling = [parse_sampling_params(raw, vocab_size)] * count
    n = sampling[0].params.n
    if any(s.params.n != n for s in sampling):
        raise BadRequest("sampling_params.n must be the same for every prompt of a batch")
    if count * n > MAX_ROWS:
        raise BadRequest(f"{count} prompts x n={n} is {count * n} sequences; one call may ask for at most "
                         f"{MAX_ROWS}: split it")
    return_logprob = body.get("return_logprob")
    return_logprob = False if return_logprob is None else _boolean(return_logprob, "return_logprob")
    start = body.get("logprob_start_len")
    start = -1 if start is None else _integer(start, "logprob_start_len", -1)
    return GenerateBody(input_ids, texts, is_batch, sampling, n, _rids(body.get("rid"), count, is_batch, n),
                        return_logprob, start, _images(body.get("image_data"), count, is_batch))


def _images(raw: Any, count: int, is_batch: bool) -> list[list[str]] | None:
    """`image_data` per prompt, as SGLang 0.5.23 reads it (io_struct.GenerateReqInput): one image for every
    prompt; for one prompt, its image or list of images; for a batch, one entry (an image or a list) per prompt."""
    if raw is None or raw == []:
        return None
    if not isinstance(raw, list):
        per_prompt = [[raw]] * count
    elif not is_batch:
        per_prompt = [raw]
    elif len(raw) != count:
        raise BadRequest(f"image_data has {len(raw)} entries for {count} prompts; send one (a list of images, "
                         "or none) per prompt")
    else:
        per_prompt = [[] if entry is None else entry if isinstance(entry, list) else [entry] for entry in raw]
    for which, entries in enumerate(per_prompt):
        for index, entry in enumerate(entries):
            if not isinstance(entry, str) or not entry:
                where = f"image_data[{which}][{index}]" if is_batch else f"image_data[{index}]"
                raise BadRequest(f"{where} must be a path, a data URL or a base64 string, got {_shown(entry)}")
    return per_prompt if any(per_prompt) else None


def _parse_prompts(body: dict, vocab_size: int) -> tuple[list[list[int]] | None, list[str] | None, bool]:
    text, ids = body.get("text"), body.get("input_ids")
    if text is not None:  # SGLang: text wins when both are sent
        if isinstance(text, str):
            return None, [text], False
        if isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            _check_count(len(text))
            return None, text, True
        raise BadRequest(f"text must be a string or a non-empty list of strings, got {_shown(text)}")
    if ids is None:
        raise BadRequest("send either input_ids (list[int] or list[list[int]]) or text")
    if not isinstance(ids, list) or not ids:
        raise BadRequest(f"input_ids must be a non-empty list of token ids or a list of such lists, got {_shown(ids)}")
    is_batch = isinstance(ids[0], list)
    if is_batch:
        _check_count(len(ids))
        return [_token_ids(row, f"input_ids[{i}]", vocab_size, allow_empty=False) for i, row in enumerate(ids)], \
            None, True
    return [_token_ids(ids, "input_ids", vocab_size, allow_empty=False)], None, False


def _check_count(count: int) -> None:
    if count > MAX_ROWS:
        raise BadRequest(f"{count} prompts in one call; at most {MAX_ROWS} are accepted: split the batch")


def _rids(rid: Any, num_prompts: int, is_batch: bool, n: int) -> list[str]:
    import uuid

    total = num_prompts * n
    if rid is not None and not isinstance(rid, str) and not (
            isinstance(rid, list) and all(isinstance(r, str) for r in rid)):
        raise BadRequest(f"rid must be a string or a list of strings, got {_shown(rid)}")
    if n > 1 or rid is None:  # SGLang replaces caller rids when n > 1
        return [uuid.uuid4().hex for _ in range(total)]
    if isinstance(rid, list):
        if len(rid) != num_prompts:
            raise BadRequest(f"rid list has {len(rid)} entries for {num_prompts} prompts")
        return list(rid)
    return [f"{rid}_{i}" for i in range(total)] if is_batch else [rid]


def fit_to_context(sampling: Sampling, prompt_len: int, context_len: int, row: str = "prompt") -> SamplingParams:
    """The row's parameters with max_new_tokens resolved against the context (SGLang's rules, in its order)."""
    params = dataclasses.replace(sampling.params)
    room = context_len - prompt_len
    if room < 0:
        raise BadRequest(f"{row} of {prompt_len} tokens exceeds the model's context length {context_len}")
    if sampling.length_given and params.max_new_tokens > room:
        raise BadRequest(f"{row} of {prompt_len} tokens + max_new_tokens {params.max_new_tokens} "
                         f"exceeds the model's context length {context_len}")
    if prompt_len > max_input_length(context_len):  # SGLang's own words, so callers match one message
        raise BadRequest(f"Input length ({prompt_len} tokens) exceeds the maximum allowed length "
                         f"({context_len - INPUT_RESERVE} tokens). Use a shorter input or enable --allow-auto-truncate.")
    most = max_output_length(context_len, prompt_len)
    # Absent: SGLang's default of 128; null: no limit of its own; either way, and a number too, cut at `most`.
    params.max_new_tokens = most if params.max_new_tokens is None else min(params.max_new_tokens, most)
    return params


def longest_token_chars(tokenizer) -> int:
    """An upper bound on the characters one token covers (for rejecting over-long texts untokenized)."""
    return max((len(token) for token in tokenizer.get_vocab()), default=1)
