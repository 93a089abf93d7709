"""Rollout against a real embedded engine behind the real sglang-router (tiny random GPT-2)."""

import asyncio
import os
import concurrent.futures
import logging
from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from envs.base import Action, Env, StepResult
from envs.factory import make_env_factory
from envs.calculator import CalculatorEnv
from envs.pool import EnvPool, TooManyEnvFailures
from envs.sentiment import SentimentEnv
from rl_core.rewards import batched
from rl_core.rollout.rollout import GroupRule, RolloutParts, RolloutSettings, rollout, rollout_until
from workers.engines.client import EngineClient
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.rank_engine import RankEngine
from workers.engines.weights import WeightPusher
from workers.procs import ManagedProcesses
from workers.router import launch_router

CONTEXT = 64  # the tiny model's n_positions


class LeftPaddedQueryEnv(SentimentEnv):
    """The sentiment env with OpenAI's query layout done by the env: the last `query_length` ids,
    left-padded with [PAD] (an env may hand the rollout a padded token-id state)."""

    def __init__(self, query_length: int, pad_token_id: int):
        self.query_length, self.pad_token_id = query_length, pad_token_id

    async def reset(self, sample: dict) -> list[int]:
        ids = (await super().reset(sample))[-self.query_length:]
        return [self.pad_token_id] * (self.query_length - len(ids)) + ids


@pytest.fixture(scope="module")
def servers(tiny_model_dir, tmp_path_factory):
    logs = tmp_path_factory.mktemp("rollout_logs")
    with ManagedProcesses() as procs:
        spec = EngineSpec("embedded", str(tiny_model_dir), "float32", "cpu", num_threads=1)
        engine = start_engine(spec, logs / "engine.log", procs, deadline_s=90)
        router = launch_router("127.0.0.1", None, [engine.url], log_path=logs / "router.log", processes=procs,
                               deadline_s=60)
        yield router.url, engine.url


@pytest.fixture(scope="module")
def router_url(servers):
    return servers[0]


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


class Calls(list):
    """(input ids, answer) per sequence; `sizes`: the sequences of each /generate call."""

    def __init__(self):
        super().__init__()
        self.sizes: list[int] = []


class RecordingClient:
    """The real EngineClient, keeping every sequence's input ids and answer for the assertions (a grouped
    call, `n` or a batch, gives one entry per sequence) and each call's number of sequences."""

    def __init__(self, client: EngineClient):
        self.client = client
        self.calls = Calls()

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None):
        answer = await self.client.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid)
        answers = answer if isinstance(answer, list) else [answer]
        inputs = input_ids if isinstance(input_ids[0], list) else [input_ids] * len(answers)
        self.calls += [(list(ids), one) for ids, one in zip(inputs, answers)]
        self.calls.sizes.append(len(answers))
        return answer


def run_rollout(router_url, samples, env_factory, tokenizer, *, num_envs=4, max_failed_ratio=0.1, policy_version=0,
                reward_fns=None, step_timeout_s=30, **settings):
    """One rollout on a fresh loop; `settings` are RolloutSettings'; returns (result, recorded engine calls, pool)."""
    pool = EnvPool(env_factory, num_envs=num_envs, step_timeout_s=step_timeout_s, max_failed_ratio=max_failed_ratio)

    async def main():
        async with EngineClient(router_url, timeout_s=60) as client:
            recorder = RecordingClient(client)
            try:
                result = await rollout(samples, RolloutSettings(progress=False, **settings),
                                       RolloutParts(recorder, pool, tokenizer, reward_fns), policy_version)
            finally:
                await pool.close()
            return result, recorder.calls

    result, calls = asyncio.run(main())
    return result, calls, pool


def assert_engine_tokens_kept(trajectories, calls):
    """Each engine call's input is a sequence's (unpadded) prefix and its output ids follow as-is."""
    for input_ids, answer in calls:
        output_ids = answer["output_ids"]
        logprobs = [t[0] for t in answer["meta_info"]["output_token_logprobs"]]
        matches = []
        for traj in trajectories:
            for seq in traj.sequences:
                real = [k for k, m in enumerate(seq.attention_mask) if m]  # positions the engine saw
                n = len(input_ids)
                if [seq.input_ids[k] for k in real[:n]] == input_ids and \
                        [seq.input_ids[k] for k in real[n:n + len(output_ids)]] == output_ids:
                    positions = real[n:n + len(output_ids)]
                    assert all(seq.action_mask[k] == 1 for k in positions)
                    assert [seq.behaviour_logprobs[k] for k in positions] == pytest.approx(logprobs)
                    matches.append(seq)
        assert matches, f"engine output {output_ids} is not in any trajectory as sampled"


