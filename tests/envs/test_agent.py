"""Outside agent code trained through the OpenAI-compatible endpoint (envs/agent.py): the real `openai` client
drives a 2-turn tool conversation against a real embedded engine behind the router, and the trajectory holds
exactly the prompt and sampled ids of its calls; bad input gets one clear line.

The tiny policy writes no tool calls of its own, so these tests read every turn as a call with
`scripted_calls` (a user parser, `env.tool_parser: pkg.module:function`), and the agent runs it.
"""

import asyncio
import json

import openai
import pytest

from envs.agent import AgentEnv
from envs.factory import make_env_factory
from envs.chat import ChatSetup
from envs.tools import ToolCall
from rl_core.errors import JobError
from tests.envs.test_chat import chat_tokenizer_dir, tokenizer_with  # noqa: F401 - the fixture

def scripted_calls(text: str) -> list[ToolCall]:
    """Every turn read as one calculator call (a random policy writes none)."""
    return [ToolCall("call_0", "calc", {"expr": f"{len(text)} * 3"})]


async def recording_agent(base_url: str, sample: dict) -> dict:
    """The example agent, with what it was answered kept for the test."""
    from envs.examples import calculator_agent

    async with openai.AsyncOpenAI(base_url=base_url, api_key="unused", max_retries=0) as client:
        messages = [{"role": "user", "content": sample["question"]}]
        answers = []
        for _ in range(2):
            response = await client.chat.completions.create(model="anything", messages=messages,
                                                            tools=[calculator_agent.CALCULATOR], max_tokens=6)
            message = response.choices[0].message
            answers.append(response)
            messages.append(message.model_dump(exclude_none=True))
            for call in message.tool_calls or []:
                expression = json.loads(call.function.arguments)["expr"]
                messages.append({"role": "tool", "tool_call_id": call.id,
                                 "content": calculator_agent.calculate(expression)})
    sample["seen"].append((base_url, answers))  # the test's record, passed in the sample
    return {"reward": 0.5, "answers": len(answers)}


async def failing_agent(base_url: str, sample: dict) -> float:
    raise RuntimeError("the agent broke")


def not_async(base_url, sample):
    return 0.0


