"""The embedded engine serves a vision-language model through SGLang's /generate (issue 71): `input_ids` with
one image pad per image plus `image_data`. Its greedy tokens and logprobs are a plain transformers decode of
the processor's own expanded ids and pixel values; images matter (another image, another answer); a weight
push reaches the vision tower; bad images and pad counts get a 400 in SGLang's words, and never fail the
rows decoded beside them."""

import asyncio
import base64
import copy
import io
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from offline.vision import IMAGE_PAD, save_vision_model
from workers.engines.client import EngineClient, EngineError
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.engines.rank_engine import RankEngine
from workers.engines.weights import Probe, WeightPusher, probe_token_ids
from workers.procs import ManagedProcesses
from workers.vision import load_processor, vision_probe

GREEDY = {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True}


def noise(width, height, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


def data_url(image):
    out = io.BytesIO()
    image.save(out, format="PNG")
    return "data:image/png;base64," + base64.b64encode(out.getvalue()).decode()


@pytest.fixture(scope="module")
def vl_dir(tiny_model_dir, tmp_path_factory):
    return save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path_factory.mktemp("vl_model"))


@pytest.fixture(scope="module")
def images(tmp_path_factory):
    """Two 56x56 noise images (4 pads each) as files and a 56x28 one (2 pads) as a data URL."""
    root = tmp_path_factory.mktemp("images")
    pictures = [noise(56, 56, 0), noise(56, 56, 1), noise(56, 28, 2)]
    for index, picture in enumerate(pictures[:2]):
        picture.save(root / f"image{index}.png")
    return {"pictures": pictures, "data": [str(root / "image0.png"), str(root / "image1.png"), data_url(pictures[2])]}


@pytest.fixture(scope="module")
def processor(vl_dir):
    return load_processor(vl_dir)


@pytest.fixture(scope="module")
def model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def engine_url(vl_dir, tmp_path_factory):
    spec = EngineSpec(kind="embedded", model_path=vl_dir, dtype="float32", device="cpu", seed=0, num_threads=1)
    with ManagedProcesses() as procs:
        yield start_engine(spec, tmp_path_factory.mktemp("vl_engine") / "engine.log", procs, deadline_s=120).url


def run(url, make_coro):
    async def main():
        async with EngineClient(url, timeout_s=120) as client:
            return await make_coro(client)
    return asyncio.run(main())


def prompt_text(processor, count, question="what is it?"):
    messages = [{"role": "user", "content": [{"type": "image"}] * count + [{"type": "text", "text": question}]}]
    return processor.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)


def engine_ids(processor, count, question="what is it?"):
    """What the engine is sent: the tokenizer's ids, one pad per image."""
    return processor.tokenizer(prompt_text(processor, count, question))["input_ids"]


def hf_greedy(model, processor, pictures, steps, question="what is it?"):
    """A plain transformers greedy decode: the processor expands the pads and makes the pixel values, the
    model finds its own 3-D positions; the whole sequence again at every step (no cache)."""
    inputs = processor(text=[prompt_text(processor, len(pictures), question)], images=pictures or None,
                       return_tensors="pt")
    ids = inputs["input_ids"]
    images = {key: inputs[key] for key in ("pixel_values", "image_grid_thw") if key in inputs}
    pad_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    tokens, logprobs = [], []
    with torch.no_grad():
        for _ in range(steps):
            types = {"mm_token_type_ids": (ids == pad_id).int()} if images else {}
            logits = model(input_ids=ids, **images, **types).logits[0, -1].float()
            token = int(logits.argmax())
            tokens.append(token)
            logprobs.append(float(torch.log_softmax(logits, -1)[token]))
            ids = torch.cat([ids, torch.tensor([[token]])], dim=1)
    return inputs["input_ids"][0].tolist(), tokens, logprobs


def check_matches(answer, expected_tokens, expected_logprobs):
    assert answer["output_ids"] == expected_tokens
    got = torch.tensor([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]])
    torch.testing.assert_close(got, torch.tensor(expected_logprobs), atol=1e-4, rtol=0)