@pytest.mark.timeout(120)
def test_sentiment_rollout_keeps_engine_tokens_fixed_length(router_url, tokenizer, caplog):
    query_length, response_length = 8, 10
    texts = ["the old man walked", "she smiled", "a terrible storm broke the quiet night.", "we found"]
    samples = [{"query_ids": tokenizer.encode(t)} for t in texts] * 2
    factory = make_env_factory(LeftPaddedQueryEnv, {"query_length": query_length,
                                                    "pad_token_id": tokenizer.pad_token_id})
    params = {"max_new_tokens": response_length, "temperature": 0.7, "ignore_eos": True}
    with caplog.at_level(logging.INFO, logger="rl_core.rollout"):
        result, calls, pool = run_rollout(router_url, samples, factory, tokenizer, sampling_params=params,
                                          max_turns=1, policy_version=3, max_total_tokens=CONTEXT)
    assert len(result.trajectories) == len(samples) and not result.failed
    for traj, sample in zip(result.trajectories, samples):
        (seq,) = traj.sequences
        assert len(seq) == query_length + response_length  # OpenAI: fixed-length query and response
        assert seq.action_mask == [0] * query_length + [1] * response_length
        n_pad = query_length - min(query_length, len(sample["query_ids"]))
        assert seq.attention_mask == [0] * n_pad + [1] * (query_length - n_pad + response_length)
        assert seq.input_ids[n_pad:query_length] == sample["query_ids"][-query_length:]
        response_logprobs = seq.behaviour_logprobs[query_length:]
        assert all(lp <= 0.0 for lp in response_logprobs) and any(lp < 0.0 for lp in response_logprobs)
        assert seq.versions == [-1] * query_length + [3] * response_length  # engine says "default": caller's version
        assert traj.finish_reasons == ["length"] and traj.num_turns == 1 and traj.env_reward == 0.0
    assert len(calls) == len(samples)
    assert_engine_tokens_kept(result.trajectories, calls)
    for input_ids, _ in calls:
        assert tokenizer.pad_token_id not in input_ids  # left padding is masked, not sent
    metrics = result.metrics
    assert metrics["rollout/response_length_min"] == metrics["rollout/response_length_max"] == response_length
    assert metrics["rollout/finish_reason/length"] == len(samples) and metrics["rollout/failed"] == 0
    assert metrics["rollout/tokens_per_s"] > 0 and 1 <= metrics["rollout/envs_max_in_use"] <= 4
    assert "[sample] query" in caplog.text  # the first finished trajectory is shown


@pytest.mark.timeout(120)
def test_a_batchs_first_turns_go_out_together_and_a_group_as_one_call(router_url, tokenizer):
    prompts = [[5, 6, 7], [8, 9], [10, 11, 12, 13]]
    members = [p for p in prompts for _ in range(4)]  # groups of 4, as GRPO samples them
    settings = dict(sampling_params={"max_new_tokens": 6, "temperature": 1.0, "ignore_eos": True}, max_turns=1,
                    max_total_tokens=CONTEXT)
    factory = make_env_factory(SentimentEnv, {})
    result, calls, _ = run_rollout(router_url, [{"prompt_ids": p} for p in members], factory, tokenizer,
                                   num_envs=len(members), **settings)
    assert calls.sizes == [4, 4, 4]  # one call with n = 4 per group
    assert result.metrics["rollout/generate_calls"] == 3 and result.metrics["rollout/first_wave_frac"] == 1.0
    assert_engine_tokens_kept(result.trajectories, calls)
    responses = [tuple(t.sequences[0].input_ids) for t in result.trajectories]
    assert [list(r[:len(p)]) for r, p in zip(responses, members)] == members and len(set(responses)) == len(members)
    # Seeded samples go out one call each, still all in the first wave, and sample what their seed samples
    # when each trajectory waits for the previous one (one env).
    seeded = [{"prompt_ids": p, "sampling_seed": 1000 + i} for i, p in enumerate(members)]
    together, calls, _ = run_rollout(router_url, seeded, factory, tokenizer, num_envs=len(members), **settings)
    assert calls.sizes == [1] * len(members) and together.metrics["rollout/first_wave_frac"] == 1.0
    alone, calls, _ = run_rollout(router_url, seeded, factory, tokenizer, num_envs=1, **settings)
    assert calls.sizes == [1] * len(members) and alone.metrics["rollout/first_wave_frac"] == 1 / len(members)
    assert [t.sequences[0].input_ids for t in alone.trajectories] == [t.sequences[0].input_ids for t in together.trajectories]


