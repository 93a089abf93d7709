"""A prompt (text or chat messages) to its token ids: the chat template, the explicit length rule, and
OpenAI's fixed-length query mode.

Prompt length is explicit (`PromptEncoder`): a prompt longer than `max_length` is skipped and counted, or
refused, never silently cut, except in OpenAI's fixed-length query mode (`QueryProcessor`), which cuts by
design.
"""

from __future__ import annotations

from typing import Any

from rl_core.data import LONG_PROMPT_POLICIES, PromptDataError, PromptDataset, prompt_images


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

    def messages(self, prompt: str | list, images: int = 0) -> list[dict] | None:
        """The chat to render, or None for a prompt used as plain text. A prompt showing `images` images is
        a chat whose image parts are each `{"type": "image"}` (the template renders one image pad each)."""
        if isinstance(prompt, list):
            if self.chat_template is False:
                raise PromptDataError("a prompt is a list of chat messages but data.apply_chat_template=false; "
                                      "set it to true (or null) or give plain-text prompts")
            messages = [dict(m, content=_parts(m["content"])) for m in prompt]
        elif self.chat_template or (images and self.chat_template is None):
            messages = [{"role": "user", "content": prompt}]
        elif images:
            raise PromptDataError("a prompt shows images but data.apply_chat_template=false; images are placed "
                                  "by the chat template: set it to true (or null)")
        else:
            return None
        if images and not any(isinstance(m["content"], list) and any(p["type"] == "image" for p in m["content"])
                              for m in messages):  # images without image parts: before the first user text
            user = next(m for m in messages if m["role"] == "user")
            text = user["content"] if isinstance(user["content"], list) else [{"type": "text", "text": user["content"]}]
            user["content"] = [{"type": "image"}] * images + text
        if self.system_prompt is not None and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return messages

    def render(self, prompt: str | list, images: int = 0) -> str:
        """The prompt as the model will read it (the chat template applied when it is a chat)."""
        messages = self.messages(prompt, images)
        if messages is None:
            return prompt
        if not getattr(self.tokenizer, "chat_template", None):
            raise PromptDataError(f"the tokenizer ({getattr(self.tokenizer, 'name_or_path', '?')}) has no chat template "
                                  "but the prompts are chats; use a chat model's tokenizer (model.tokenizer_path) "
                                  "or set data.apply_chat_template=false with plain-text prompts")
        return self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,
                                                  **self.template_kwargs)

    def __call__(self, prompt: str | list, images: int = 0) -> list[int] | None:
        """The prompt's ids; one image pad per image where it shows `images` images (the engine's ids), so
        `data.max_prompt_length` counts each image as one token."""
        messages = self.messages(prompt, images)
        if messages is None and self.on_long == "truncate" and self.query_processor is not None:
            return self.query_processor(prompt)
        # A rendered chat carries its own special tokens; plain text gets the tokenizer's usual ones (BOS).
        ids = self.tokenizer(self.render(prompt, images), add_special_tokens=messages is None)["input_ids"]
        if len(ids) > self.max_length:
            if self.on_long == "error":
                raise PromptDataError(f"the prompt has {len(ids)} tokens, more than data.max_prompt_length="
                                      f"{self.max_length}: raise data.max_prompt_length or set "
                                      "data.on_long_prompt=skip to skip (and count) such prompts")
            if self.on_long == "skip":  # the prompt loader counts it
                return None
            ids = ids[:self.max_length]
        return list(ids) or None


def _parts(content: Any) -> Any:
    """A message's content as a chat template expects it: a string as it is; parts without the keys a table
    format filled in for other parts (None), each image part `{"type": "image"}` (its image travels apart)."""
    if not isinstance(content, list):
        return content
    parts = [{key: value for key, value in part.items() if value is not None} for part in content]
    return [{"type": "image"} if part.get("type") in ("image", "image_url") else part for part in parts]


def encode_with_images(encode: PromptEncoder | Any, row: dict, text_key: str,
                       image_dir: str | None = None) -> tuple[list[int] | None, list]:
    """A row's prompt ids (`encode`) and the images it shows, read as RGB PIL images (none: `[]`)."""
    sources = prompt_images(row, text_key, image_dir)
    if not sources:
        return encode(row[text_key]), []
    if not isinstance(encode, PromptEncoder):
        raise PromptDataError("prompts with images need the chat template; OpenAI's query mode "
                              "(data.on_long_prompt=truncate) takes plain text only")
    from workers.vision import load_images

    try:
        images = load_images(sources)
    except ValueError as error:
        raise PromptDataError(" ".join(str(error).split())) from None
    return encode(row[text_key], images=len(images)), images


def encode_row(encode: PromptEncoder, dataset: PromptDataset, index: int) -> tuple[list[int] | None, list]:
    """`encode` of one dataset row and its images (`encode_with_images`); a refusal names the file and the row."""
    try:
        return encode_with_images(encode, dataset[index], dataset.text_key, dataset.image_dir)
    except PromptDataError as error:
        raise PromptDataError(f"{dataset.source}, row {index + 1}: {error}") from None


def refuse_long_prompts(dataset: PromptDataset, encode: PromptEncoder) -> None:
    """With `on_long="error"`, encode every row now: a long prompt stops the job while the data is
    read, before any engine starts, not at the step that first draws it."""
    if encode.on_long == "error":
        for index in range(len(dataset)):
            encode_row(encode, dataset, index)