@pytest.mark.timeout(180)
def test_an_openai_client_agent_trains_on_exactly_the_sampled_tokens(chat_tokenizer_dir, tmp_path):
    from envs.pool import EnvPool
    from rl_core.rollout.rollout import RolloutParts, RolloutSettings, rollout
    from workers.engines.client import EngineClient
    from workers.engines.launch import start_engine
    from workers.engines.spec import EngineSpec
    from workers.procs import ManagedProcesses
    from workers.router import launch_router

    tokenizer = tokenizer_with(chat_tokenizer_dir, "tools_in_system")
    setup = ChatSetup.build(tokenizer, [], "tests.envs.test_agent:scripted_calls")
    pool = EnvPool(make_env_factory(AgentEnv, {"agent": "tests.envs.test_agent:recording_agent"}, chat=setup),
                   num_envs=2, step_timeout_s=30, max_failed_ratio=1.0)
    failing = EnvPool(make_env_factory(AgentEnv, {"agent": "tests.envs.test_agent:failing_agent"}, chat=setup),
                      num_envs=1, step_timeout_s=30, max_failed_ratio=1.0)
    seen = []
    samples = [{"question": q, "seen": seen} for q in ["2 * 3?", "What is 7 times 8?", "9 * 9 ="]]
    calls = []

    async def main(url):
        async with EngineClient(url, timeout_s=60) as client:
            async def generate(input_ids, params, return_logprob=True, rid=None):
                answer = await client.generate(input_ids, params, return_logprob=return_logprob, rid=rid)
                calls.append((list(input_ids), answer))
                return answer

            recorder = type("Recorder", (), {"generate": staticmethod(generate)})()
            settings = RolloutSettings({"max_new_tokens": 8, "temperature": 1.0}, max_turns=4, max_total_tokens=128,
                                       progress=False)
            try:
                result = await rollout(samples, settings, RolloutParts(recorder, pool, tokenizer), 3)
                broken = await rollout(samples[:1], settings, RolloutParts(recorder, failing, tokenizer), 3)
                # After the trajectory: its session is over (410); a made-up one is unknown (404).
                base_url = seen[0][0]
                async with openai.AsyncOpenAI(base_url=base_url, api_key="x", max_retries=0) as late:
                    with pytest.raises(openai.APIStatusError) as ended:
                        await late.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
                async with openai.AsyncOpenAI(base_url=base_url.rsplit("/", 2)[0] + "/nope/v1", api_key="x",
                                              max_retries=0) as unknown:
                    with pytest.raises(openai.NotFoundError) as missing:
                        await unknown.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            finally:
                await pool.close()
                await failing.close()
            left = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            return result, broken, ended.value, missing.value, left

    with ManagedProcesses() as procs:
        spec = EngineSpec("embedded", chat_tokenizer_dir, "float32", "cpu", num_threads=1)
        engine = start_engine(spec, tmp_path / "engine.log", procs, deadline_s=90)
        router = launch_router("127.0.0.1", None, [engine.url], log_path=tmp_path / "router.log", processes=procs,
                               deadline_s=60)
        result, broken, ended, missing, left = asyncio.run(main(router.url))

    assert len(result.trajectories) == len(samples) and not result.failed
    assert result.metrics["rollout/template_divergences"] == 0 and result.metrics["rollout/agent/answers"] == 2
    for base_url, answers in seen:
        assert base_url.startswith("http://127.0.0.1:") and "/sessions/" in base_url
        for answer in answers:  # OpenAI-shaped, the calls parsed by env.tool_parser
            (call,) = answer.choices[0].message.tool_calls
            assert answer.choices[0].finish_reason in ("tool_calls", "length")  # length: cut by max_tokens
            assert call.type == "function" and call.function.name == "calc"
            assert call.function.arguments.startswith('{"expr": ')
    for traj in result.trajectories:
        (sequence,) = traj.sequences  # the agent sent its conversation back as it got it: one sequence
        assert traj.num_turns == 2 and traj.env_reward == 0.5 and traj.info["tool_calls"] == 2
        mine = sorted(((ids, a) for ids, a in calls if sequence.input_ids[:len(ids)] == ids), key=lambda c: len(c[0]))
        assert len(mine) == 2
        for ids, answer in mine:  # every trained token is the engine's, with its logprob and version
            span = slice(len(ids), len(ids) + len(answer["output_ids"]))
            assert sequence.input_ids[span] == answer["output_ids"] and all(sequence.action_mask[span])
            assert sequence.behaviour_logprobs[span] == [t[0] for t in answer["meta_info"]["output_token_logprobs"]]
            assert set(sequence.versions[span]) == {3}
        (before, first), (after, _) = mine
        between = slice(len(before) + len(first["output_ids"]), len(after))
        assert "Tool calc: " in tokenizer.decode(sequence.input_ids[between])  # the tool's result: context
        assert not any(sequence.action_mask[between])
    assert all(len(a["output_ids"]) <= 6 for _, a in calls)  # the request's max_tokens
    (failed,) = broken.failed
    assert "the agent broke" in failed.error
    assert ended.status_code == 410 and "is over" in ended.message
    assert missing.status_code == 404 and "unknown session" in missing.message
    assert not left  # no agent, handler or server task outlives the pool


def test_a_wrong_agent_path_stops_the_job_at_start_naming_the_key():
    with pytest.raises(JobError, match=r"env.kwargs.agent: cannot import module 'no_such_pkg.agent'"):
        AgentEnv.check_kwargs({"agent": "no_such_pkg.agent:run"})
    with pytest.raises(JobError, match=r"env.kwargs.agent: .*not an async function"):
        AgentEnv.check_kwargs({"agent": "tests.envs.test_agent:not_async"})
    with pytest.raises(JobError, match=r"env.kwargs.agent"):
        AgentEnv.check_kwargs({})


def test_bad_requests_get_one_openai_style_line():
    from envs.openai_api import ApiError, parse_request

    for body, words in [({"messages": []}, "'messages' must be"), ({"messages": [{"role": "user"}], "n": 2}, "'n'"),
                        ({"messages": [{"role": "user"}], "stream": True}, "streaming"),
                        ({"messages": [{"role": "user"}], "max_tokens": 0}, "'max_tokens'")]:
        with pytest.raises(ApiError, match=words) as err:
            parse_request(body)
        assert err.value.status == 400