def calculator_factory():
    # Short texts: the tiny model has 64 positions and its tokenizer is close to one token per byte.
    return make_env_factory(CalculatorEnv, {"max_turns": 4, "summarize_every": 2, "max_state_chars": 20,
                                            "question_template": "Q: {expression}\n", "nudge": "?",
                                            "summary_template": "{question}K: {facts}\n"})


@pytest.mark.timeout(120)
def test_multi_turn_calculator_rollout_appends_and_starts_new_sequences(router_url, tokenizer):
    samples = [{"expression": e} for e in ["2+3", "4*5", "9-7", "6/3", "1+1", "8*8"]]
    result, calls, _ = run_rollout(router_url, samples, calculator_factory(), tokenizer,
                                   sampling_params={"max_new_tokens": 6, "temperature": 1.0},
                                   max_turns=4, policy_version=0, max_total_tokens=CONTEXT)
    trajectories = result.trajectories
    assert len(trajectories) == len(samples)
    appended = sum(t.info["appended_observations"] for t in trajectories)
    new_sequences = sum(t.info["new_sequences"] for t in trajectories)
    assert appended > 0 and new_sequences > 0  # both multi-turn cases happened
    assert any(len(t.sequences) > 1 for t in trajectories)
    for traj in trajectories:
        assert len(traj.sequences) == 1 + traj.info["new_sequences"]
        budget_stop = traj.info["truncated"]
        assert len(traj.finish_reasons) == traj.num_turns + int(budget_stop)
        assert not budget_stop or traj.finish_reasons[-1] == "length"
        assert traj.num_action_tokens > 0
        assert all(len(seq) <= CONTEXT for seq in traj.sequences)
    assert_engine_tokens_kept(trajectories, calls)
    assert len(calls) == sum(t.num_turns for t in trajectories)
    assert result.metrics["rollout/turns_mean"] > 1


class FlakyEnv(Env):
    """Raises on samples marked 'boom', otherwise a one-turn env with reward 1."""

    async def reset(self, sample):
        self.boom = sample.get("boom", False)
        return sample["text"]

    async def step(self, action: Action) -> StepResult:
        if self.boom:
            raise RuntimeError("tool server returned 500")
        return StepResult(None, 1.0, True)


@pytest.mark.timeout(120)
def test_env_failures_are_excluded_and_too_many_raise(router_url, tokenizer, caplog):
    samples = [{"text": "she smiled", "boom": i % 4 == 0} for i in range(8)]
    params = {"max_new_tokens": 4}
    with caplog.at_level(logging.ERROR, logger="envs.pool"):
        result, _, pool = run_rollout(router_url, samples, FlakyEnv, tokenizer, max_failed_ratio=0.5,
                                      sampling_params=params, max_turns=2, policy_version=0, max_total_tokens=CONTEXT)
    assert len(result.failed) == 2 and len(result.trajectories) == 6 and pool.failed == 2
    assert all(t.failed and "tool server returned 500" in t.error for t in result.failed)
    assert all(t.env_reward == 1.0 and not t.failed for t in result.trajectories)
    assert result.metrics["rollout/failed"] == 2 and "Traceback" in caplog.text
    with pytest.raises(TooManyEnvFailures, match="failed in their environment"):
        run_rollout(router_url, samples, FlakyEnv, tokenizer, max_failed_ratio=0.1,
                    sampling_params=params, max_turns=2, policy_version=0, max_total_tokens=CONTEXT)


class MisbehavingEnv(Env):
    """Per sample: `step` answers right, answers with the wrong type, or never answers."""

    async def reset(self, sample):
        self.fault = sample["fault"]
        return sample["text"]

    async def step(self, action: Action) -> StepResult:
        if self.fault == "wrong type":
            return {"observation": None, "reward": 1.0, "done": True}  # a dict, not a StepResult
        if self.fault == "hang":
            await asyncio.sleep(3600)
        return StepResult(None, 1.0, True)


@pytest.mark.timeout(120)
def test_a_step_of_the_wrong_type_or_past_its_timeout_fails_only_its_trajectory(router_url, tokenizer):
    samples = [{"text": "she smiled", "fault": fault} for fault in ("none", "wrong type", "none", "hang") * 2]
    result, _, pool = run_rollout(router_url, samples, MisbehavingEnv, tokenizer, max_failed_ratio=0.5,
                                  step_timeout_s=0.5, sampling_params={"max_new_tokens": 4}, max_turns=1,
                                  policy_version=0, max_total_tokens=CONTEXT)
    assert len(result.trajectories) == 4 and all(not t.failed and t.env_reward == 1.0 for t in result.trajectories)
    errors = sorted(t.error for t in result.failed)
    assert len(errors) == 4 and pool.failed == 4 and result.metrics["rollout/failed"] == 4
    assert all(e == "MisbehavingEnv.step returned dict, expected envs.base.StepResult" for e in errors[:2]), errors
    assert all(e == "MisbehavingEnv.step timed out after 0.5 s (env.step_timeout_s)" for e in errors[2:]), errors


