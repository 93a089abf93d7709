"""The embedded engine's own side: batching, EOS sampling, its strict release and weight checks, its log.

What both engines must do alike is in test_engine_conformance.py, run against real SGLang too.
"""

import asyncio

import pytest
import torch

from workers.engines.client import EngineClient, EngineError
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.rank_engine import RankEngine
from workers.engines.weights import Probe, WeightPusher, WeightSyncError, flatten_bucket, serialize_for_engine
from tests.workers.small_models import save_small_gpt2
from workers.procs import ManagedProcesses

CONTEXT = 512


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    """The session tokenizer with a 2-layer GPT-2 whose context (512) allows long, abortable decodes."""
    return save_small_gpt2(tiny_model_dir, tmp_path_factory.mktemp("engine_model"), n_layer=2, n_embd=32,
                           n_positions=CONTEXT)


@pytest.fixture(scope="module")
def engine(model_dir, tmp_path_factory):
    log = tmp_path_factory.mktemp("logs") / "engine.log"
    with ManagedProcesses() as procs:
        spec = EngineSpec("embedded", str(model_dir), "float32", "cpu", num_threads=1)
        yield start_engine(spec, log, procs, deadline_s=120)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


async def engine_state(client) -> dict:
    """The embedded engine's counters (SGLang puts scheduler state under internal_states)."""
    return (await client.server_info())["internal_states"][0]


def run(engine, make_coro):
    """Run `make_coro(client)` against the engine with a fresh client."""
    async def main():
        async with EngineClient(engine.url, timeout_s=60) as client:
            return await make_coro(client)
    return asyncio.run(main())


PROMPTS = [[5, 6, 7, 8, 9], [10], [11, 12, 13]]


@pytest.mark.timeout(180)
def test_ignore_eos_gives_exactly_max_new_tokens_and_eos_stops_otherwise(engine, model_dir):
    from transformers import AutoTokenizer

    eos = AutoTokenizer.from_pretrained(model_dir).eos_token_id
    params = [{"max_new_tokens": 40, "temperature": 1.5, "sampling_seed": seed} for seed in range(48)]
    free, fixed = run(engine, lambda c: asyncio.gather(
        asyncio.gather(*(c.generate([20], p) for p in params)),
        asyncio.gather(*(c.generate([20], {**p, "ignore_eos": True}) for p in params))))
    assert all(len(r["output_ids"]) == 40 and r["meta_info"]["finish_reason"]["type"] == "length" for r in fixed)
    stopped = [r for r in free if r["meta_info"]["finish_reason"]["type"] == "stop"]
    assert stopped, "with 1920 high-temperature samples over 300 tokens EOS should appear"
    for r in stopped:  # output_ids include the matched EOS, as in SGLang
        assert r["output_ids"][-1] == eos == r["meta_info"]["finish_reason"]["matched"]
        assert eos not in r["output_ids"][:-1]


@pytest.mark.timeout(180)
def test_logprobs_match_a_plain_forward_even_for_rows_joining_mid_decode(engine, hf_model):
    temperature = 0.7
    prompts = [[5, 6, 7, 8, 9, 10, 11], [12], [13, 14, 15]]  # different lengths: left padding in the batch
    sampled = {"max_new_tokens": 10, "temperature": temperature, "ignore_eos": True}

    async def body(client):
        early = asyncio.create_task(client.generate([40, 41], {**sampled, "max_new_tokens": 150}))
        await wait_running(client, early)  # the others join a batch whose cache is already longer
        late = await asyncio.gather(client.generate(prompts, sampled),
                                    client.generate(prompts[0], {"max_new_tokens": 6, "temperature": 0}))
        return await early, *late
    early, batch, greedy = run(engine, body)
    cases = [([40, 41], early, temperature), *[(p, r, temperature) for p, r in zip(prompts, batch)],
             (prompts[0], greedy, 1.0)]  # greedy logprobs are unscaled
    for prompt, result, temp in cases:
        ids = torch.tensor([prompt + result["output_ids"]])
        with torch.no_grad():
            logits = hf_model(ids, position_ids=torch.arange(ids.shape[1])[None]).logits[0]
        logprobs = torch.log_softmax(logits.float() / temp, -1)[len(prompt) - 1:-1]
        expected = logprobs.gather(-1, torch.tensor(result["output_ids"])[:, None]).squeeze(-1)
        got = torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    assert greedy["output_ids"] == run_greedy(hf_model, prompts[0], len(greedy["output_ids"]))