@pytest.mark.timeout(120)
def test_greedy_generation_with_an_image_is_a_plain_transformers_decode(engine_url, model, processor, images):
    ids = engine_ids(processor, 1)
    prompt_only = {"input_ids": ids, "image_data": [images["data"][0]], "return_logprob": True, "logprob_start_len": 0,
                   "sampling_params": {"max_new_tokens": 0}}  # the weight probe's and a teacher's request
    answer, with_prompt, prefill = run(engine_url, lambda c: asyncio.gather(
        c.generate(ids, GREEDY, image_data=images["data"][0]),
        c.post("/generate", {**prompt_only, "sampling_params": GREEDY}), c.post("/generate", prompt_only)))
    expanded, tokens, logprobs = hf_greedy(model, processor, images["pictures"][:1], GREEDY["max_new_tokens"])
    check_matches(answer, tokens, logprobs)
    assert answer["output_ids"] == with_prompt["output_ids"]
    # SGLang's counts: the expanded prompt, and its image's pads.
    assert answer["meta_info"]["prompt_tokens"] == len(expanded) == len(ids) + 3
    assert answer["meta_info"]["image_tokens"] == 4
    assert [entry[1] for entry in with_prompt["meta_info"]["input_token_logprobs"]] == expanded
    assert prefill["output_ids"] == [] and prefill["meta_info"]["image_tokens"] == 4
    torch.testing.assert_close(torch.tensor([e[0] for e in prefill["meta_info"]["input_token_logprobs"][1:]]),
                               torch.tensor([e[0] for e in with_prompt["meta_info"]["input_token_logprobs"][1:]]),
                               atol=1e-5, rtol=0)


@pytest.mark.timeout(120)
def test_images_matter_and_mixed_batches_decode_each_row_as_alone(engine_url, model, processor, images):
    """A batch: the same ids with two different images (never one shared prefill), two images in one prompt
    (one from a data URL), and a text-only row; each row as the plain decode of its own prompt."""
    one, two, text = engine_ids(processor, 1), engine_ids(processor, 2, "compare them."), engine_ids(processor, 0)
    data = images["data"]
    batch = run(engine_url, lambda c: c.generate([one, one, two, text], GREEDY,
                                                 image_data=[[data[0]], [data[1]], [data[1], data[2]], []]))
    pictures = images["pictures"]
    for answer, row_pictures, question in [(batch[0], pictures[:1], "what is it?"), (batch[1], pictures[1:2], "what is it?"),
                                           (batch[2], pictures[1:], "compare them."), (batch[3], [], "what is it?")]:
        _, tokens, logprobs = hf_greedy(model, processor, row_pictures, GREEDY["max_new_tokens"], question)
        check_matches(answer, tokens, logprobs)
    assert [answer["meta_info"].get("image_tokens") for answer in batch] == [4, 4, 6, None]
    first, second = ([entry[0] for entry in answer["meta_info"]["output_token_logprobs"]] for answer in batch[:2])
    assert batch[0]["output_ids"] != batch[1]["output_ids"] or first != second


@pytest.mark.timeout(120)
def test_a_weight_push_reaches_the_vision_tower(engine_url, model, processor, images):
    ids = engine_ids(processor, 1)
    changed = copy.deepcopy(model)
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if ".visual." in f".{name}":
                param.add_(torch.randn(param.shape, generator=generator) * 0.5)
    tower = [(name, param) for name, param in changed.named_parameters() if ".visual." in f".{name}"]
    assert tower, "the model has no vision tower parameters under 'visual'"
    def generate():
        return run(engine_url, lambda client: client.generate(ids, GREEDY, image_data=images["data"][0]))
    with RankEngine(engine_url, Path("engine.log"), WeightPusher(torch.float32, bucket_bytes=64 << 10), 1e-4) as ours:
        ours.push(tower, "tower", None, None)  # the vision tower alone: the language model is untouched
        pushed = generate()
        ours.push(list(model.named_parameters()), "restored", None, None)
        restored = generate()
    _, tokens, logprobs = hf_greedy(changed, processor, images["pictures"][:1], GREEDY["max_new_tokens"])
    check_matches(pushed, tokens, logprobs)
    assert pushed["meta_info"]["weight_version"] == "tower"
    _, tokens, original = hf_greedy(model, processor, images["pictures"][:1], GREEDY["max_new_tokens"])
    check_matches(restored, tokens, original)
    assert pushed["output_ids"] != restored["output_ids"] or max(abs(a - b) for a, b in zip(logprobs, original)) > 1e-3


def probe_expectation(model, probe):
    """The model's own logprob of each probe token after the first (its picture through the tower)."""
    images = probe.images or {}
    ids = torch.tensor([probe.ids])
    types = {"mm_token_type_ids": (ids == probe.image_pad_id).int()} if images else {}
    with torch.no_grad():
        logits = model(input_ids=ids, **images, **types).logits[0, :-1].float()
    return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].tolist()