class LongFirstStateEnv(FlakyEnv):
    """A first state of `length` token ids (a chat env's prompt with a long tool list, say)."""

    async def reset(self, sample):
        self.boom = False
        return [5] * sample["length"]


@pytest.mark.timeout(120)
def test_a_first_state_the_engines_would_refuse_fails_its_trajectory_with_the_reason(router_url, tokenizer):
    # CONTEXT 64: SGLang (and so the embedded engine) accepts inputs of at most 57 tokens.
    samples = [{"length": 57}, {"length": 58}]
    result, calls, _ = run_rollout(router_url, samples, LongFirstStateEnv, tokenizer, max_failed_ratio=0.5,
                                   sampling_params={"max_new_tokens": 4, "ignore_eos": True}, max_turns=1,
                                   policy_version=0, max_total_tokens=CONTEXT)
    (kept,), (failed,) = result.trajectories, result.failed
    assert kept.num_action_tokens == 4 and len(calls) == 1  # 57 + 4 tokens: within context - 2
    assert "first state of 58 tokens, longer than the engines accept for a context of 64" in failed.error


class LongAnswerEnv(FlakyEnv):
    """Answers the first action with `length` more ids (a long tool result, say), appended to the state."""

    async def reset(self, sample):
        self.ids = [5, 6, 7]
        return self.ids

    async def step(self, action: Action) -> StepResult:
        self.ids = self.ids + list(action.token_ids) + [8] * 40
        return StepResult(self.ids, 0.5, False)


@pytest.mark.timeout(120)
def test_an_observation_that_leaves_no_room_to_act_is_not_trained_on(router_url, tokenizer):
    result, calls, _ = run_rollout(router_url, [{}, {}], LongAnswerEnv, tokenizer, sampling_params={
        "max_new_tokens": 20, "ignore_eos": True}, max_turns=3, policy_version=0, max_total_tokens=CONTEXT)
    for traj in result.trajectories:
        (seq,) = traj.sequences
        # 3 + 20 + 40 = 63 tokens would leave no room to act: the 40 are dropped and the episode ends there.
        assert seq.input_ids[:3] == [5, 6, 7] and seq.input_ids[3:] in [answer["output_ids"] for _, answer in calls]
        assert seq.action_mask == [0] * 3 + [1] * 20 and traj.truncated and traj.env_reward == 0.5
    assert len(calls) == 2


@pytest.mark.timeout(120)
def test_readme_example_env_plugged_by_import_path(router_url, tokenizer):
    factory = make_env_factory("envs.examples.echo_length:TargetLengthEnv", {"target_words": 3})
    samples = [{"text": t} for t in ["the old man", "she smiled at the", "a storm"]]
    result, calls, _ = run_rollout(router_url, samples, factory, tokenizer,
                                   sampling_params={"max_new_tokens": 8}, max_turns=1, policy_version=0,
                                   max_total_tokens=CONTEXT)
    assert len(result.trajectories) == 3
    for traj in result.trajectories:
        words = traj.info["words"]
        assert traj.env_reward == pytest.approx(max(0.0, 1 - abs(words - 3) / 3))
        (seq,) = traj.sequences
        last_action_token = max(t for t, m in enumerate(seq.action_mask) if m)
        assert seq.token_rewards[last_action_token] == pytest.approx(traj.env_reward)
    assert_engine_tokens_kept(result.trajectories, calls)


@pytest.mark.timeout(120)
def test_rollout_until_replaces_dropped_groups(router_url, tokenizer):
    factory = make_env_factory("envs.examples.echo_length:TargetLengthEnv", {"target_words": 3})
    pool = EnvPool(factory, num_envs=4, step_timeout_s=30)
    samples = ({"text": f"we found {i}"} for i in range(100))

    async def main(keep_fn, max_groups=None):
        async with EngineClient(router_url, timeout_s=60) as client:
            settings = RolloutSettings({"max_new_tokens": 4}, max_total_tokens=CONTEXT, progress=False)
            return await rollout_until(2, samples, settings, RolloutParts(client, pool, tokenizer), 0,
                                       GroupRule(size=3, keep=keep_fn, max_groups=max_groups))

    result = asyncio.run(main(lambda group: group[0].info["group"] % 2 == 1))  # drop every other group
    groups = [result.trajectories[i:i + 3] for i in range(0, len(result.trajectories), 3)]
    assert len(groups) == 2 and all(len(g) == 3 for g in groups)
    assert all(len({id(t.sample) for t in g}) == 1 and len({t.info["group"] for t in g}) == 1 for g in groups)
    assert sorted(g[0].info["group"] for g in groups) == [1, 3]
    assert result.metrics["rollout/groups_launched"] == 4 and result.metrics["rollout/groups_dropped"] == 2
    with pytest.raises(RuntimeError, match="keep_fn dropped 3"):
        asyncio.run(main(lambda group: False, max_groups=3))


