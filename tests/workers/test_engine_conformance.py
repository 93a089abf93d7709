"""One engine protocol: every call the job makes, held against the embedded engine and real SGLang.

Each test runs once per engine kind, on a server started exactly as the job starts it
(`start_engine` with an `EngineSpec`; SGLang gets its CPU settings by itself). Where the two
really differ, the test says so per kind and docs/engines.md lists the difference and why the job
never meets it; everything else must agree.
"""

import asyncio
import dataclasses
import http.client
import sys
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch

from tests.sglang_env import ENGINE_KINDS, engine_calls, require_sglang_python
from tests.workers.small_models import save_small_gpt2
from workers.engines.client import EngineClient, EngineError
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.rank_engine import RankEngine
from workers.engines.weights import (Probe, WeightPusher, WeightSyncError, flatten_bucket, probe_token_ids,
                                     serialize_for_engine)
from workers.procs import ManagedProcesses

CONTEXT = 512
PROMPTS = [[5, 6, 7, 8, 9], [10], [11, 12, 13]]
PROBE = [5, 6, 7, 8, 9, 10, 11, 12]
LONG = {"max_new_tokens": 500, "ignore_eos": True}  # seconds of decoding on either engine: time to act on it


@dataclasses.dataclass
class Engine:
    kind: str
    url: str
    log_path: Path


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return save_small_gpt2(tiny_model_dir, tmp_path_factory.mktemp("conformance_model"), n_layer=2, n_embd=32,
                           n_positions=CONTEXT)


@pytest.fixture(scope="module", params=ENGINE_KINDS)
def engine(request, model_dir, tmp_path_factory):
    python = require_sglang_python() if request.param == "sglang" else None
    spec = EngineSpec(kind=request.param, model_path=model_dir, dtype="float32", device="cpu", seed=0,
                      num_threads=1, sglang_python=python)
    log_path = tmp_path_factory.mktemp(f"{request.param}_engine") / "engine.log"
    with ManagedProcesses() as procs:
        yield Engine(request.param, start_engine(spec, log_path, procs, deadline_s=300).url, log_path)


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


def run(engine, make_coro):
    async def main():
        async with EngineClient(engine.url, timeout_s=120) as client:
            return await make_coro(client)
    return asyncio.run(main())