def run_greedy(model, prompt, steps):
    ids = torch.tensor([prompt])
    with torch.no_grad():
        for _ in range(steps):
            ids = torch.cat([ids, model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    return ids[0, len(prompt):].tolist()


@pytest.mark.timeout(180)
def test_concurrent_requests_are_decoded_in_one_batch(engine):
    async def body(client):
        before = await engine_state(client)
        await asyncio.gather(*(client.generate([30 + i], {"max_new_tokens": 8, "ignore_eos": True})
                               for i in range(16)))
        return before, await engine_state(client)
    before, after = run(engine, body)
    assert after["requests_finished"] - before["requests_finished"] == 16
    assert after["batches_run"] - before["batches_run"] < 16
    assert after["max_batch_seen"] > 1


@pytest.mark.timeout(180)
def test_text_input_and_bad_requests(engine, model_dir):
    from transformers import AutoTokenizer

    text = "the old man walked"
    result = run(engine, lambda c: c.post("/generate", {"text": text, "sampling_params": {"max_new_tokens": 2}}))
    assert result["meta_info"]["prompt_tokens"] == len(AutoTokenizer.from_pretrained(model_dir)(text)["input_ids"])
    with pytest.raises(EngineError, match="unknown sampling_params keys") as err:
        run(engine, lambda c: c.generate([5], {"max_new_tokens": 2, "temprature": 1.0}))
    assert err.value.status == 400 and engine.url in str(err.value)
    with pytest.raises(EngineError, match="context length"):
        run(engine, lambda c: c.generate([5] * 10, {"max_new_tokens": CONTEXT}))
    with pytest.raises(EngineError, match="top_p"):
        run(engine, lambda c: c.generate([5], {"top_p": 0}))


async def wait_running(client, task):
    while (await engine_state(client))["running"] == 0:
        assert not task.done(), "request finished before the test could act on it"
        await asyncio.sleep(0.01)


LONG = {"max_new_tokens": 480, "ignore_eos": True}


@pytest.mark.timeout(180)
def test_pause_blocks_new_requests_and_abort_mode_returns_partial_output(engine):
    async def body(client):
        running = asyncio.create_task(client.generate([5], LONG, rid="long"))
        await wait_running(client, running)
        await client.post("/pause_generation", {"mode": "in_place"})
        await asyncio.sleep(0.2)
        frozen = (await engine_state(client))["tokens_generated"]
        await asyncio.sleep(0.2)
        assert (await engine_state(client))["tokens_generated"] == frozen  # held between steps
        blocked = asyncio.create_task(client.generate([6], {"max_new_tokens": 2, "ignore_eos": True}))
        await asyncio.sleep(0.3)
        assert not blocked.done()
        await client.post("/pause_generation", {"mode": "abort"})
        aborted = await running
        await asyncio.sleep(0.1)
        assert not blocked.done()
        await client.post("/continue_generation")
        return aborted, await blocked
    aborted, unblocked = run(engine, body)
    assert aborted["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(aborted["output_ids"]) < LONG["max_new_tokens"]
    assert len(aborted["meta_info"]["output_token_logprobs"]) == len(aborted["output_ids"])
    assert unblocked["meta_info"]["finish_reason"]["type"] == "length"


def model_weights(model_dir, seed=None):
    """The model's weights, plus noise when `seed` is given."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if seed is not None:
        generator = torch.Generator().manual_seed(seed)
        with torch.no_grad():
            for param in model.parameters():
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return model


def probe_expectation(model, probe):
    with torch.no_grad():
        logits = model(torch.tensor([probe])).logits[0]
    return torch.log_softmax(logits[:-1].float(), -1).gather(-1, torch.tensor(probe[1:])[:, None]).squeeze(-1).tolist()


PROBE = [5, 6, 7, 8, 9, 10, 11, 12]


def rank_engine(engine, pusher):
    """The job's handle on `engine` (what pushes and checks it), with the float32 probe tolerance."""
    return RankEngine(engine.url, engine.log_path, pusher, 2e-3)


@pytest.mark.timeout(180)
def test_released_weights_are_lost_until_pushed_in_buckets(engine, model_dir):
    """The GPU sequence on CPU: release -> resume weights -> push buckets -> resume KV cache -> check."""
    original = model_weights(model_dir)
    named = list(dict(original.named_parameters()).items())  # tied weights once, as the trainer sends them
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    probe, expected = Probe.text(PROBE), probe_expectation(original, PROBE)

    async def body(client):
        before = await client.generate(PROMPTS[0], greedy)
        await client.post("/release_memory_occupation", {"tags": ["kv_cache", "weights"]})
        with pytest.raises(EngineError, match="memory released"):
            await client.generate([5], {"max_new_tokens": 2})
        with pytest.raises(EngineError, match="not released"):
            await client.post("/resume_memory_occupation", {"tags": ["cuda_graph"]})
        await client.post("/resume_memory_occupation", {"tags": ["weights"]})
        with pytest.raises(EngineError, match="memory released"):  # the KV cache is still released
            await client.generate([5], {"max_new_tokens": 2})
        await client.post("/resume_memory_occupation", {"tags": ["kv_cache"]})
        lost = await client.generate(PROMPTS[0], {**greedy, "max_new_tokens": 2})  # zeros: contents were lost
        with pytest.raises(WeightSyncError, match="disagrees with the trainer"):
            probe.gap(await client.post("/generate", probe.request()), "default", expected, 2e-3, engine.url)
        return before, lost
    before, lost = run(engine, body)
    with rank_engine(engine, WeightPusher(torch.float32, bucket_bytes=16 << 10)) as ours:
        stats = ours.push(named, 7, probe, expected)
    after = run(engine, lambda c: c.generate(PROMPTS[0], greedy))
    assert lost["meta_info"]["output_token_logprobs"] != before["meta_info"]["output_token_logprobs"]
    assert stats["weight_sync/buckets"] > 2 and stats["weight_sync/probe_gap"] < 1e-4
    assert after["output_ids"] == before["output_ids"] and after["meta_info"]["weight_version"] == "7"


@pytest.mark.timeout(180)
def test_wrong_or_partial_pushes_are_caught(engine, model_dir):
    original, noisy = model_weights(model_dir), model_weights(model_dir, seed=2)
    probe, expected = Probe.text(PROBE), probe_expectation(original, PROBE)

    def one_tensor(name, tensor):
        return {"serialized_named_tensors": [serialize_for_engine(flatten_bucket([(name, tensor)]))],
                "load_format": "flattened_bucket", "flush_cache": False}

    async def unsessioned(client):
        with pytest.raises(EngineError, match="must run between"):
            await client.post("/update_weights_from_tensor", {"serialized_named_tensors": ["x"]})

    async def behind_the_trainers_back(client):
        await client.post("/begin_weight_update")
        try:
            bad_name = await client.post("/update_weights_from_tensor", one_tensor("no.such.weight", torch.zeros(2)))
        except EngineError as err:
            bad_name = err
        try:
            bad_shape = await client.post("/update_weights_from_tensor",
                                          one_tensor("transformer.h.0.mlp.c_fc.bias", torch.zeros(3)))
        except EngineError as err:
            bad_shape = err
        # One tensor changed behind the trainer's back: the version still says 11, the probe does not.
        name = "transformer.h.0.mlp.c_fc.weight"
        await client.post("/update_weights_from_tensor", one_tensor(name, noisy.state_dict()[name]))
        await client.post("/end_weight_update")
        return bad_name, bad_shape, await client.post("/generate", probe.request())
    run(engine, unsessioned)
    with rank_engine(engine, WeightPusher(torch.float32, bucket_bytes=64 << 10)) as ours:
        ours.push(original.state_dict().items(), 11, probe, expected)
        bad_name, bad_shape, answer = run(engine, behind_the_trainers_back)
        with pytest.raises(WeightSyncError, match="mean \\|logprob gap\\|"):
            probe.gap(answer, "11", expected, 2e-3, engine.url)
        with pytest.raises(WeightSyncError, match="reports weight_version '11'"):
            probe.gap(answer, "12", expected, 2e-3, engine.url)
        gap = ours.push(original.state_dict().items(), 13, probe, expected)["weight_sync/probe_gap"]  # restored
    assert isinstance(bad_name, EngineError) and "unknown weight names" in str(bad_name)
    assert isinstance(bad_shape, EngineError) and "shape mismatch" in str(bad_shape)
    assert gap < 1e-4


@pytest.mark.timeout(60)
def test_the_log_records_every_path_and_control_call(engine):
    run(engine, lambda c: c.health())
    text = engine.log_path.read_text()
    assert text.startswith("$ ") and "workers.engines.embedded" in text.splitlines()[0]
    assert "first call of GET /health" in text and "first call of POST /generate" in text
    assert "call /release_memory_occupation tags=kv_cache,weights" in text
    assert "call /update_weights_from_tensor tensors=" in text


@pytest.mark.timeout(180)
def test_alternating_pushes_never_touch_the_weights_being_served(engine, model_dir):
    """The engine serves from the pusher's staging buffers: each push writes the set the engine is
    not using, so after every push the engine has exactly the weights just sent."""
    models = [model_weights(model_dir, seed=s) for s in (3, 4, 5)] + [model_weights(model_dir)]
    with rank_engine(engine, WeightPusher(torch.float32, bucket_bytes=32 << 10)) as ours:
        gaps = [ours.push(list(dict(model.named_parameters()).items()), version, Probe.text(PROBE),
                          probe_expectation(model, PROBE))["weight_sync/probe_gap"]
                for version, model in enumerate(models, start=20)]
    assert all(gap < 1e-4 for gap in gaps)


@pytest.mark.parametrize("stderr", ["pipe", "closed"])
def test_the_shared_memory_manager_keeps_no_hold_on_the_pushing_process_output(stderr):
    """A push's first share starts torch's shared-memory manager, which outlives its last client by 2 s: started
    by `start_shared_memory_manager_off_stderr`, it does not hold the pusher's output open meanwhile (a `| tee`
    of the job would wait for it), and a process without stderr starts it too."""
    import subprocess
    import sys

    from tests.jobs import pipe_holders

    code = ("import os, sys, torch\n"
            "from workers.engines.weights import start_shared_memory_manager_off_stderr\n"
            + ("os.close(2)\n" if stderr == "closed" else "") +
            "start_shared_memory_manager_off_stderr()\n"
            "children = open(f'/proc/{os.getpid()}/task/{os.getpid()}/children').read().split()\n"
            "names = [open(f'/proc/{c}/cmdline').read().strip('\\0 ') for c in children]\n"
            "print(names, flush=True)\n"
            "sys.stdout.flush(); os._exit(0)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        proc.wait(timeout=120)
        assert proc.returncode == 0, proc.stderr.read().decode()
        holders = pipe_holders(proc.stderr.fileno())
        assert holders == []
        assert proc.stdout.read().decode().strip() == "['torch_shm_manager']"  # it was started, by this process
    finally:
        proc.stdout.close()
        proc.stderr.close()