@pytest.mark.timeout(120)
def test_aborted_generation_continues_on_new_weights_with_per_token_versions(servers, tokenizer, tiny_model_dir):
    """A weight push pauses engines with `abort`: the trajectory keeps the partial tokens and goes on.

    Tokens are tagged with the older of the version current when their request was sent and the
    engine's answer, so the aborted part keeps the old version and the continuation the new one
    (a request sent before the new version is announced keeps the old tag: staleness is never
    under-counted).
    """
    from transformers import AutoModelForCausalLM

    router, engine_url = servers
    query_length, response_length = 8, 48
    samples = [{"query_ids": tokenizer.encode("the old man walked to the market")} for _ in range(8)]
    pool = EnvPool(make_env_factory(LeftPaddedQueryEnv, {"query_length": query_length,
                                                         "pad_token_id": tokenizer.pad_token_id}), num_envs=8)
    params = {"max_new_tokens": response_length, "ignore_eos": True}
    same_weights = list(AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict().items())
    ours = RankEngine(engine_url, Path("engine.log"), WeightPusher(torch.float32), 1e-3)  # the job's handle
    version = {"now": 4}

    async def push_midway(engine: EngineClient, generating: asyncio.Task):
        while (await engine.server_info())["internal_states"][0]["running"] == 0:
            if generating.done():
                return  # the rollout finished first: nothing to interrupt this attempt
            await asyncio.sleep(0.001)
        await engine.post("/pause_generation", {"mode": "in_place"})  # hold the running requests between two steps
        # Announce the new version, then abort: partial outputs come back as "abort", and the
        # continuations sent from here wait in the paused engine for the new weights: the job's async push
        # (paused in place, no cache flush while requests wait, continue), on the engine handle's own loop.
        version["now"] = 5
        await engine.post("/pause_generation", {"mode": "abort"})
        await asyncio.to_thread(ours.push, same_weights, 5, None, None, True)

    async def main():
        version["now"] = 4
        async with EngineClient(router, timeout_s=60) as client, EngineClient(engine_url) as engine:
            await asyncio.to_thread(ours.push, same_weights, 4, None, None)
            generating = asyncio.create_task(rollout(
                samples, RolloutSettings(params, max_total_tokens=CONTEXT, progress=False),
                RolloutParts(client, pool, tokenizer), lambda: version["now"]))
            try:
                await push_midway(engine, generating)
                return await generating
            finally:
                generating.cancel()
                await engine.post("/continue_generation")

    continued = 0
    try:
        for _ in range(5):  # the pause races the (fast) tiny model; retry until it lands mid-generation
            result = asyncio.run(main())
            for traj in result.trajectories:
                (seq,) = traj.sequences
                versions = seq.versions[query_length:]
                assert len(versions) == response_length and traj.finish_reasons == ["length"]  # the full fixed length
                switch = versions.index(5) if 5 in versions else response_length
                assert versions == [4] * switch + [5] * (response_length - switch)  # old policy first, then the new one
                continued += 0 < switch < response_length
                assert traj.min_version == (4 if switch else 5)
            if continued:
                break
    finally:
        ours.close()
    assert continued >= 1


def fails_on_odd(completion, sample):
    if sample["n"] % 2:
        raise RuntimeError(f"checker crashed on sample {sample['n']}")
    return 1.0


async def length_reward(completion, sample):
    return float(len(completion))


