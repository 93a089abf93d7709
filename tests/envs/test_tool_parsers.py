"""Each vendor's call format parsed into calls, malformed ones kept as errors, reasoning kept apart (and calls in
it never run), a call no parser reads counted as `unparsed`, `auto` reading the tokenizer's response template,
and the config refusing unknown parsers in one line."""

import asyncio

import pytest
from transformers import AutoTokenizer

from envs.chat import AssistantMessage, ToolUseEnv
from envs.tool_parsers import PARSERS, load_parser
from envs.tools import Toolbox
from envs.turns import TurnParser
from tests.envs.test_chat import chat_tokenizer_dir, multiply  # noqa: F401 - the fixture

SCHEMAS = Toolbox([multiply]).schemas
CALLS = {  # one turn of each format with two calls: multiply(12, 34) then multiply(5, 6)
    "hermes": 'ok <tool_call>\n{"name": "multiply", "arguments": {"a": 12, "b": 34}}\n</tool_call>'
              '<tool_call>{"name": "multiply", "arguments": "{\\"a\\": 5, \\"b\\": 6}"}</tool_call>',
    "qwen3_coder": "ok <tool_call>\n<function=multiply>\n<parameter=a>\n12\n</parameter>\n<parameter=b>\n34\n</parameter>\n"
                   "</function>\n</tool_call><tool_call><function=multiply><parameter=a>5</parameter><parameter=b>6"
                   "</parameter></function></tool_call>",
    "llama3_json": 'ok <|python_tag|>{"name": "multiply", "parameters": {"a": 12, "b": 34}}; '
                   '{"name": "multiply", "arguments": {"a": 5, "b": 6}}<|eom_id|>',
    "mistral": 'ok [TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 12, "b": 34}}, '
               '{"name": "multiply", "arguments": {"a": 5, "b": 6}}]',
    "deepseek_v3": "ok <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n"
                   '{"a": 12, "b": 34}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>multiply<｜tool▁sep｜>{"a": 5, "b": 6}'
                   "<｜tool▁call▁end｜><｜tool▁calls▁end｜>",
    "glm45": "ok <tool_call>multiply\n<arg_key>a</arg_key>\n<arg_value>12</arg_value>\n<arg_key>b</arg_key>\n"
             "<arg_value>34</arg_value>\n</tool_call><tool_call>multiply<arg_key>a</arg_key><arg_value>5</arg_value>"
             "<arg_key>b</arg_key><arg_value>6</arg_value></tool_call>",
    "gpt_oss": "<|channel|>final<|message|>ok<|end|><|start|>assistant to=functions.multiply<|channel|>commentary json"
               '<|message|>{"a": 12, "b": 34}<|call|><|start|>assistant<|channel|>commentary to=functions.multiply '
               '<|constrain|>json<|message|>{"a": 5, "b": 6}<|call|>',
    "kimi_k2": "ok <|tool_calls_section_begin|><|tool_call_begin|>functions.multiply:0<|tool_call_argument_begin|>"
               '{"a": 12, "b": 34}<|tool_call_end|><|tool_call_begin|>functions.multiply:1<|tool_call_argument_begin|>'
               '{"a": 5, "b": 6}<|tool_call_end|><|tool_calls_section_end|>',
}
BROKEN = {  # the same formats with the arguments cut short
    "hermes": '<tool_call>{"name": "multiply", "arguments": {"a": 1</tool_call>',
    "llama3_json": '{"name": "multiply", "parameters": {"a": 1',
    "mistral": '[TOOL_CALLS] [{"name": "multiply", "arguments": {"a": 1',
    "deepseek_v3": "<｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{\"a\": 1\n```<｜tool▁call▁end｜>",
    "gpt_oss": '<|start|>assistant to=functions.multiply<|channel|>commentary json<|message|>{"a": 1<|call|>',
    "kimi_k2": '<|tool_call_begin|>functions.multiply:0<|tool_call_argument_begin|>{"a": 1<|tool_call_end|>',
}


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_each_format_gives_its_calls_in_order_typed_by_the_schema_and_the_rest_as_content(name):
    turn = TurnParser(name, schemas=SCHEMAS)(CALLS[name])
    assert [(c.name, c.arguments, c.problem) for c in turn.tool_calls] == [("multiply", {"a": 12, "b": 34}, None),
                                                                           ("multiply", {"a": 5, "b": 6}, None)]
    assert turn.content.replace("<|eom_id|>", "").strip() == "ok"
    assert len({c.id for c in turn.tool_calls}) == 2
    if name == "mistral":  # its templates take only 9-alphanumeric ids
        assert all(len(c.id) == 9 and c.id.isalnum() for c in turn.tool_calls)


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_a_malformed_call_is_a_call_with_a_problem_answered_as_unparsed(name):
    (call,) = TurnParser(name, schemas=SCHEMAS)(BROKEN[name]).tool_calls
    assert call.problem and "JSON" in call.problem
    toolbox = Toolbox([multiply])
    assert asyncio.run(toolbox.run(call)).error == "unparsed"


