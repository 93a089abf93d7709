"""Vendors' own chat templates (chat_templates/LICENSES.md), rendered with the shipped tokenizer given each
vendor's special tokens: a tool conversation in which the model writes its vendor's call format keeps every
sampled id, decodes to the template's rendering and has its calls parsed; and the cases a template rewrites
only in form (a pre-filled empty think block, think without newlines, `<|eom_id|>`) stay one sequence."""

import re
from pathlib import Path

import pytest
from transformers import AutoTokenizer

from envs.chat_tokens import ChatTokens, special_strings
from envs.tools import Toolbox
from envs.turns import TurnParser
from tests.envs.test_chat import chat_tokenizer_dir, multiply  # noqa: F401 - the fixture

TEMPLATES = Path(__file__).parent / "chat_templates"
QWEN = (["<|im_start|>", "<|im_end|>"], ["<tool_call>", "</tool_call>", "<think>", "</think>"])
TOKENS = {  # (special tokens, other added tokens) as the vendors' tokenizers have them
    "qwen3": QWEN, "qwen3_instruct_2507": QWEN, "qwen3_coder": QWEN,
    "llama3_1": (["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"], []),
    "mistral_small_3_1": (["[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]", "[/AVAILABLE_TOOLS]",
                           "[TOOL_RESULTS]", "[/TOOL_RESULTS]", "[SYSTEM_PROMPT]", "[/SYSTEM_PROMPT]"], []),
    "deepseek_v3": (["<｜User｜>", "<｜Assistant｜>", "<｜end▁of▁sentence｜>"],
                    ["<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>", "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>",
                     "<｜tool▁sep｜>", "<｜tool▁outputs▁begin｜>", "<｜tool▁outputs▁end｜>", "<｜tool▁output▁begin｜>",
                     "<｜tool▁output▁end｜>", "<think>", "</think>"]),
    "glm4_5": (["[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>", "<|observation|>"],
               ["<think>", "</think>", "<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>",
                "</arg_value>"]),
    "gpt_oss": (["<|start|>", "<|end|>", "<|message|>", "<|channel|>", "<|constrain|>", "<|call|>", "<|return|>"], []),
}
# What each model writes after its generation prompt to call multiply(a, b), with its stop token.
WRITES = {
    "qwen3": '<tool_call>\n{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}}}\n</tool_call><|im_end|>',
    "qwen3_coder": "<tool_call>\n<function=multiply>\n<parameter=a>\n{a}\n</parameter>\n<parameter=b>\n{b}\n</parameter>\n"
                   "</function>\n</tool_call><|im_end|>",
    "llama3_1": '{{"name": "multiply", "parameters": {{"a": {a}, "b": {b}}}}}<|eot_id|>',
    "mistral_small_3_1": '[TOOL_CALLS] [{{"name": "multiply", "arguments": {{"a": {a}, "b": {b}}}, "id": "call00000"}}]'
                         "<|endoftext|>",
    "deepseek_v3": '</think><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n'
                   '{{"a": {a}, "b": {b}}}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜><｜end▁of▁sentence｜>',
    "glm4_5": "\n<think></think>\n<tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>{a}</arg_value>\n<arg_key>b"
              "</arg_key>\n<arg_value>{b}</arg_value>\n</tool_call><|observation|>",
    "gpt_oss": ' to=functions.multiply<|channel|>commentary json<|message|>{{"a": {a}, "b": {b}}}<|call|>',
}
WRITES["qwen3_instruct_2507"] = WRITES["qwen3"]
PARSER = {"qwen3": "hermes", "qwen3_instruct_2507": "hermes", "qwen3_coder": "qwen3_coder", "llama3_1": "llama3_json",
          "mistral_small_3_1": "mistral", "deepseek_v3": "deepseek_v3", "glm4_5": "glm45", "gpt_oss": "gpt_oss"}
ANSWERS = {"gpt_oss": "<|channel|>final<|message|>It is 816.<|return|>", "glm4_5": "\n<think></think>\nIt is 816.<|user|>",
           "deepseek_v3": "</think>It is 816.<｜end▁of▁sentence｜>", "llama3_1": "It is 816.<|eot_id|>",
           "mistral_small_3_1": "It is 816.<|endoftext|>"}
START = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 12 * 34, times 2?"}]


def vendor_tokenizer(directory: str, template: str):
    tokenizer = AutoTokenizer.from_pretrained(directory)
    special, plain = TOKENS[template]
    tokenizer.add_special_tokens({"additional_special_tokens": special})
    tokenizer.add_tokens(plain)
    tokenizer.chat_template = (TEMPLATES / f"{template}.jinja").read_text()
    return tokenizer


def sampled(tokenizer, text: str) -> list[int]:
    """`text` as an engine might sample it: added tokens as themselves, everything else a token per character
    (never how the tokenizer would encode it, so a re-tokenization would show)."""
    added = sorted(tokenizer.get_added_vocab(), key=len, reverse=True)
    ids = []
    for piece in re.split(f"({'|'.join(map(re.escape, added))})", text):
        ids += [tokenizer.convert_tokens_to_ids(piece)] if piece in added else \
            [i for ch in piece for i in tokenizer.encode(ch, add_special_tokens=False)]
    return ids


def conversation(tokenizer, template: str, kwargs=None) -> ChatTokens:
    tools = Toolbox([multiply]).schemas
    parse = TurnParser(PARSER[template], "think" if template != "gpt_oss" else "gpt_oss", tools, tokenizer,
                       special_strings(tokenizer))
    return ChatTokens(tokenizer, tools, template_kwargs=kwargs, parse=parse)