@pytest.mark.timeout(120)
def test_reward_functions_score_in_the_rollout_and_their_failures_count_like_env_failures(router_url, tokenizer,
                                                                                          caplog):
    from envs.single_turn import SingleTurnEnv
    from rl_core.rewards import RewardFunctions

    fns = RewardFunctions.from_config({"ok": {"fn": f"{__name__}:fails_on_odd", "weight": 2.0},
                                       "chars": {"fn": f"{__name__}:length_reward", "weight": 0.5}}, timeout_s=10)
    samples = [{"text": "she smiled at", "n": i % 4} for i in range(8)]  # n = 1 or 3: the first function raises
    with caplog.at_level(logging.ERROR, logger="rl_core.rollout.rollout"):
        result, _, pool = run_rollout(router_url, samples, SingleTurnEnv, tokenizer, max_failed_ratio=0.5,
                                      sampling_params={"max_new_tokens": 5}, max_turns=1, policy_version=0,
                                      max_total_tokens=CONTEXT, reward_fns=fns)
    assert len(result.trajectories) == 4 and len(result.failed) == 4 and pool.failed == 0  # not the env's fault
    assert all("checker crashed" in t.error for t in result.failed) and "checker crashed" in caplog.text
    for traj in result.trajectories:
        completion = tokenizer.decode(traj.final_response()[1], skip_special_tokens=True)
        assert traj.reward_components == {"ok": 1.0, "chars": len(completion)}
        assert traj.fn_reward == pytest.approx(2.0 + 0.5 * len(completion))
    metrics = result.metrics
    assert metrics["reward/fn/ok"] == 1.0 and metrics["reward/fn_failed"] == 4 and metrics["rollout/failed"] == 4
    assert metrics["reward/fn_total_mean"] == pytest.approx(sum(t.fn_reward for t in result.trajectories) / 4)
    with pytest.raises(TooManyEnvFailures, match="4 in a reward function"):
        run_rollout(router_url, samples, SingleTurnEnv, tokenizer, max_failed_ratio=0.25,
                    sampling_params={"max_new_tokens": 5}, max_turns=1, policy_version=0,
                    max_total_tokens=CONTEXT, reward_fns=fns)


BATCHES = []


@batched
def count_batches(completions, samples):
    BATCHES.append(len(completions))
    return [float(len(c)) for c in completions]


@pytest.mark.timeout(120)
def test_a_batched_reward_function_is_called_once_per_rollout_and_once_per_group_under_dynamic_sampling(
        router_url, tokenizer):
    from envs.single_turn import SingleTurnEnv
    from rl_core.rewards import RewardFunctions

    fns = RewardFunctions.from_config({"chars": {"fn": f"{__name__}:count_batches"}}, timeout_s=10)
    BATCHES.clear()
    result, _, pool = run_rollout(router_url, [{"text": "she smiled at"}] * 6, SingleTurnEnv, tokenizer, num_envs=6,
                                  sampling_params={"max_new_tokens": 5}, max_turns=1, max_total_tokens=CONTEXT,
                                  reward_fns=fns)
    assert BATCHES == [6] and result.metrics["rollout/reward_fn_s"] > 0
    for traj in result.trajectories:
        assert traj.fn_reward == len(tokenizer.decode(traj.final_response()[1], skip_special_tokens=True))
    BATCHES.clear()

    async def until():
        async with EngineClient(router_url, timeout_s=60) as client:
            settings = RolloutSettings({"max_new_tokens": 4}, max_total_tokens=CONTEXT, progress=False)
            return await rollout_until(2, ({"text": f"we found {i}"} for i in range(10)), settings,
                                       RolloutParts(client, pool, tokenizer, fns), 0, GroupRule(size=3))
    assert len(asyncio.run(until()).trajectories) == 6 and BATCHES == [3, 3]  # each group as it finishes


@pytest.mark.timeout(120)
def test_responses_end_at_stop_tokens_and_truncation_is_counted(router_url, tokenizer):
    from envs.single_turn import SingleTurnEnv

    samples = [{"text": "the old man"} for _ in range(4)]
    common = dict(max_turns=1, policy_version=0, max_total_tokens=CONTEXT)
    cut, _, _ = run_rollout(router_url, samples, SingleTurnEnv, tokenizer,
                            sampling_params={"max_new_tokens": 6, "ignore_eos": True}, **common)
    # every token id is a stop token: each response ends after its first token, by "stop"
    stopped, _, _ = run_rollout(router_url, samples, SingleTurnEnv, tokenizer,
                                sampling_params={"max_new_tokens": 6, "stop_token_ids": list(range(len(tokenizer)))},
                                **common)
    assert cut.metrics["rollout/truncated_frac"] == 1.0 and all(t.truncated for t in cut.trajectories)
    assert all(t.num_action_tokens == 6 for t in cut.trajectories)
    assert stopped.metrics["rollout/truncated_frac"] == 0.0
    assert all(t.num_action_tokens == 1 and t.finish_reasons == ["stop"] for t in stopped.trajectories)


def test_a_response_whose_last_token_is_eos_at_the_limit_is_not_counted_as_truncated():
    from rl_core.rollout.rollout import _Rollout

    class Tok:
        eos_token_id = 0

    def run(**params):
        return _Rollout(RolloutSettings(params), RolloutParts(None, None, Tok()), 0)

    # SGLang reports "length" when EOS arrives as the last allowed token; the response did end
    assert run(max_new_tokens=3)._ends_with_stop([5, 6, 0])
    assert run(max_new_tokens=3, stop_token_ids=[9])._ends_with_stop([5, 6, 9])
    assert not run(max_new_tokens=3)._ends_with_stop([5, 6, 7])
    assert not run(max_new_tokens=3, ignore_eos=True)._ends_with_stop([5, 6, 0])  # sentiment: fixed length


