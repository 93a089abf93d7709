"""SFT rows as token ids with a loss mask: chat `messages` (the loss on assistant turns) or a
prompt and a response (the loss on the response).

Each piece is tokenized on its own and the ids concatenated, the way the RL jobs see a prompt and
the engine's response, so what SFT trains is exactly what a later RL run samples and scores.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rl_core.data_files import DataSource, read_table
from rl_core.errors import JobError


class SFTDataError(JobError):
    """A data file or row the job cannot use; the message names the file, the row and the fix."""


@dataclass
class SFTExample:
    input_ids: list[int]
    loss_mask: list[int]  # 1: the token is trained (predicted from the tokens before it)
    row: dict  # the source row (its other columns: e.g. a reference answer for evaluation)

    @property
    def prompt_length(self) -> int:
        """Tokens before the first trained one: what generation starts from."""
        return self.loss_mask.index(1)


def load_rows(path_or_name: str, key: str) -> list[dict]:
    """Rows of a local .jsonl/.json/.csv/.parquet file, or of a hub dataset's train split; `key`, the config
    key that named it, is in every error line."""
    # CSV cells stay strings: a response "2" is text to train on, not a number.
    table, _ = read_table(DataSource(path_or_name, key, "SFT data file", error=SFTDataError), csv_as_text=True)
    return [dict(row) for row in table]


def detect_format(row: dict, cfg) -> str:
    if cfg.format != "auto":
        return cfg.format
    if cfg.messages_key in row:
        return "messages"
    if cfg.prompt_key in row and cfg.response_key in row:
        return "prompt_response"
    raise SFTDataError(f"cannot tell the SFT format of a row with columns {sorted(row)}: expected "
                       f"'{cfg.messages_key}' (chat) or '{cfg.prompt_key}' and '{cfg.response_key}'; "
                       "set data.format and the data.*_key names")


def _tokens(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def _render(tokenizer, messages: list[dict], generation_prompt: bool, template_kwargs: dict | None) -> str:
    return tokenizer.apply_chat_template(messages, add_generation_prompt=generation_prompt, tokenize=False,
                                         **(template_kwargs or {}))


def encode_messages(tokenizer, messages: list[dict], template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """Ids and loss mask of a conversation: each assistant turn as the template renders it after the
    generation prompt (its end-of-turn tokens included) is trained; everything else is context."""
    if not getattr(tokenizer, "chat_template", None):
        raise SFTDataError("the tokenizer has no chat template for 'messages' rows; set model.tokenizer_path to "
                           "one that has, or give prompt/response rows")
    if not any(m.get("role") == "assistant" for m in messages):
        raise SFTDataError("a conversation has no assistant turn to train on")
    ids: list[int] = []
    mask: list[int] = []
    rendered = ""
    for k, message in enumerate(messages):
        if message.get("role") == "assistant":
            prompt = _render(tokenizer, messages[:k], generation_prompt=True, template_kwargs=template_kwargs)
            full = _render(tokenizer, messages[:k + 1], generation_prompt=False, template_kwargs=template_kwargs)
            pieces = [(rendered, prompt, 0), (prompt, full, 1)]
        else:
            full = _render(tokenizer, messages[:k + 1], generation_prompt=False, template_kwargs=template_kwargs)
            pieces = [(rendered, full, 0)]
        for before, after, trained in pieces:
            if not after.startswith(before):
                raise SFTDataError(f"the chat template renders turn {k} differently from the conversation before "
                                   "it; give prompt/response rows instead")
            segment = _tokens(tokenizer, after[len(before):])
            ids += segment
            mask += [trained] * len(segment)
        rendered = full
    return ids, mask


def encode_prompt_response(tokenizer, prompt: Any, response: str,
                           template_kwargs: dict | None = None) -> tuple[list[int], list[int]]:
    """A prompt (text, or messages rendered with the generation prompt) and a response that ends with EOS."""
    if isinstance(prompt, list):
        prompt = _render(tokenizer, prompt, generation_prompt=True, template_kwargs=template_kwargs)
    prompt_ids, response_ids = _tokens(tokenizer, prompt), _tokens(tokenizer, response)
    if not response_ids or response_ids[-1] != tokenizer.eos_token_id:
        response_ids.append(tokenizer.eos_token_id)
    return prompt_ids + response_ids, [0] * len(prompt_ids) + [1] * len(response_ids)


def encode_rows(rows: list[dict], tokenizer, cfg, source: str) -> tuple[list[SFTExample], int]:
    """Every usable row as an SFTExample; returns (examples, rows left out as too long)."""
    if not rows:
        raise SFTDataError(f"{source} has no rows")
    kind = detect_format(rows[0], cfg)
    examples, too_long = [], 0
    for number, row in enumerate(rows, start=1):
        try:
            if kind == "messages":
                ids, mask = encode_messages(tokenizer, row[cfg.messages_key], cfg.chat_template_kwargs)
            else:
                ids, mask = encode_prompt_response(tokenizer, row[cfg.prompt_key], row[cfg.response_key],
                                                   cfg.chat_template_kwargs)
        except (KeyError, TypeError, AttributeError) as err:
            raise SFTDataError(f"{source} row {number} is not a {kind} row ({type(err).__name__}: {err}); "
                               f"columns: {sorted(row)}") from err
        except SFTDataError as err:
            raise SFTDataError(f"{source} row {number}: {err}") from err
        if len(ids) > cfg.max_length:
            too_long += 1
            if cfg.on_long == "drop":
                continue
            ids, mask = ids[:cfg.max_length], mask[:cfg.max_length]
        if 1 in mask[1:]:  # the first token is never predicted
            examples.append(SFTExample(ids, mask, row))
    if not examples:
        raise SFTDataError(f"{source}: no row fits data.max_length={cfg.max_length} with a trained token "
                           f"({too_long} too long); raise data.max_length or set data.on_long=truncate")
    return examples, too_long