@pytest.mark.timeout(120)
def test_the_weight_probe_of_a_vision_language_policy_checks_its_vision_tower(engine_url, model, processor):
    """After a push the job compares engine and trainer on a probe; a VL policy's shows a picture, so a vision tower
    that is not the trainer's fails the check, which a text-only probe passes (it never runs the tower)."""
    text = Probe.text(probe_token_ids(processor.tokenizer))
    probe = vision_probe(processor, processor.tokenizer, text.ids)
    assert probe.engine_ids.count(probe.image_pad_id) == 1 and probe.ids.count(probe.image_pad_id) == 4
    changed = copy.deepcopy(model)
    with torch.no_grad():
        for name, param in changed.named_parameters():
            if ".visual." in f".{name}":
                param.add_(torch.randn(param.shape, generator=torch.Generator().manual_seed(5)) * 0.5)
    tower = [(name, param) for name, param in changed.named_parameters() if ".visual." in f".{name}"]
    expected, expected_text = probe_expectation(model, probe), probe_expectation(model, text)
    with RankEngine(engine_url, Path("engine.log"), WeightPusher(torch.float32, bucket_bytes=64 << 10), 1e-4) as ours:
        # the trainer still holds the original: the text probe passes, the picture's does not
        text_gap = ours.push(tower, "wrong tower", text, expected_text)["weight_sync/probe_gap"]
        with pytest.raises(RuntimeError, match="disagrees with the trainer"):
            ours.push(tower, "wrong tower", probe, expected)
        changed_gap = ours.push(tower, "wrong tower", probe, probe_expectation(changed, probe))["weight_sync/probe_gap"]
        restored_gap = ours.push(list(model.named_parameters()), "restored", probe, expected)["weight_sync/probe_gap"]
    assert text_gap < 1e-5 and changed_gap < 1e-5 and restored_gap < 1e-5


@pytest.mark.timeout(120)
def test_bad_images_and_pad_counts_are_400s_in_sglangs_words(engine_url, processor, images, tmp_path):
    not_an_image = tmp_path / "notes.png"
    not_an_image.write_text("not a picture")
    one = engine_ids(processor, 1)
    cases = [(one, str(tmp_path / "missing.png"), "An exception occurred while loading IMAGE data at index 0: "
              f"Error while loading data {tmp_path / 'missing.png'}: [Errno 2] No such file or directory"),
             (one, str(not_an_image), "An exception occurred while loading IMAGE data at index 0"),
             (one, [images["data"][0], images["data"][1]], "prompt has 1 image placeholder token(s) but 2 image(s)"),
             (engine_ids(processor, 2), images["data"][0], "prompt has 2 image placeholder token(s) but 1 image(s)"),
             (one, None, "prompt has 1 image placeholder token(s) but 0 image(s)")]

    async def body(client):
        # A good request decoded beside the bad ones: a bad one is refused alone.
        good = asyncio.create_task(client.generate(one, GREEDY, image_data=images["data"][0]))
        errors = []
        for ids, image_data, _ in cases:
            try:
                await client.generate(ids, GREEDY, image_data=image_data)
                errors.append(None)
            except EngineError as error:
                errors.append(error)
        return errors, await good
    errors, good = run(engine_url, body)
    for error, (_, _, message) in zip(errors, cases):
        assert error is not None and error.status == 400 and message in error.message, (message, error)
    assert good["meta_info"]["finish_reason"]["type"] == "length"


@pytest.mark.timeout(120)
def test_a_qwen3_vl_model_with_two_images_is_a_plain_transformers_decode(tiny_model_dir, tmp_path):
    """Qwen3-VL: interleaved 3-D rotary sections and the vision tower's deepstack features, 16-pixel patches
    (a 64x64 image is 4 pads, 64x32 is 2)."""
    from transformers import AutoModelForImageTextToText

    path = save_vision_model("qwen3_vl", tiny_model_dir, tmp_path / "qwen3_vl")
    processor, model = load_processor(path), AutoModelForImageTextToText.from_pretrained(path).eval()
    pictures = [noise(64, 64, 0), noise(64, 32, 1)]
    pictures[0].save(tmp_path / "square.png")
    spec = EngineSpec(kind="embedded", model_path=path, dtype="float32", device="cpu", seed=0, num_threads=1)
    with ManagedProcesses() as procs:
        url = start_engine(spec, tmp_path / "engine.log", procs, deadline_s=120).url
        answer = run(url, lambda c: c.generate(engine_ids(processor, 2, "compare them."), GREEDY,
                                               image_data=[str(tmp_path / "square.png"), data_url(pictures[1])]))
    _, tokens, logprobs = hf_greedy(model, processor, pictures, GREEDY["max_new_tokens"], "compare them.")
    check_matches(answer, tokens, logprobs)
    assert answer["meta_info"]["image_tokens"] == 6