def test_closing_the_service_cancels_a_rollout_left_running_by_a_stop_signal(router_url, tokenizer):
    """Ctrl-C stops the main thread's wait, not the rollout on the service's loop: `close` must
    cancel it before closing the HTTP session under it (else aiohttp calls into a closed loop and
    prints tracebacks at exit, as a CI run of the Ctrl-C test once did)."""
    import threading

    from rl_core.rollout.service import RolloutService

    factory = make_env_factory(SentimentEnv)
    from types import SimpleNamespace

    envs = SimpleNamespace(num_envs=4, step_timeout_s=30, max_failed_ratio=0.1)  # the env config section's keys
    settings = RolloutSettings({"max_new_tokens": 48, "ignore_eos": True}, concurrency=4, max_total_tokens=CONTEXT,
                               progress=False, engine_timeout_s=60)
    service = RolloutService(router_url, tokenizer, factory, envs, settings)
    loop_errors = []
    service.loop.call_soon_threadsafe(service.loop.set_exception_handler, lambda _, ctx: loop_errors.append(ctx))
    samples = [{"query_ids": tokenizer.encode("the old man walked")} for _ in range(16)]
    in_flight = asyncio.run_coroutine_threadsafe(service._rollout(samples, 0), service.loop)
    started = threading.Event()

    async def wait_until_generating():
        while not service.env_pool.in_use:
            await asyncio.sleep(0.001)
        started.set()

    service._call(wait_until_generating(), timeout=60)
    assert started.is_set() and not in_flight.done()
    service.close()
    assert in_flight.cancelled()
    assert service.loop.is_closed() and not service.thread.is_alive()
    assert loop_errors == []


def test_rollout_settings_are_frozen_and_refuse_impossible_limits():
    settings = RolloutSettings({"max_new_tokens": 4}, max_turns=2)
    with pytest.raises(TypeError):
        settings.sampling_params["max_new_tokens"] = 8  # read-only: one job's settings, shared by every rollout
    evaluation = settings.with_sampling({"max_new_tokens": 8, "temperature": 0.0})
    assert evaluation.max_turns == 2 and settings.sampling_params["max_new_tokens"] == 4
    with pytest.raises(ValueError, match="rollout.max_turns must be >= 1"):
        RolloutSettings({}, max_turns=0)
    with pytest.raises(ValueError, match="rollout.concurrency must be >= 1"):
        RolloutSettings({}, concurrency=0)


class WaitsForTheNextBatchEnv(Env):
    """Batch 0's trajectories start only once one of batch 1's has: batch 0 can finish only while batch 1
    is generating beside it."""
    batch_1_started: asyncio.Event | None = None  # made per test, used on the service's loop

    async def reset(self, sample: dict) -> None:
        if sample["batch"] == 1:
            type(self).batch_1_started.set()
        elif sample["batch"] == 0:
            await type(self).batch_1_started.wait()
        return None  # the rollout starts from the sample's prompt_ids

    async def step(self, action: Action) -> StepResult:
        return StepResult(observation=None, reward=0.0, done=True)


class NumberedBatches:
    """A prompt stream whose samples say which batch they are in; its state is how many batches it gave."""

    def __init__(self, size: int, prompt_ids: list[int]):
        self.size, self.prompt_ids, self.served = size, prompt_ids, 0

    def __next__(self) -> list[dict]:
        self.served += 1
        return [{"prompt_ids": self.prompt_ids, "batch": self.served - 1} for _ in range(self.size)]

    def state_dict(self) -> dict:
        return {"served": self.served}


