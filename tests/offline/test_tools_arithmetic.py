"""The tool-calling recipe's data: demonstrations that fit the tiny policy's 128 positions and train the
assistant turns only, a template the conversation env extends without rewriting, and held-out problems
that fine-tuning never saw. Seconds: no model is built."""

import asyncio
import json
from pathlib import Path

import pytest

from envs.arithmetic_tools import calc
from envs.base import Action
from envs.chat import ChatEnvAdapter, ToolUseEnv
from envs.tools import Toolbox, hermes_tool_calls
from envs.turns import TurnParser
from rl_core.rewards.math import answer_reward
from rl_core.sft.data import encode_messages
from offline.tools_arithmetic import (SMALL_SETTINGS, TOOL_PATHS, chat_tokenizer, demonstration,
                                           demonstrations, held_out_pairs, prompt_row, sample_pairs, tool_call,
                                           tool_schemas, tools_line)

SHIPPED_TINY = Path(__file__).resolve().parents[2] / "assets" / "tiny-gpt2"  # the recipe's base tokenizer
POSITIONS = 128  # the tiny policy's context


@pytest.fixture(scope="module")
def tokenizer():
    return chat_tokenizer(SHIPPED_TINY)


@pytest.fixture(scope="module")
def line(tokenizer):
    return tools_line(tokenizer, tool_schemas())


def test_the_tool_evaluates_and_its_schema_is_the_short_signature_the_template_lists(tokenizer, line):
    assert calc("37 * 48") == "1776" and calc("7 / 2") == "3.5"
    with pytest.raises(ValueError):
        calc("__import__('os')")
    assert TOOL_PATHS == ("envs.arithmetic_tools:calc",)
    assert line == "Tools: calc(expr)"
    assert tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 * 3?"}], tokenize=False) == \
        "User: What is 2 * 3?\n"  # no tools, no tool line: the policy answering without tools


def test_the_call_tags_are_single_plain_tokens_the_parser_reads_after_decoding(tokenizer):
    text = tool_call(37, 48)
    ids = tokenizer.encode(text, add_special_tokens=False)
    assert len(ids) <= 44
    decoded = tokenizer.decode(ids, skip_special_tokens=True)  # what the env gives the parser
    assert decoded == text
    (call,) = hermes_tool_calls(decoded)
    assert (call.name, call.arguments, call.problem) == ("calc", {"expr": "37 * 48"}, None)


def test_demonstrations_fit_the_context_and_train_only_the_assistant_turns(tokenizer, line):
    rows = demonstrations(SMALL_SETTINGS, line)
    assert 0 < sum(row["calls"] for row in rows) < len(rows) / 2  # the annotator seldom calls
    for row in rows:
        messages = row["messages"]
        listed = messages[0]["role"] == "system"
        assert row["calls"] == 0 or listed  # a call only where the prompt lists the tool
        ids, mask = encode_messages(tokenizer, messages)
        assert len(ids) <= POSITIONS
        trained = tokenizer.decode([i for i, m in zip(ids, mask) if m], skip_special_tokens=False)
        eos = tokenizer.eos_token
        assert trained == "".join(m["content"] + eos + "\n" for m in messages if m["role"] == "assistant")
        assert answer_reward(messages[-1]["content"], row) == 1.0
    with_call = next(row for row in rows if row["calls"])
    ids, mask = encode_messages(tokenizer, with_call["messages"])
    context = tokenizer.decode([i for i, m in zip(ids, mask) if not m])
    assert "Tool: " + with_call["answer"] in context  # the tool's result is read, never trained


def test_a_conversation_in_the_env_is_the_demonstration_token_for_token(tokenizer, line):
    """The GRPO trajectory of a call and an answer, built by the conversation env from the model's ids, is
    one sequence (no template divergence) with exactly the ids SFT trained on: the tools line from
    `tools=` renders as the demonstration's system message does."""
    a, b = 37, 48
    row = prompt_row(a, b)
    env = ChatEnvAdapter(ToolUseEnv(Toolbox.from_paths(list(TOOL_PATHS)), max_tool_turns=1), tokenizer,
                         TurnParser("hermes", tokenizer=tokenizer))

    def act(text):
        ids = tokenizer.encode(text, add_special_tokens=False) + [tokenizer.eos_token_id]
        return Action(tokenizer.decode(ids, skip_special_tokens=True), ids)

    async def episode():
        prompt = await env.reset(dict(row))
        call = act(tool_call(a, b))
        after_call = await env.step(call)
        answer = act(f"#### {a * b}")
        end = await env.step(answer)
        return prompt, call, after_call, answer, end

    prompt, call, after_call, answer, end = asyncio.run(episode())
    assert after_call.observation[:len(prompt) + len(call.token_ids)] == prompt + call.token_ids
    assert after_call.info["tool_calls"] == 1 and after_call.info["tool_errors"] == 0
    assert end.done and end.info["template_divergences"] == 0
    sequence = after_call.observation + answer.token_ids
    ids, _ = encode_messages(tokenizer, demonstration(a, b, line, True)["messages"])
    assert sequence == ids[:-1]  # the demonstration also trains the newline after the final end of text
    assert len(sequence) <= POSITIONS
    assert answer_reward(tokenizer.decode(answer.token_ids, skip_special_tokens=True), row) == 1.0


def test_held_out_pairs_are_in_neither_order_in_the_fine_tuning_or_training_problems():
    held_out = {frozenset(pair) for pair in held_out_pairs(SMALL_SETTINGS)}
    assert len(held_out) == SMALL_SETTINGS.eval_problems
    for stream in ("sft", "train"):
        assert not held_out & {frozenset(pair) for pair in sample_pairs(SMALL_SETTINGS, 2000, stream)}
    assert demonstrations(SMALL_SETTINGS, "Tools: calc(expr)") == demonstrations(SMALL_SETTINGS, "Tools: calc(expr)")
    assert json.loads(json.dumps(prompt_row(12, 34))) == {
        "messages": [{"role": "user", "content": "What is 12 * 34?"}], "answer": "408"}


def test_a_failed_call_comes_back_short_enough_for_the_answer_to_fit(tokenizer):
    """The longest first turn (a 48-token call that fails) leaves its error short: the conversation stays
    inside 128 positions with room for the answer."""
    env = ChatEnvAdapter(ToolUseEnv(Toolbox.from_paths(list(TOOL_PATHS)), max_tool_turns=1,
                                    max_result_chars=16), tokenizer, TurnParser("hermes", tokenizer=tokenizer))
    bad = '<tool_call>{"name": "calc", "arguments": {"expr": "46 * 9 3 + 1111 * 2222 - 3333"}}</tool_call>'
    ids = tokenizer.encode(bad, add_special_tokens=False)[:46] + tokenizer.encode("}</tool_call>")[-1:]
    ids = ids + [tokenizer.eos_token_id]
    assert len(ids) == 48  # rollout.response_length

    async def episode():
        await env.reset(prompt_row(46, 93))
        return await env.step(Action(tokenizer.decode(ids, skip_special_tokens=True), ids))

    step = asyncio.run(episode())
    assert not step.done and step.info["tool_calls"] == 1 and step.info["tool_errors"] == 1
    assert POSITIONS - len(step.observation) >= len(tokenizer.encode("#### 4278")) + 1
