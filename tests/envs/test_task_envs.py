"""The sentiment task env and docs/envs.md's example env."""

import asyncio

import pytest

from envs.base import Action
from envs.factory import load_env_class
from envs.sentiment import SentimentEnv


def act(text: str) -> Action:
    return Action(text=text, token_ids=[])




def test_sentiment_env_starts_from_the_query_ids_as_they_are():
    env = SentimentEnv()
    assert asyncio.run(env.reset({"query_ids": [5, 6, 7]})) == [5, 6, 7]
    assert asyncio.run(env.reset({"prompt_ids": list(range(10, 20))})) == list(range(10, 20))
    result = asyncio.run(env.step(Action("text", [3, 4, 5], "length")))
    assert result.done and result.reward == 0.0 and result.observation is None
    assert result.info["response_tokens"] == 3
    with pytest.raises(KeyError, match="query_ids"):
        asyncio.run(env.reset({"text": "no ids"}))


def test_example_env_rewards_target_length():
    env_cls = load_env_class("envs.examples.echo_length:TargetLengthEnv")
    env = env_cls(target_words=4)
    assert asyncio.run(env.reset({"text": "hello"})) == "hello"
    exact = asyncio.run(env.step(act("one two three four")))
    off = asyncio.run(env.step(act("one two")))
    assert exact.reward == 1.0 and 0.0 < off.reward < 1.0 and exact.done