def test_two_batches_in_flight_generate_side_by_side_within_the_staleness_bound_and_queue_in_order(router_url,
                                                                                                   tokenizer):
    """async.batches_in_flight=2: the producer starts batch 1 while batch 0 generates (else batch 0 waits for
    ever here), still starts no batch the staleness bound would drop, and hands batches over in the order
    they started, each with the prompt position after it (the resume point)."""
    from types import SimpleNamespace

    from rl_core.rollout.service import RolloutService

    WaitsForTheNextBatchEnv.batch_1_started = asyncio.Event()
    envs = SimpleNamespace(num_envs=8, step_timeout_s=60, max_failed_ratio=0.0)
    settings = RolloutSettings({"max_new_tokens": 4, "ignore_eos": True}, concurrency=8, max_total_tokens=CONTEXT,
                               progress=False, engine_timeout_s=60)
    service = RolloutService(router_url, tokenizer, make_env_factory(WaitsForTheNextBatchEnv), envs, settings,
                             served_version=lambda: 0)
    stream = NumberedBatches(4, tokenizer.encode("the old man walked"))
    waiting = concurrent.futures.ThreadPoolExecutor(1)
    try:
        # The engines stay at version 0: with max_staleness=1 batches 0 and 1 may start, batch 2 may not.
        service.start_producer(stream, max_queued=2, max_staleness=1, in_flight=2)
        taken = waiting.submit(lambda: [service.next_batch(4, current_version=0, max_staleness=1)[0]
                                        for _ in range(2)]).result(timeout=120)  # one in flight: no batch 0
        assert [{t.sample["batch"] for t in trajectories} for trajectories, _ in taken] == [{0}, {1}]
        assert service.resume_state == {"served": 2} and service.batches_taken == 2
        assert all(t.num_action_tokens == 4 for trajectories, _ in taken for t in trajectories)
        service._call(asyncio.sleep(0.2))  # a moment for a third batch to start, which it must not
        assert stream.served == 2 and service.batches_generated == 2
    finally:
        service.close()
        waiting.shutdown()  # a next_batch still waiting ends with the producer


class PidEnv(Env):
    """Its reward is the id of the process that ran it; a sample with `fail` fails in `reset`."""

    async def reset(self, sample: dict) -> None:
        if sample.get("fail"):
            raise ValueError("this env refuses the sample")
        return None

    async def step(self, action: Action) -> StepResult:
        return StepResult(observation=None, reward=float(os.getpid()), done=True)


def build_pid_service(router_url: str, tokenizer_dir: str, served_version):
    """What the rollout process builds in the tests below (the job's is rl_core.ppo.runtime.build_rollout_service)."""
    from types import SimpleNamespace

    from rl_core.rollout.service import RolloutService

    envs = SimpleNamespace(num_envs=4, step_timeout_s=60, max_failed_ratio=0.0)
    settings = RolloutSettings({"max_new_tokens": 4, "ignore_eos": True}, concurrency=4, max_total_tokens=CONTEXT,
                               progress=False, engine_timeout_s=60)
    return RolloutService(router_url, AutoTokenizer.from_pretrained(tokenizer_dir), make_env_factory(PidEnv), envs,
                          settings, served_version=served_version)


def test_the_rollout_process_generates_beside_this_one_then_leaves_nothing(router_url, tiny_model_dir, tokenizer):
    """async.rollout_process: the envs run in the child, the producer tags tokens with the version this
    process sets in shared memory, an env's error comes back with its type and message, and close leaves
    no process of the child's group."""
    from rl_core.rollout.process import RolloutProcess, ServedVersion

    served = ServedVersion()
    rollout = RolloutProcess(build_pid_service, served)
    child = rollout._process.pid
    try:
        rollout.start(router_url, str(tiny_model_dir))
        prompt = tokenizer.encode("the old man walked")
        with pytest.raises(TooManyEnvFailures, match="1 of 1 trajectories failed in their environment"):
            rollout.collect([{"prompt_ids": prompt, "fail": True}], 0)  # max_failed_ratio=0: the rollout fails
        served.set(3)
        rollout.start_producer(NumberedBatches(4, prompt), 1, 1)
        (trajectories, _), dropped = rollout.next_batch(4, 3, 1)
        assert dropped == 0 and {t.env_reward for t in trajectories} == {float(child)} != {float(os.getpid())}
        assert {t.min_version for t in trajectories} == {3}  # read from shared memory, not asked for
        assert rollout.resume_state["served"] >= 1
    finally:
        rollout.close()
    assert not rollout._process.is_alive() and rollout._process.exitcode == 0
    with pytest.raises(ProcessLookupError):
        os.killpg(child, 0)  # the child led its group: nothing of it is left


def test_the_rollout_process_dies_with_rank_0(tiny_model_dir, tmp_path):
    """A rank 0 killed with SIGKILL runs no clean-up: the kernel's parent-death signal stops the child."""
    import signal
    import subprocess
    import sys
    import time

    script = ("import sys, time\n"
              "from rl_core.rollout.process import RolloutProcess, ServedVersion\n"
              "from tests.rollout.test_rollout import build_pid_service\n"
              "if __name__ == '__main__':\n"
              "    rollout = RolloutProcess(build_pid_service, ServedVersion())\n"
              "    print(rollout._process.pid, flush=True)\n"
              "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True,
                              cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))))
    try:
        child = int(parent.stdout.readline())
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait(30)
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            try:
                os.killpg(child, 0)
            except ProcessLookupError:
                break
            time.sleep(0.1)
        else:
            os.killpg(child, signal.SIGKILL)
            raise AssertionError("the rollout process outlived rank 0")
    finally:
        parent.kill()