@pytest.mark.parametrize("template", sorted(WRITES))
def test_a_vendor_tool_conversation_keeps_every_sampled_id_and_decodes_to_the_templates_rendering(
        chat_tokenizer_dir, template):  # noqa: F811
    tokenizer = vendor_tokenizer(chat_tokenizer_dir, template)
    tokens = conversation(tokenizer, template)
    ids = tokens.start(START)
    expected = list(START)
    for turn, (a, b, result) in enumerate([(12, 34, "408"), (408, 2, "816")]):
        action = sampled(tokenizer, WRITES[template].format(a=a, b=b))
        parsed = tokens.read_turn(action)
        assert [(c.name, c.arguments, c.problem) for c in parsed.tool_calls] == [("multiply", {"a": a, "b": b}, None)]
        call_id = parsed.tool_calls[0].id
        answer = {"role": "tool", "tool_call_id": call_id, "name": "multiply", "content": result}
        after = tokens.add_turn(action, [answer], parsed)
        expected += [{"role": "assistant", "content": "",
                      "tool_calls": [tokens._call(call_id, "multiply", {"a": a, "b": b})]}, answer]
        if template == "deepseek_v3" and turn == 1:
            # This template is not append-only across two tool turns: the second call is rendered without the
            # <｜tool▁outputs▁end｜> the model was shown. Counted, and the new sequence is the rendering.
            assert tokens.divergences == 1 and tokens.reprefill_tokens == len(after)
            assert tokenizer.decode(after) == tokens.render(expected)
            return
        assert after[:len(ids)] == ids and after[len(ids):len(ids) + len(action)] == action  # the model's own ids
        ids = after
        if template != "deepseek_v3":  # its prompt pre-fills <think>\n, which the rendering of a call leaves out
            assert tokenizer.decode(ids) == tokens.render(expected)
    assert tokens.divergences == 0 and tokens.reprefill_tokens == 0
    final = tokens.read_turn(sampled(tokenizer, ANSWERS.get(template, "It is 816.<|im_end|>")))
    assert final.tool_calls == [] and final.content == "It is 816."


def test_non_thinking_qwen3_stays_one_sequence_with_its_empty_think_block_in_the_turn(chat_tokenizer_dir):  # noqa: F811
    tokenizer = vendor_tokenizer(chat_tokenizer_dir, "qwen3")
    tokens = conversation(tokenizer, "qwen3", {"enable_thinking": False})
    first = tokens.start(START)
    assert tokenizer.decode(first).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")  # the kwarg reached it
    assert not conversation(tokenizer, "qwen3").start(START)[-5:] == first[-5:]
    ids = first
    for a, b, result in [(12, 34, "408"), (408, 2, "816")]:
        action = sampled(tokenizer, WRITES["qwen3"].format(a=a, b=b))
        after = tokens.add_turn(action, [{"role": "tool", "tool_call_id": "call_0", "name": "multiply",
                                          "content": result}])
        assert after[:len(ids)] == ids and after[len(ids):len(ids) + len(action)] == action
        assert tokenizer.decode(after[len(ids) + len(action):]) == (
            f"\n<|im_start|>user\n<tool_response>\n{result}\n</tool_response><|im_end|>\n"
            "<|im_start|>assistant\n<think>\n\n</think>\n\n")
        ids = after
    # The template's own rendering drops the empty blocks; the model saw them, so they stay.
    assert tokens.divergences == 0 and tokens.reprefill_tokens == 0 and "<think>" not in tokens.rendered[-200:-30]


def test_think_without_newlines_stays_and_dropped_thinking_at_a_new_user_turn_is_a_counted_divergence(
        chat_tokenizer_dir):  # noqa: F811
    tokenizer = vendor_tokenizer(chat_tokenizer_dir, "qwen3")
    tokens = conversation(tokenizer, "qwen3")
    first = tokens.start(START)
    action = sampled(tokenizer, "<think>12 * 34 needs the tool</think>" + WRITES["qwen3"].format(a=12, b=34))
    parsed = tokens.read_turn(action)
    assert parsed.reasoning == "12 * 34 needs the tool" and len(parsed.tool_calls) == 1
    after = tokens.add_turn(action, [{"role": "tool", "tool_call_id": "call_0", "name": "multiply", "content": "408"}])
    assert after[len(first):len(first) + len(action)] == action and tokens.divergences == 0
    assert "<think>\n12 * 34 needs the tool\n</think>" in tokens.rendered  # the template's form, not the model's

    answer = sampled(tokenizer, "<think>done</think>It is 816.<|im_end|>")
    fresh = tokens.add_turn(answer, [{"role": "user", "content": "Thanks!"}])
    assert tokens.divergences == 1 and tokens.reprefill_tokens == len(fresh)  # Qwen3 drops the thinking
    assert "needs the tool" not in tokenizer.decode(fresh) and tokenizer.decode(fresh) == tokens.rendered


def test_a_llama_turn_ended_by_eom_keeps_its_token_and_stays_one_sequence(chat_tokenizer_dir):  # noqa: F811
    tokenizer = vendor_tokenizer(chat_tokenizer_dir, "llama3_1")
    tokens = conversation(tokenizer, "llama3_1")
    first = tokens.start(START)
    action = sampled(tokenizer, '<|python_tag|>{"name": "multiply", "parameters": {"a": 12, "b": 34}}<|eom_id|>')
    after = tokens.add_turn(action, [{"role": "tool", "tool_call_id": "call_0", "name": "multiply", "content": "408"}])
    assert tokens.divergences == 0 and after[len(first):len(first) + len(action)] == action
    assert tokenizer.decode(after[len(first) + len(action):]) == ('<|start_header_id|>ipython<|end_header_id|>\n\n"408"'
                                                                 "<|eot_id|><|start_header_id|>assistant"
                                                                 "<|end_header_id|>\n\n")
