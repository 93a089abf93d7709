"""The exact-token layer of conversation envs: a conversation as the token ids the model saw, turn by turn
(`ChatTokens`), and tool output that cannot forge a turn (`ToolTextGuard`)."""

from __future__ import annotations

import json
import os
import re
from typing import Any

from envs.turns import ParsedTurn, TurnParser

ZERO_WIDTH_SPACE = "\u200b"


class ToolTextGuard:
    """Tool output as text that cannot forge a turn: every special or added token of the tokenizer and every
    line of text the chat template writes around messages (`<|im_start|>user`, `User:`) that appears in it is
    broken by a zero-width space after its first character, so it is tokenized as plain text and reads as
    no turn. Code a policy writes prints what it likes; without this a printed `<|im_end|>` became the real
    special token, and a printed `User:` line a turn to anything that reads the transcript."""

    def __init__(self, tokenizer: Any):
        added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        strings = set(getattr(tokenizer, "all_special_tokens", [])) | {token.content for token in added.values()}
        tokens = re.compile("|".join(map(re.escape, sorted(strings, key=len, reverse=True))) or "$^")
        for marker in template_markers(tokenizer):  # a header after an end-of-turn token forges a turn alone too
            strings.update(part.strip() for part in tokens.split(marker))
            strings.add(marker)
        strings = sorted((text for text in strings if len(text.strip()) > 1), key=len, reverse=True)
        self.pattern = re.compile("|".join(map(re.escape, strings))) if strings else None

    def __call__(self, text: str) -> str:
        if self.pattern is None:
            return text
        for _ in range(8):  # a break may leave the text around it forming another marker: until none is left
            broken = self.pattern.sub(lambda m: m.group(0)[0] + ZERO_WIDTH_SPACE + m.group(0)[1:], text)
            if broken == text:
                break
            text = broken
        return text


def template_markers(tokenizer: Any) -> set[str]:
    """The lines of text the chat template writes between messages (role headers, end-of-turn markers), found
    by rendering probe conversations whose contents are placeholders; a template that refuses a probe (a role
    it does not know, an order it does not allow) is simply probed less."""
    probes = [["system", "user", "assistant", "user"], ["user", "assistant", "tool", "user"], ["user"]]
    markers: set[str] = set()
    for roles in probes:
        messages = []
        for k, role in enumerate(roles):
            message = {"role": role, "content": f"\x07{k}\x07"}
            if role == "tool":
                message.update(tool_call_id="call_0", name="probe")
            messages.append(message)
        try:
            text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        except Exception:  # noqa: BLE001 - templates raise what they like on conversations they refuse
            continue
        for piece in re.split(r"\x07\d+\x07", text):
            markers.update(line.strip() for line in piece.splitlines() if len(line.strip()) >= 3)
    return markers



def special_strings(tokenizer: Any) -> list[str]:
    """The tokenizer's special tokens as text, longest first (end-of-turn tokens among them)."""
    added = getattr(tokenizer, "added_tokens_decoder", {}) or {}
    strings = set(getattr(tokenizer, "all_special_tokens", [])) | {t.content for t in added.values() if t.special}
    return sorted(strings, key=len, reverse=True)


def tool_call_style(tokenizer: Any, template_kwargs: dict) -> str | None:
    """How the chat template takes an assistant message's structured `tool_calls`: arguments as a dict
    ("dict"), as a JSON string ("json", DeepSeek's template concatenates them), or not at all (None: the
    template never shows `tool_calls`, so the model's calls stay in the message's text)."""
    for style, arguments in (("dict", {"x": 1}), ("json", '{"x": 1}')):
        call = {"type": "function", "id": "call00000", "function": {"name": "probe_fn", "arguments": arguments}}
        probe = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "", "tool_calls": [call]}]
        try:
            text = tokenizer.apply_chat_template(probe, tokenize=False, **template_kwargs)
        except Exception:  # noqa: BLE001 - templates raise what they like on input they refuse
            continue
        if "probe_fn" in text:
            return style
    return None


def overlap(text: str, tail: str) -> int:
    """The longest k such that `text` ends with `tail[:k]`."""
    if not text:
        return 0
    for k in range(min(len(text), len(tail)), 0, -1):
        if tail[k - 1] == text[-1] and text.endswith(tail[:k]):
            return k
    return 0