def test_mistral_v11_and_calls_in_other_formats_are_read_or_counted():
    turn = TurnParser("mistral")('[TOOL_CALLS]multiply[ARGS]{"a": 2, "b": 3}')
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("multiply", {"a": 2, "b": 3})]
    for parser, text in [("hermes", '{"name": "multiply", "parameters": {"a": 1, "b": 2}}'),
                         ("hermes", '[TOOL_CALLS] [{"name": "multiply", "arguments": {}}]'),
                         ("llama3_json", "<｜tool▁call▁begin｜>function<｜tool▁sep｜>multiply\n```json\n{}\n```"),
                         ("qwen3_coder", "<tool_call>\n<function=multiply>\n<parameter=a>\n1\n"),  # cut by a length limit
                         ("mistral", "<|python_tag|>multiply.call(a=1)")]:
        (call,) = TurnParser(parser)(text).tool_calls
        assert call.problem and "looks like a tool call" in call.problem and parser in call.problem, (parser, text)
    assert TurnParser("hermes")("The answer is 408.").tool_calls == []


def test_calls_inside_reasoning_are_not_run_and_reasoning_stays_out_of_the_content():
    text = ('<think>try <tool_call>{"name": "multiply", "arguments": {"a": 1, "b": 2}}</tool_call>?</think>'
            "The answer is 408.")
    turn = TurnParser("hermes", "think")(text)
    assert turn.tool_calls == [] and turn.content == "The answer is 408." and "multiply" in turn.reasoning
    opened_by_the_prompt = TurnParser("hermes", "think")("just multiply\n</think>\n\n" + CALLS["hermes"])
    assert opened_by_the_prompt.reasoning == "just multiply\n" and len(opened_by_the_prompt.tool_calls) == 2
    harmony = ('<|channel|>analysis<|message|>use it<|end|><|start|>assistant to=functions.multiply<|channel|>analysis'
               '<|message|>{"a": 1, "b": 2}<|call|><|start|>assistant<|channel|>final<|message|>408<|return|>')
    turn = TurnParser("gpt_oss", "gpt_oss")(harmony)
    assert turn.tool_calls == [] and turn.content == "408" and turn.reasoning.startswith("use it")

    env = ToolUseEnv(Toolbox([multiply]))  # the env sees no call: the turn is the answer
    step = asyncio.run(env.step(AssistantMessage(text, [], [], content=turn.content)))
    assert step.done and env.tool_stats.calls == 0
    with pytest.raises(ValueError, match="'env.reasoning_parser' is 'deepseek'; use one of"):
        TurnParser("hermes", "deepseek")


def test_a_call_no_parser_reads_is_counted_as_unparsed_in_the_env():
    env = ToolUseEnv(Toolbox([multiply]))
    turn = TurnParser("hermes")('<|python_tag|>{"name": "multiply", "parameters": {"a": 12, "b": 34}}')
    step = asyncio.run(env.step(AssistantMessage("", [], turn.tool_calls)))
    assert not step.done and "looks like a tool call" in step.messages[0]["content"]
    assert env.tool_stats.info()["tool_errors/unparsed"] == 1


def test_auto_reads_calls_with_the_tokenizers_response_template(chat_tokenizer_dir):  # noqa: F811
    tokenizer = AutoTokenizer.from_pretrained(chat_tokenizer_dir)
    with pytest.raises(ValueError, match="has none: set env.tool_parser to the model's format, one of"):
        TurnParser("auto", tokenizer=tokenizer)
    tokenizer.response_template = {
        "version": 1, "start_anchor": "Assistant:",
        "fields": {"reasoning_content": {"open": "<think>", "close": "</think>"},
                   "tool_calls": {"open": "<tool_call>", "close": "</tool_call>", "content": "json", "repeats": True,
                                  "transform": {"type": "function", "function": "{content}"}},
                   "content": {}}}
    parse = TurnParser("auto", schemas=SCHEMAS, tokenizer=tokenizer)
    turn = parse("<think>hm</think>Sure." + CALLS["hermes"][3:], prefix="User: 12 * 34?\nAssistant:")
    assert turn.reasoning == "hm" and turn.content == "Sure."
    assert [(c.name, c.arguments) for c in turn.tool_calls] == [("multiply", {"a": 12, "b": 34}),
                                                                ("multiply", {"a": 5, "b": 6})]
    (broken,) = parse(BROKEN["hermes"], prefix="").tool_calls
    assert broken.problem.startswith("the response does not parse")


def test_the_config_names_a_bad_parser_and_the_accepted_ones():
    from rl_core.config import ConfigError, load_config
    from rl_core.ppo.config import PPOConfig
    from rl_core.ppo.validation import validate

    with pytest.raises(ConfigError, match=r"'env.tool_parser' is 'qwen'; use one of \['hermes', 'qwen3_coder'.*'auto'\]"):
        load_config("grpo_arithmetic.yaml", ["env.tool_parser=qwen"], PPOConfig, validate)
    with pytest.raises(ConfigError, match=r"'env.reasoning_parser' is 'r1'; use one of \['none', 'think', 'gpt_oss'\]"):
        load_config("grpo_arithmetic.yaml", ["env.reasoning_parser=r1"], PPOConfig, validate)
    cfg = load_config("grpo_arithmetic.yaml", ["env.chat_template_kwargs={enable_thinking: false}"], PPOConfig, validate)
    assert cfg.env.chat_template_kwargs == {"enable_thinking": False}
    assert load_parser("glm45") is PARSERS["glm45"]
