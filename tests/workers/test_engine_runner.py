"""The embedded engine's decode loop in-process: rows joining and leaving at chosen steps, the slot
KV cache's re-layouts, vectorised sampling, and per-request seeds, checked against a plain forward."""

import asyncio
import queue

import pytest
import torch

from workers.engines.embedded.batch import GenRequest, SamplingParams
from workers.engines.embedded.runner import ModelRunner
from workers.engines.embedded.sampling import RowSampling, sample

from tests.workers.small_models import save_small_gpt2

CONTEXT = 128


@pytest.fixture(scope="module")
def model_dir(tiny_model_dir, tmp_path_factory):
    return save_small_gpt2(tiny_model_dir, tmp_path_factory.mktemp("runner_model"), n_layer=2, n_embd=32,
                           n_positions=CONTEXT)


@pytest.fixture(scope="module")
def runner(model_dir):
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield ModelRunner(model_dir, "cpu", torch.float32, seed=0)
    torch.set_num_threads(before)  # the later tests of this process keep their own count


@pytest.fixture(scope="module")
def hf_model(model_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()


class StagedQueue:
    """Hands each request to the decode loop once it has polled `step` times (it polls once per step)."""

    def __init__(self, staged: list[tuple[int, GenRequest]]):
        self.staged = sorted(staged, key=lambda item: item[0])
        self.polls = 0

    def get_nowait(self) -> GenRequest:
        if self.staged and self.staged[0][0] <= self.polls:
            return self.staged.pop(0)[1]
        self.polls += 1
        raise queue.Empty


def decode(runner, staged: list[tuple[int, list[int], dict]], max_batch_size: int = 64) -> list[tuple[GenRequest, dict]]:
    """Run (join step, prompt, sampling params) through the decode loop; results in the given order."""
    loop = asyncio.new_event_loop()
    try:
        requests = [GenRequest(rid=str(i), prompt_ids=prompt, params=SamplingParams(**params), return_logprob=True,
                               future=loop.create_future()) for i, (_, prompt, params) in enumerate(staged)]
        incoming = StagedQueue([(step, r) for (step, _, _), r in zip(staged, requests)])
        reasons = {}
        while incoming.staged:  # the loop returns whenever the batch runs empty
            runner.run_until_idle(incoming, max_batch_size, lambda r, reason: reasons.__setitem__(r.rid, reason))
        return [(r, reasons[r.rid]) for r in requests]
    finally:
        loop.close()


def plain_logprobs(model, prompt, output_ids, temperature):
    ids = torch.tensor([prompt + output_ids])
    with torch.no_grad():
        logits = model(ids).logits[0, len(prompt) - 1:-1].float()
    return torch.log_softmax(logits / temperature, -1), logits


@pytest.mark.timeout(120)
def test_rows_joining_and_leaving_at_any_step_match_a_plain_forward(runner, hf_model):
    relayouts_before = runner.stats["kv_relayouts"]
    staged = [
        (0, [40, 41], {"max_new_tokens": 30, "temperature": 0.7, "ignore_eos": True}),
        (0, [5, 6, 7, 8, 9], {"max_new_tokens": 5, "temperature": 1.0, "ignore_eos": True}),  # leaves first
        (2, list(range(10, 40)), {"max_new_tokens": 12, "temperature": 0.7, "ignore_eos": True}),  # longer than the window
        (2, [12], {"max_new_tokens": 9, "temperature": 0.0, "ignore_eos": True}),  # greedy
        (6, [13, 14, 15, 16], {"max_new_tokens": 10, "temperature": 0.9, "top_k": 5, "top_p": 0.8, "ignore_eos": True}),
        (7, [17, 18], {"max_new_tokens": 40, "temperature": 1.3, "ignore_eos": True}),  # needs more columns
    ]
    results = decode(runner, staged)
    assert runner.stats["kv_relayouts"] - relayouts_before >= 2  # the long prompt and the long request moved the window
    for (_, prompt, params), (request, reason) in zip(staged, results):
        assert reason == {"type": "length", "length": params["max_new_tokens"]}
        assert len(request.output_ids) == len(request.logprobs) == params["max_new_tokens"]
        temperature = params["temperature"] or 1.0  # greedy logprobs are unscaled
        logprobs, logits = plain_logprobs(hf_model, prompt, request.output_ids, temperature)
        expected = logprobs.gather(-1, torch.tensor(request.output_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(request.logprobs), expected, atol=1e-4, rtol=0)
        if params["temperature"] == 0:
            assert request.output_ids == logits.argmax(-1).tolist()
        if "top_k" in params:  # every sampled token is among the 5 most likely
            top5 = logits.topk(5, dim=-1).indices
            assert all(tok in row.tolist() for tok, row in zip(request.output_ids, top5))


@pytest.mark.timeout(120)
def test_requests_with_one_prompt_are_prefilled_once_and_decode_as_if_alone(runner, hf_model):
    group = [40, 41, 42, 43, 44, 45]
    params = {"max_new_tokens": 12, "temperature": 1.0, "ignore_eos": True}
    staged = ([(0, group, {**params, "sampling_seed": seed}) for seed in range(4)]  # a GRPO group of 4
              + [(0, [7, 8], params)]
              + [(3, group, {**params, "sampling_seed": 10 + seed}) for seed in range(3)])  # the same prompt, later
    prefilled = runner.stats["prompts_prefilled"]
    results = decode(runner, staged)
    assert runner.stats["prompts_prefilled"] - prefilled == 3  # two distinct prompts at step 0, one at step 3
    for (_, prompt, _), (request, _) in zip(staged, results):
        logprobs, _ = plain_logprobs(hf_model, prompt, request.output_ids, 1.0)
        expected = logprobs.gather(-1, torch.tensor(request.output_ids)[:, None]).squeeze(-1)
        torch.testing.assert_close(torch.tensor(request.logprobs), expected, atol=1e-4, rtol=0)
    alone = decode(runner, [(0, group, {**params, "sampling_seed": 2})])[0][0]
    assert results[2][0].output_ids == alone.output_ids  # seeded: the same tokens with or without its group
    assert len({tuple(request.output_ids) for request, _ in results[:4]}) > 1


@pytest.mark.timeout(120)
def test_a_finished_batch_frees_its_kv_cache_without_the_cycle_collector(runner):
    import gc

    from workers.engines.embedded.kv_cache import SlotCache

    gc.collect()
    gc.disable()  # what is left now lives on until the cyclic collector happens to run
    try:
        decode(runner, [(0, [40 + i, 41], {"max_new_tokens": 6, "ignore_eos": True}) for i in range(8)])
        assert not [o for o in gc.get_objects() if isinstance(o, SlotCache)]
    finally:
        gc.enable()


@pytest.mark.timeout(120)
def test_stop_tokens_end_rows_mid_batch_and_others_continue(runner, hf_model):
    free = {"max_new_tokens": 60, "temperature": 1.5, "ignore_eos": False}
    first = decode(runner, [(0, [20], {**free, "sampling_seed": 3})])[0][0]
    stop_id = first.output_ids[4]  # a token this seeded request is known to sample
    staged = [(0, [20], {**free, "sampling_seed": 3, "stop_token_ids": [stop_id]}),
              (0, [21, 22], {"max_new_tokens": 20, "temperature": 0.7, "ignore_eos": True}),
              (1, [23], {"max_new_tokens": 15, "temperature": 0.7, "ignore_eos": True, "stop_token_ids": [stop_id]})]
    (stopped, reason), (other, other_reason), (ignoring, _) = decode(runner, staged)
    cut = first.output_ids.index(stop_id) + 1
    assert stopped.output_ids == first.output_ids[:cut] and reason == {"type": "stop", "matched": stop_id}
    assert other_reason["type"] == "length" and len(other.output_ids) == 20
    assert len(ignoring.output_ids) == 15  # ignore_eos also ignores stop_token_ids (SGLang)
    logprobs, _ = plain_logprobs(hf_model, [21, 22], other.output_ids, 0.7)
    expected = logprobs.gather(-1, torch.tensor(other.output_ids)[:, None]).squeeze(-1)
    torch.testing.assert_close(torch.tensor(other.logprobs), expected, atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_a_seeded_request_samples_the_same_tokens_whatever_else_runs(runner):
    seeded = {"max_new_tokens": 25, "temperature": 1.0, "ignore_eos": True, "sampling_seed": 1234}
    alone = decode(runner, [(0, [30, 31, 32], seeded)])[0][0]
    crowd = [(0, [7 + i] * (1 + i % 5), {"max_new_tokens": 10 + i, "temperature": 0.8, "ignore_eos": True})
             for i in range(12)]
    in_crowd = decode(runner, crowd[:6] + [(3, [30, 31, 32], seeded)] + crowd[6:])[6][0]
    other_seed = decode(runner, [(0, [30, 31, 32], {**seeded, "sampling_seed": 99})])[0][0]
    assert in_crowd.output_ids == alone.output_ids
    torch.testing.assert_close(torch.tensor(in_crowd.logprobs), torch.tensor(alone.logprobs), atol=1e-5, rtol=0)
    assert other_seed.output_ids != alone.output_ids


def test_inverse_cdf_sampling_follows_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0]])
    rows, temperature = 40000, 0.8
    probs = torch.softmax(logits / temperature, -1)[0]

    def frequencies(**params):
        settings = dict(temperature=temperature, top_k=-1, top_p=1.0, max_new_tokens=1, sampling_seed=None)
        settings.update(params)
        row_params = [SamplingParams(**settings)] * rows
        uniforms = torch.rand((rows, 1), generator=torch.Generator().manual_seed(0))
        sampling = RowSampling.build(row_params, uniforms, 5, torch.device("cpu"))
        tokens, logprobs = sample(logits.expand(rows, -1), sampling, torch.zeros(rows, dtype=torch.long))
        # Logprobs are over the full vocabulary at the temperature, whatever the filter.
        torch.testing.assert_close(logprobs, probs.log()[tokens], atol=1e-5, rtol=0)
        return torch.bincount(tokens, minlength=5).float() / rows

    torch.testing.assert_close(frequencies(), probs, atol=0.01, rtol=0)
    top2 = torch.cat([probs[:2] / probs[:2].sum(), torch.zeros(3)])
    torch.testing.assert_close(frequencies(top_k=2), top2, atol=0.01, rtol=0)
    # top_p: keep the smallest prefix whose mass reaches top_p (here the first two tokens).
    torch.testing.assert_close(frequencies(top_p=float(probs[0]) + 0.01), top2, atol=0.01, rtol=0)
    assert frequencies(top_k=1)[0] == 1.0 and frequencies(top_p=1e-6)[0] == 1.0


def test_shared_tensors_are_served_in_place_until_a_later_session_replaces_them(runner):
    """Weight loading adopts shared CPU tensors (no copy); settling a session copies out what an
    older session left, so the sender may reuse that buffer."""
    name = "transformer.h.0.mlp.c_fc.bias"
    other = "transformer.h.1.mlp.c_fc.bias"
    params = dict(runner.model.named_parameters())
    original = {n: params[n].detach().clone() for n in (name, other)}
    first = original[name].clone().share_memory_()
    runner.load_tensors([(name, first), (other, original[other].clone().share_memory_())], None, session=1)
    first.add_(1.0)  # the sender writes its buffer: the engine serves these very bytes
    assert torch.equal(params[name].detach(), original[name] + 1.0)
    plain = original[other].clone()  # not shared: copied in
    runner.load_tensors([(other, plain)], None, session=2)
    plain.add_(5.0)
    assert torch.equal(params[other].detach(), original[other])
    assert runner.settle_weights(session=2) == 1  # `name` still lived in session 1's buffer
    first.add_(1.0)
    assert torch.equal(params[name].detach(), original[name] + 1.0)  # copied out: no longer the sender's
    runner.load_tensors([(name, original[name]), (other, original[other])], None, session=3)