class ChatTokens:
    """One conversation as token ids the model saw, kept exact turn by turn.

    `start(messages)` renders the first messages with the generation prompt. `add_turn(ids, new)` keeps the
    engine's `ids` as they are, appends the assistant turn (as a message: `tool_calls` structured where the
    template renders them, else the model's text) and the new messages, and renders the conversation again:
    - if the rendering starts with the text the model saw (the previous rendering plus the decoded ids), only
      the rest is tokenized and appended. That rest starts with whatever of the template's end of turn the
      model did not write itself (all of it when a length limit cut the turn).
    - else, if the template left the history alone and only wrote this turn differently, saying the same
      (same reasoning, content and calls, `ParsedTurn.key`), the model's ids are kept and only the text the
      template writes after the turn is appended: the generation prompt's pre-filled text (Qwen3's empty
      `<think>\\n\\n</think>\\n\\n` when thinking is off) stays part of the turn, a `<think>` written without the
      template's newlines stays as written, and a turn the model ended with another end token than the
      template writes (Llama's `<|eom_id|>` for `<|eot_id|>`) keeps the model's token in its place.
    - otherwise the template rewrote something the model saw (earlier `<think>` blocks dropped at a new user
      turn), and a new sequence starts with the whole rendering: `divergences` counts these, and
      `reprefill_tokens` the tokens sent again.
    `template_kwargs` (`env.chat_template_kwargs`) go to every rendering.
    """

    def __init__(self, tokenizer: Any, tools: list[dict] | None = None, max_result_tokens: int | None = None,
                 template_kwargs: dict | None = None, parse: TurnParser | None = None):
        if not getattr(tokenizer, "chat_template", None):
            raise ValueError("a conversation env needs a tokenizer with a chat template; set model.tokenizer_path to "
                             "one that has")
        self.tokenizer = tokenizer
        self.tools = tools or None
        self.template_kwargs = dict(template_kwargs or {})
        self.guard = ToolTextGuard(tokenizer)
        self.max_result_tokens = max_result_tokens  # a tool message's text cut to this many tokens (None: whole)
        self.specials = special_strings(tokenizer)
        self.parse = parse or TurnParser("hermes", specials=self.specials, tokenizer=tokenizer)
        # Re-rendered turns are compared by what they say; reasoning is told apart even when env.reasoning_parser
        # is none, since templates rewrite it (the `auto` parser compares as hermes: a mismatch only costs a
        # new sequence).
        self.compare = TurnParser(self.parse.calls or "hermes",
                                  self.parse.reasoning_parser if self.parse.reasoning_parser != "none" else "think",
                                  self.parse.schemas, specials=self.specials)
        self.call_style = tool_call_style(tokenizer, self.template_kwargs)
        self.messages: list[dict] = []
        self.text = ""  # the text of `ids`: what the model has seen
        self.rendered = ""  # the template's rendering of `messages` (differs from `text` where turns were kept)
        self.ids: list[int] = []
        self.divergences = 0
        self.reprefill_tokens = 0

    def render(self, messages: list[dict], generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, add_generation_prompt=generation_prompt,
                                                  tokenize=False, **self.template_kwargs)

    def encode(self, text: str) -> list[int]:
        """A rendered piece on its own; the template writes any BOS itself."""
        return list(self.tokenizer.encode(text, add_special_tokens=False)) if text else []

    def decode(self, ids: list[int], skip_special_tokens: bool) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def start(self, messages: list[dict]) -> list[int]:
        self.messages = [dict(m) for m in messages]
        self.text = self.rendered = self.render(self.messages)
        self.ids = self.encode(self.text)
        self.divergences = self.reprefill_tokens = 0
        return list(self.ids)

    def assistant_text(self, action_ids: list[int]) -> str:
        """The turn's text without special tokens (the stop token is the template's to write)."""
        return self.decode(action_ids, skip_special_tokens=True)

    def read_turn(self, action_ids: list[int]) -> ParsedTurn:
        """The turn parsed (`parse`), from its text with special tokens kept (they mark calls and channels)."""
        return self.parse(self.decode(action_ids, skip_special_tokens=False), self.text)

    def assistant_message(self, action_ids: list[int], turn: ParsedTurn) -> dict:
        """The turn as the template gets it: structured where it renders `tool_calls`, else the model's text."""
        if self.call_style is None:
            return {"role": "assistant", "content": self.assistant_text(action_ids)}
        message = {"role": "assistant", "content": turn.content}
        if turn.reasoning is not None:  # Qwen3/GLM read `reasoning_content`, gpt-oss `thinking`
            message["reasoning_content"] = message["thinking"] = turn.reasoning.strip("\n")
        if turn.tool_calls:
            message["tool_calls"] = [self._call(call.id, call.name, call.arguments) for call in turn.tool_calls]
        return message

    def _call(self, call_id: str, name: str, arguments: dict) -> dict:
        arguments = json.dumps(arguments) if self.call_style == "json" else arguments
        return {"type": "function", "id": call_id, "function": {"name": name, "arguments": arguments}}

    def tool_text(self, text: str) -> str:
        """A tool message's text as the model gets it: guarded (`ToolTextGuard`), then cut to `max_result_tokens`."""
        text = self.guard(text)
        if self.max_result_tokens is not None:
            ids = self.encode(text)
            if len(ids) > self.max_result_tokens:
                text = self.decode(ids[:self.max_result_tokens], skip_special_tokens=False)
        return text

    def add_turn(self, action_ids: list[int], new_messages: list[dict], turn: ParsedTurn | None = None) -> list[int]:
        """The ids of the next state: the current sequence extended, or a new one (a divergence). Tool messages'
        text goes through `ToolTextGuard`. `turn`: the turn as parsed already (else parsed here)."""
        new_messages = [{**m, "content": self.tool_text(m["content"])} if m.get("role") == "tool" and
                        isinstance(m.get("content"), str) else dict(m) for m in new_messages]
        turn = turn if turn is not None else self.read_turn(action_ids)
        history = self.messages
        self.messages = history + [self.assistant_message(action_ids, turn), *new_messages]
        said = self.decode(action_ids, skip_special_tokens=False)
        rendered = self.render(self.messages)
        seen = self.text + said
        after = rendered[len(seen):] if rendered.startswith(seen) else self._after_turn(history, new_messages, said,
                                                                                        rendered)
        if after is None:
            self.divergences += 1
            self.ids = self.encode(rendered)
            self.reprefill_tokens += len(self.ids)
            self.text = rendered
        else:
            self.ids = self.ids + list(action_ids) + self.encode(after)
            self.text = seen + after
        self.rendered = rendered
        return list(self.ids)

    def _after_turn(self, history: list[dict], new_messages: list[dict], said: str, rendered: str) -> str | None:
        """The text the template writes after the assistant turn, when the rendering differs from what the model
        saw only in how it writes that turn; None when the template rewrote the history or the turn's meaning."""
        try:
            base = self.render(history, generation_prompt=False)
            other = self.render(history + [self._other(self.messages[len(history)])] + new_messages)
        except Exception:  # noqa: BLE001 - a template that refuses the probe: treat as a rewrite
            return None
        if not (rendered.startswith(base) and self.rendered.startswith(base)):
            return None  # the history itself is written differently now
        common = len(os.path.commonprefix([rendered[::-1], other[::-1]]))
        start = max(len(rendered) - common, len(base))  # inside the turn's own text or where it ends
        body, stop = said, ""
        for special in self.specials:  # the model's stop token, if it wrote one
            if said.endswith(special):
                body, stop = said[:-len(special)], special
                break
        end = start + overlap(body, rendered[start:])
        if stop:
            template_end = next((s for s in self.specials if rendered.startswith(s, end)), "")
            end += len(stop) if rendered.startswith(stop, end) else len(template_end)
        model_view = self.rendered[len(base):] + said
        if self.compare(model_view).key() != self.compare(rendered[len(base):end]).key():
            return None
        return rendered[end:]

    def _other(self, message: dict) -> dict:
        """The assistant message with other content and arguments: what renders the same in both is the text
        the template writes after the turn (its tail found by comparing the two renderings from the end)."""
        other = {"role": "assistant", "content": "\x07"}
        if message.get("tool_calls"):
            other["tool_calls"] = [self._call(c["id"], c["function"]["name"], {"\x07": "\x07"})
                                   for c in message["tool_calls"]]
        return other