def forward_logprobs(model, ids: list[int], temperature: float = 1.0) -> torch.Tensor:
    """log p(ids[i] | ids[:i]) for i >= 1, from a plain forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1].float() / temperature
    return torch.log_softmax(logits, -1).gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)


def noisy_copy(model, seed: int):
    import copy

    noisy = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in noisy.parameters():
            param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    return noisy


@pytest.mark.timeout(300)
def test_single_batch_and_n_responses_have_sglang_shape(engine):
    single, batch, grouped = run(engine, lambda c: asyncio.gather(
        c.generate(PROMPTS[0], {"max_new_tokens": 4, "ignore_eos": True}, rid="one"),
        c.generate(PROMPTS, {"max_new_tokens": 3, "ignore_eos": True}, rid="many"),
        c.generate(PROMPTS[:2], {"max_new_tokens": 2, "ignore_eos": True, "n": 2})))
    assert isinstance(single, dict) and {"output_ids", "meta_info"} <= set(single)
    meta = single["meta_info"]
    assert meta["id"] == "one" and meta["finish_reason"] == {"type": "length", "length": 4}
    assert meta["prompt_tokens"] == 5 and meta["completion_tokens"] == 4
    assert meta["weight_version"] == "default" and meta["e2e_latency"] > 0
    assert [t[1] for t in meta["output_token_logprobs"]] == single["output_ids"]
    assert all(t[0] <= 0 and t[2] is None for t in meta["output_token_logprobs"])
    # A list in gives a list out, in order; a string rid becomes rid_i.
    assert isinstance(batch, list) and [r["meta_info"]["prompt_tokens"] for r in batch] == [5, 1, 3]
    assert [r["meta_info"]["id"] for r in batch] == ["many_0", "many_1", "many_2"]
    assert all(len(r["output_ids"]) == 3 for r in batch)
    # n > 1: the samples of each prompt together, prompt by prompt.
    assert [r["meta_info"]["prompt_tokens"] for r in grouped] == [5, 5, 1, 1]
    assert all(len(r["output_ids"]) == 2 for r in grouped)


@pytest.mark.timeout(300)
def test_n_samples_of_one_prompt_differ_unless_seeded_and_seeds_are_honoured(engine):
    """The rollout's grouped first turn (rl_core/rollout/first_turns.py) is one request with n = group size, and
    only for unseeded samples: n copies of a seeded request share its seed, which the embedded engine always
    honours and SGLang only under --enable-deterministic-inference (its sampler ignores sampling_seed otherwise)."""
    sampled = {"max_new_tokens": 8, "temperature": 1.0, "ignore_eos": True}
    group, seeded, alone = run(engine, lambda c: asyncio.gather(
        c.generate(PROMPTS[0], dict(sampled, n=3)),
        c.generate(PROMPTS[0], dict(sampled, sampling_seed=11, n=2)),
        c.generate(PROMPTS[0], dict(sampled, sampling_seed=11))))
    assert len({tuple(r["output_ids"]) for r in group}) == 3  # a group of samples, not copies
    if engine.kind == "embedded":
        assert seeded[0]["output_ids"] == seeded[1]["output_ids"] == alone["output_ids"]


@pytest.mark.timeout(300)
def test_sampled_and_greedy_logprobs_match_a_plain_forward(engine, hf_model):
    """Sampled logprobs are log_softmax(logits / T); greedy ones are unscaled; greedy ids are argmax."""
    temperature = 0.7
    sampled = {"max_new_tokens": 10, "temperature": temperature, "ignore_eos": True}
    greedy = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}
    batch, first = run(engine, lambda c: asyncio.gather(c.generate(PROMPTS, sampled), c.generate(PROMPTS[0], greedy)))
    for prompt, result, temp in [*[(p, r, temperature) for p, r in zip(PROMPTS, batch)], (PROMPTS[0], first, 1.0)]:
        expected = forward_logprobs(hf_model, prompt + result["output_ids"], temp)[len(prompt) - 1:]
        got = torch.tensor([t[0] for t in result["meta_info"]["output_token_logprobs"]])
        torch.testing.assert_close(got, expected, atol=1e-4, rtol=0)
    ids = torch.tensor([PROMPTS[0]])
    with torch.no_grad():
        for _ in range(6):
            ids = torch.cat([ids, hf_model(ids).logits[:, -1].argmax(-1, keepdim=True)], dim=-1)
    assert first["output_ids"] == ids[0, len(PROMPTS[0]):].tolist()


@pytest.mark.timeout(300)
def test_prompt_logprobs_of_a_prefill_only_request(engine, hf_model):
    """`max_new_tokens=0` with `logprob_start_len`: the probe the job checks every push with."""
    body = {"input_ids": PROBE, "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.7}}
    full, tail = run(engine, lambda c: asyncio.gather(c.post("/generate", body),
                                                      c.post("/generate", {**body, "logprob_start_len": 2})))
    assert full["output_ids"] == []
    entries = full["meta_info"]["input_token_logprobs"]
    assert [e[1] for e in entries] == PROBE and entries[0][0] is None
    torch.testing.assert_close(torch.tensor([e[0] for e in entries[1:]]), forward_logprobs(hf_model, PROBE),
                               atol=1e-4, rtol=0)  # raw logits: the temperature does not apply to the prompt
    assert [e[1] for e in tail["meta_info"]["input_token_logprobs"]] == PROBE[2:]


@pytest.mark.timeout(300)
def test_a_distillation_teachers_logprobs_of_sequences_sent_at_once(engine, hf_model):
    """distill.teacher_url: rank 0 sends every sequence of a step at once, prefill only, and reads each token's
    logprob under the teacher (rl_core/ppo/distill.py); prompt and sampled tokens alike, as a plain forward."""
    from rl_core.ppo.distill import teacher_input_logprobs

    sequences = [PROBE, PROBE[:3] + [40, 41, 42, 43, 44], list(range(60, 100))]
    answers = run(engine, lambda c: asyncio.gather(*(teacher_input_logprobs(c, ids) for ids in sequences)))
    for ids, logprobs in zip(sequences, answers):
        torch.testing.assert_close(torch.tensor(logprobs), forward_logprobs(hf_model, ids), atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_ignore_eos_stop_token_ids_and_unknown_sampling_keys(engine):
    greedy = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    first = run(engine, lambda c: c.generate(PROMPTS[0], greedy))
    assert len(first["output_ids"]) == 12 and first["meta_info"]["finish_reason"]["type"] == "length"
    stop_id = first["output_ids"][3]
    stopped, ignored = run(engine, lambda c: asyncio.gather(
        c.generate(PROMPTS[0], {**greedy, "ignore_eos": False, "stop_token_ids": [stop_id]}),
        c.generate(PROMPTS[0], {**greedy, "stop_token_ids": [stop_id]})))
    # The matched stop token is part of output_ids; ignore_eos ignores stop tokens too.
    assert stopped["output_ids"] == first["output_ids"][:first["output_ids"].index(stop_id) + 1]
    assert stopped["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop_id}
    assert ignored["output_ids"] == first["output_ids"]
    with pytest.raises(EngineError) as err:
        run(engine, lambda c: c.generate([5], {"max_new_tokens": 2, "temprature": 1.0}))
    assert err.value.status == 400


@pytest.mark.timeout(300)
def test_release_resume_and_push_in_a_session(engine, hf_model):
    """The sync step's sequence as the job's RankEngine makes it: release -> resume weights -> begin, buckets, end
    -> resume KV -> probe. An update outside a session is refused."""
    new_model = noisy_copy(hf_model, seed=1)
    named = list(dict(new_model.named_parameters()).items())  # tied weights once, as the trainer sends them
    expected = forward_logprobs(new_model, PROBE).tolist()

    async def unsessioned(client):
        with pytest.raises(EngineError, match="must run between|begin_weight_update"):
            await client.post("/update_weights_from_tensor", {
                "serialized_named_tensors": [serialize_for_engine(flatten_bucket(named[:1]))],
                "load_format": "flattened_bucket", "flush_cache": False})

    async def generate(client):
        try:
            return await client.generate([5], {"max_new_tokens": 2, "ignore_eos": True})
        except EngineError as err:
            return err
    run(engine, unsessioned)
    with RankEngine(engine.url, engine.log_path, WeightPusher(torch.float32, bucket_bytes=16 << 10), 1e-4) as ours:
        ours.release_memory()
        while_released = run(engine, generate)
        stats = ours.push(named, 7, Probe.text(PROBE), expected)
    answer, info = run(engine, lambda c: asyncio.gather(c.generate([5], {"max_new_tokens": 2}), c.model_info()))
    if engine.kind == "embedded":  # its weights are really gone: it refuses rather than answer from nothing
        assert isinstance(while_released, EngineError) and while_released.status == 400
    else:  # SGLang without the memory saver (CPU) frees nothing on release and keeps serving
        assert while_released["meta_info"]["finish_reason"]["type"] == "length"
    assert stats["weight_sync/buckets"] > 2 and stats["weight_sync/probe_gap"] < 1e-4
    assert info["weight_version"] == "7" and answer["meta_info"]["weight_version"] == "7"


@pytest.mark.timeout(300)
def test_the_probe_catches_weights_that_are_not_the_trainers(engine, hf_model):
    original = list(dict(hf_model.named_parameters()).items())
    expected = forward_logprobs(hf_model, PROBE).tolist()
    name = "transformer.h.0.mlp.c_fc.weight"
    wrong = dict(noisy_copy(hf_model, seed=2).named_parameters())[name]
    probe = Probe.text(PROBE)

    async def one_wrong_tensor(client):  # a session that sets no version: the engine still says 11
        await client.post("/begin_weight_update")
        await client.post("/update_weights_from_tensor", {
            "serialized_named_tensors": [serialize_for_engine(flatten_bucket([(name, wrong.detach())]))],
            "load_format": "flattened_bucket", "flush_cache": True})
        await client.post("/end_weight_update")
        return await client.post("/generate", probe.request())
    with RankEngine(engine.url, engine.log_path, WeightPusher(torch.float32, bucket_bytes=64 << 10), 1e-4) as ours:
        first_gap = ours.push(original, 11, probe, expected)["weight_sync/probe_gap"]
        answer = run(engine, one_wrong_tensor)
        with pytest.raises(WeightSyncError, match="mean \\|logprob gap\\|"):
            probe.gap(answer, "11", expected, 1e-4, engine.url)
        with pytest.raises(WeightSyncError, match="reports weight_version '11'"):
            probe.gap(answer, "12", expected, 1e-4, engine.url)
        # the job's push of wrong weights: one line naming the engine, the push and its log
        with pytest.raises(RuntimeError, match=f"engine {engine.url} failed during the weight push of version 12: "
                                               ".*disagrees with the trainer.*its log"):
            ours.push([(name, wrong.detach())], 12, probe, expected)
        restored_gap = ours.push(original, 13, probe, expected)["weight_sync/probe_gap"]
    assert first_gap < 1e-4 and restored_gap < 1e-4


# Time for a long request to be admitted and decoding: SGLang on CPU takes about 19 s over LONG on
# this model, the embedded engine about 0.6 s (a loaded 2-core machine), so it gets less.
SETTLE_S = {"embedded": 0.2, "sglang": 0.5}


async def started(client, kind: str, *rids: str) -> list[asyncio.Task]:
    """Long requests, given time to be admitted and decoding before the test acts on them. One that
    ends first is sent again (twice at most) and what ended it is printed: CI once saw a request on
    SGLang end within the first 0.5 s, which 4 reruns of the suite did not show again."""
    tasks = {rid: asyncio.create_task(client.generate([5], LONG, rid=rid)) for rid in rids}
    for attempt in range(3):
        await asyncio.sleep(SETTLE_S[kind])
        ended = {rid: task.exception() or task.result()["meta_info"] for rid, task in tasks.items() if task.done()}
        if not ended:
            return list(tasks.values())
        print(f"[{kind}] long requests ended before the test could act on them: {ended!r}", file=sys.stderr)
        for rid in ended:
            tasks[rid] = asyncio.create_task(client.generate([5], LONG, rid=rid))
    pytest.fail(f"long requests keep ending before the test can act on them: {ended!r}")


@pytest.mark.timeout(300)
def test_pause_in_place_holds_new_requests_until_continue(engine):
    async def body(client):
        running, = await started(client, engine.kind, "held")
        await client.post("/pause_generation", {"mode": "in_place"})
        blocked = asyncio.create_task(client.generate([6], {"max_new_tokens": 2, "ignore_eos": True}))
        await asyncio.sleep(1.0)
        assert not blocked.done(), "a /generate sent while paused must wait for /continue_generation"
        await client.post("/continue_generation")
        return await running, await blocked
    kept, unblocked = run(engine, body)
    # In place: the running request lost nothing and finished on its own.
    assert kept["meta_info"]["finish_reason"]["type"] == "length" and len(kept["output_ids"]) == LONG["max_new_tokens"]
    assert unblocked["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.timeout(300)
def test_pause_abort_returns_partial_output_and_continue_serves_new_requests_in_full(engine):
    async def body(client):
        running, = await started(client, engine.kind, "paused-one")
        await client.post("/pause_generation", {"mode": "abort"})
        aborted_by_pause = await running
        await client.post("/continue_generation")
        after, = await started(client, engine.kind, "after-continue")
        return aborted_by_pause, await after
    by_pause, after = run(engine, body)
    assert by_pause["meta_info"]["finish_reason"]["type"] == "abort"
    assert 0 < len(by_pause["output_ids"]) < LONG["max_new_tokens"]
    assert len(by_pause["meta_info"]["output_token_logprobs"]) == len(by_pause["output_ids"])
    assert after["meta_info"]["finish_reason"] == {"type": "length", "length": LONG["max_new_tokens"]}


@pytest.mark.timeout(300)
def test_flush_cache_only_when_idle(engine):
    async def body(client):
        running, = await started(client, engine.kind, "busy")
        try:
            busy = await client.flush_cache()
        except EngineError as err:
            busy = err
        await client.post("/pause_generation", {"mode": "abort"})  # the job's way to end what runs
        await running
        await client.post("/continue_generation")
        await asyncio.sleep(0.2)
        return busy, await client.flush_cache()
    busy, idle = run(engine, body)
    assert isinstance(busy, EngineError) and busy.status == 400
    assert not isinstance(idle, EngineError)


@pytest.mark.timeout(60)
def test_a_connection_left_idle_between_rollouts_stays_open(engine):
    """sglang-router reuses a pooled connection that sat idle for up to 50 s (while the ranks train).
    SGLang's own default closes it after 5 s, and the next rollout's requests sent on it failed on a
    GPU ("error sending request"); both engines must keep it open longer than that."""
    url = urlsplit(engine.url)
    connection = http.client.HTTPConnection(url.hostname, url.port, timeout=30)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read() is not None
        opened = connection.sock
        time.sleep(7)
        try:
            connection.request("GET", "/health")
            status = connection.getresponse().status
        except (http.client.RemoteDisconnected, ConnectionError) as err:
            pytest.fail(f"the {engine.kind} engine closed a connection idle for 7 s: {err!r}")
        assert status == 200 and connection.sock is opened  # the same connection, not a new one
    finally:
        connection.close()


@pytest.mark.timeout(60)
def test_the_log_records_every_call_in_one_shape(engine):
    """Both logs hold one access line per request, which the job-level tests compare."""
    calls = engine_calls(engine.log_path.read_text())
    paths = {path for _, path, _ in calls}
    assert {"/generate", "/release_memory_occupation", "/resume_memory_occupation", "/begin_weight_update",
            "/update_weights_from_tensor", "/end_weight_update", "/pause_generation", "/continue_generation",
            "/flush_cache", "/model_info"} <= paths
    assert ("POST", "/update_weights_from_tensor", 400) in calls  # the refused one outside a session


@pytest.mark.timeout(300)
def test_an_input_must_leave_sglangs_reserve_of_the_context(engine):
    # SGLang's scheduler serves context - 1 tokens a request: it refuses an input of context - 6 tokens or more
    # and generates at most context - 2 - input tokens, whatever max_new_tokens asks within the context
    # (workers/engines/client.py; the rollout stops a growing conversation there).
    longest = CONTEXT - 7
    served = {}
    for params in ({"max_new_tokens": 7}, {"max_new_tokens": None}, {}):
        answer = run(engine, lambda c: c.generate([5] * longest, {**params, "ignore_eos": True}))
        served[str(params)] = (answer["meta_info"]["completion_tokens"], answer["meta_info"]["finish_reason"]["type"])
    assert set(served.values()) == {(5, "length")}, served
    with pytest.raises(EngineError) as refused:
        run(engine, lambda c: c.generate([5] * (longest + 1), {"max_new_tokens": 2, "ignore_eos": True}))
    assert refused.value.status == 400
    assert f"Input length ({longest + 1} tokens) exceeds the maximum allowed length ({CONTEXT - 6} tokens)" in \
        refused.value.message


# --------------------------------------------------------------------------- vision-language (issue 71)
#
# Both engines serve the tiny random Qwen2.5-VL of offline/vision.py through SGLang's /generate: `input_ids`
# with one <|image_pad|> per image and `image_data`; each expands the pads itself and runs the image at 3-D
# positions. Both are launched as the job launches them (`start_engine`), which gives SGLang on CPU what a VL
# model needs there (workers/engines/sglang_engine.py: sdpa vision attention, dynamo off, no image cache).
VL_GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


@pytest.fixture(scope="module")
def vl_engines(tiny_model_dir, tmp_path_factory):
    """The same tiny Qwen2.5-VL served by both engines at once: kind -> url, and "model" -> its directory."""
    from offline.vision import save_vision_model

    python = require_sglang_python()
    root = tmp_path_factory.mktemp("vl_conformance")
    model = save_vision_model("qwen2_5_vl", tiny_model_dir, root / "model")
    specs = {"embedded": EngineSpec(kind="embedded", model_path=model, dtype="float32", device="cpu", seed=0,
                                    num_threads=1),
             "sglang": EngineSpec(kind="sglang", model_path=model, dtype="float32", device="cpu", seed=0,
                                  num_threads=1, sglang_python=python, context_length=CONTEXT)}
    with ManagedProcesses() as procs:
        started = {kind: start_engine(spec, root / f"{kind}.log", procs, deadline_s=300, wait=False)
                   for kind, spec in specs.items()}
        for engine in started.values():
            engine.wait_ready(300)
        yield {**{kind: engine.url for kind, engine in started.items()}, "model": model}


@pytest.fixture(scope="module")
def vl_request(vl_engines, tmp_path_factory):
    """One image prompt, a two-image prompt (a file and a data URL; 4 and 2 pads) and a text-only prompt."""
    import base64
    import io

    import numpy as np
    from PIL import Image

    from offline.vision import IMAGE_PAD
    from workers.vision import load_processor

    root = tmp_path_factory.mktemp("vl_images")
    noise = [Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, 56, 3), dtype=np.uint8))
             for seed, height in ((0, 56), (1, 56), (2, 28))]
    for index, image in enumerate(noise[:2]):
        image.save(root / f"image{index}.png")
    encoded = io.BytesIO()
    noise[2].save(encoded, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(encoded.getvalue()).decode()
    processor = load_processor(vl_engines["model"])

    def ids(count, question):
        content = [{"type": "image"}] * count + [{"type": "text", "text": question}]
        text = processor.apply_chat_template([{"role": "user", "content": content}], add_generation_prompt=True,
                                             tokenize=False)
        return processor.tokenizer(text)["input_ids"]
    return {"prompts": [ids(1, "what is it?"), ids(2, "compare them."), ids(0, "hello")],
            "images": [[str(root / "image0.png")], [str(root / "image1.png"), url], []],
            "pad_id": processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD), "root": root}


def vl_run(vl_engines, kind, make_coro):
    return run(Engine(kind, vl_engines[kind], Path()), make_coro)


@pytest.mark.timeout(300)
def test_both_engines_answer_a_vision_language_prompt_alike(vl_engines, vl_request):
    """Greedy ids equal, logprobs within 1e-4 (fp32 both), SGLang's counts of the expanded prompt; the prompt's
    own logprobs too, at every text position (at the image's, meaningless on both, SGLang names token 0)."""
    prompts, images, pad_id = vl_request["prompts"], vl_request["images"], vl_request["pad_id"]
    body = {"input_ids": prompts[0], "image_data": images[0], "return_logprob": True, "logprob_start_len": 0,
            "sampling_params": VL_GREEDY}
    answers = {kind: vl_run(vl_engines, kind, lambda c: asyncio.gather(
        c.post("/generate", body), c.generate(prompts, VL_GREEDY, image_data=images)))
        for kind in ENGINE_KINDS}
    (alone, batch), (sglang_alone, sglang_batch) = answers["embedded"], answers["sglang"]
    for ours, theirs in [(alone, sglang_alone), *zip(batch, sglang_batch)]:
        assert ours["output_ids"] == theirs["output_ids"]
        torch.testing.assert_close(torch.tensor([e[0] for e in ours["meta_info"]["output_token_logprobs"]]),
                                   torch.tensor([e[0] for e in theirs["meta_info"]["output_token_logprobs"]]),
                                   atol=1e-4, rtol=0)
        for key in ("prompt_tokens", "completion_tokens", "image_tokens"):
            assert ours["meta_info"].get(key) == theirs["meta_info"].get(key), key
    assert [answer["meta_info"].get("image_tokens") for answer in batch] == [4, 6, None]
    ours, theirs = alone["meta_info"]["input_token_logprobs"], sglang_alone["meta_info"]["input_token_logprobs"]
    assert len(ours) == len(theirs) == alone["meta_info"]["prompt_tokens"] == len(prompts[0]) + 3
    text = [i for i, entry in enumerate(ours) if entry[1] != pad_id and i > 0]
    assert [ours[i][1] for i in text] == [theirs[i][1] for i in text]
    torch.testing.assert_close(torch.tensor([ours[i][0] for i in text]), torch.tensor([theirs[i][0] for i in text]),
                               atol=1e-4, rtol=0)


@pytest.mark.timeout(300)
def test_image_data_that_cannot_be_served(vl_engines, vl_request):
    """An unreadable image is a 400 with SGLang's words on both. Where SGLang 0.5.23 is lax the embedded
    engine refuses with the same kind of message: a missing file (SGLang: 500) and more images than pads
    (SGLang serves the first ones and logs 'More image data items provided than corresponding tokens found in
    the prompt'). Fewer images than pads is left out: SGLang never answers it (StopIteration raised into a
    Future in its processor)."""
    root, prompt, image = vl_request["root"], vl_request["prompts"][0], vl_request["images"][0][0]
    (root / "notes.png").write_text("not a picture")
    cases = {"unreadable": (prompt, [str(root / "notes.png")]), "missing": (prompt, [str(root / "missing.png")]),
             "extra image": (prompt, [image, image])}

    async def outcome(client, ids, image_data):
        try:
            return 200, await client.generate(ids, VL_GREEDY, image_data=image_data)
        except EngineError as error:
            return error.status, error.message
    # A client per case: SGLang drops the connection of its 500, which a pooled next request would go out on.
    seen = {kind: {name: vl_run(vl_engines, kind, lambda c: outcome(c, *case)) for name, case in cases.items()}
            for kind in ENGINE_KINDS}
    loading = "An exception occurred while loading IMAGE data at index 0: Error while loading data "
    for kind in ENGINE_KINDS:
        status, message = seen[kind]["unreadable"]
        assert status == 400 and message.startswith(loading + str(root / "notes.png")), (kind, message)
    assert seen["embedded"]["missing"] == (400, loading + f"{root / 'missing.png'}: [Errno 2] No such file or "
                                           f"directory: '{root / 'missing.png'}'")
    assert seen["sglang"]["missing"][0] == 500
    assert seen["embedded"]["extra image"] == (400, "prompt has 1 image placeholder token(s) but 2 image(s) were "
                                               "provided")
    status, answer = seen["sglang"]["extra image"]
    assert status == 200 and answer["meta_info"]["image_tokens"] == 4, seen["sglang"]


@pytest.mark.timeout(300)
def test_a_pushed_vision_tower_changes_both_engines_alike(vl_engines, vl_request):
    """Weights pushed under the checkpoint's names (`visual.*`, `model.layers.*`: what SGLang's Qwen2.5-VL
    loader takes) change both engines alike, and pushing the originals back restores both. SGLang 0.5.23 does
    not take the names transformers 5 gives the parameters in memory (`model.visual.*`,
    `model.language_model.*`): its scheduler dies on the first one (KeyError:
    'model.visual.blocks.0.mlp.gate_up_proj.weight'), so the trainer must push checkpoint names to it; the
    embedded engine takes either."""
    from safetensors.torch import load_file

    original = sorted(load_file(str(Path(vl_engines["model"]) / "model.safetensors")).items())
    generator = torch.Generator().manual_seed(4)
    tower = [(name, tensor + torch.randn(tensor.shape, generator=generator) * 0.5) for name, tensor in original
             if name.startswith("visual.")]
    assert tower
    prompt, images = vl_request["prompts"][0], vl_request["images"][0]

    def answers_around_pushes(kind):
        def generate():
            return vl_run(vl_engines, kind, lambda c: c.generate(prompt, VL_GREEDY, image_data=images))
        # one bucket: each costs SGLang on CPU a second
        with RankEngine(vl_engines[kind], Path(), WeightPusher(torch.float32, bucket_bytes=4 << 20), 1e-4) as ours:
            before = generate()
            ours.push(tower, "tower", None, None)
            pushed = generate()
            ours.push(original, "restored", None, None)
            return before, pushed, generate()
    answers = {kind: answers_around_pushes(kind) for kind in ENGINE_KINDS}
    logprobs = {kind: [[e[0] for e in answer["meta_info"]["output_token_logprobs"]] for answer in answers[kind]]
                for kind in ENGINE_KINDS}
    for step in range(3):
        assert answers["embedded"][step]["output_ids"] == answers["sglang"][step]["output_ids"], step
        torch.testing.assert_close(torch.tensor(logprobs["embedded"][step]), torch.tensor(logprobs["sglang"][step]),
                                   atol=1e-4, rtol=0)
    assert answers["sglang"][1]["meta_info"]["weight_version"] == "tower"
    assert max(abs(a - b) for a, b in zip(logprobs["embedded"][1], logprobs["embedded"][0])) > 1e-3
    torch.testing.assert_close(torch.tensor(logprobs["embedded"][2]), torch.tensor(logprobs["embedded"][0]),
                               atol=1e-5, rtol=0)


@pytest.mark.timeout(300)
def test_both_engines_answer_the_weight_probe_of_a_vision_language_policy(vl_engines):
    """The job's probe after each push shows a VL policy a picture (`workers.vision.vision_probe`): both engines
    expand its one pad and give every text token the model's own logprob, as the trainer computes it."""
    from transformers import AutoModelForImageTextToText

    from workers.vision import load_processor, vision_probe

    processor = load_processor(vl_engines["model"])
    probe = vision_probe(processor, processor.tokenizer, probe_token_ids(processor.tokenizer))
    model = AutoModelForImageTextToText.from_pretrained(vl_engines["model"], dtype=torch.float32).eval()
    ids = torch.tensor([probe.ids])
    with torch.no_grad():
        logits = model(input_ids=ids, **probe.images, mm_token_type_ids=(ids == probe.image_pad_id).int()).logits
    expected = torch.log_softmax(logits[0, :-1].float(), -1).gather(-1, ids[0, 1:, None])[:, 0]
    compared = torch.tensor(probe.compared())
    for kind in ENGINE_KINDS:
        answer = vl_run(vl_engines, kind, lambda client: client.post("/generate", probe.request()))
        entries = answer["meta_info"]["input_token_logprobs"]
        assert probe.gap(answer, answer["meta_info"]["weight_version"], expected.tolist(), 1e-4, kind) < 1e-4
        got = torch.tensor([entry[0] for entry in entries[1:]])
        torch.testing.assert_close(got[compared], expected[compared], atol=1e-4, rtol=0, msg=kind)
