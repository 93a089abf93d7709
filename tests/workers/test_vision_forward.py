"""The trainer's forward on vision-language models (issue 71; tiny random Qwen2.5-VL and Qwen3-VL): per-token
logprobs and entropies on micro-batches that carry images equal the model's own logits, one sequence at a
time, in every layout (right and left padding, packed rows, one packed row, shared prompts); the engine's one
pad per image expands to exactly the processor's own ids; the 3-D positions are Qwen's; bad inputs fail
with one clear error."""

import io

import numpy as np
import pytest
import torch
from PIL import Image

from offline.vision import FAMILIES, IMAGE_PAD, save_vision_model
from workers.forward import ForwardSettings, MicroBatch, token_logprobs_and_entropy
from workers.layout import rows_to_batch, pack
from workers.vision import (collapse_image_pads, expand_image_pads, image_token_counts, load_images, load_processor,
                            mrope_position_ids, vision_inputs, with_vision)

PAD_ID = 1  # the tiny tokenizer's [PAD]


@pytest.fixture(scope="module")
def vision_dirs(tmp_path_factory, tiny_model_dir):
    root = tmp_path_factory.mktemp("vision")
    return {family: save_vision_model(family, tiny_model_dir, root / family) for family in FAMILIES}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, vision_dirs):
    from transformers import AutoModelForImageTextToText

    path = vision_dirs[request.param]
    return AutoModelForImageTextToText.from_pretrained(path).eval(), load_processor(path)


def _noise(width, height, seed):
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8)
    return Image.fromarray(pixels)


def _encoded(image):
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


# Per sequence: its images (noise, a solid square; 56x56 is 4 merged tokens, 56 wide by 28 high 2), its
# question and its response length. The first is the shortest, so packing (longest first) reorders sequences
# and their images; the last repeats the first's prompt (image included) for the shared-prompt layout.
SEQUENCES = [
    ([_noise(56, 56, 0)], "what is it?", 3),
    ([Image.new("RGB", (56, 56), (200, 30, 30)), _noise(56, 28, 1)], "compare the two.", 9),
    ([_encoded(_noise(56, 28, 2))], "and this one?", 7),
    ([_noise(56, 56, 0)], "what is it?", 5),
]
PADS_PER_IMAGE = [[4], [4, 2], [2], [4]]


def _messages(images, question):
    return [{"role": "user", "content": [{"type": "image"}] * len(images) + [{"type": "text", "text": question}]}]


def _rows(processor, merge):
    """The trainer's rows (expanded pads, the response's tokens as actions) and each row's images' inputs."""
    generator = torch.Generator().manual_seed(0)
    pad_id = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    rows, images = [], []
    for row_images, question, response in SEQUENCES:
        prompt = processor.apply_chat_template(_messages(row_images, question), add_generation_prompt=True,
                                               tokenize=False)
        engine_ids = processor.tokenizer(prompt)["input_ids"]  # one pad per image: what the engine is sent
        assert engine_ids.count(pad_id) == len(row_images)
        inputs = vision_inputs(processor, row_images)
        ids = expand_image_pads(engine_ids, pad_id, image_token_counts(inputs["image_grid_thw"], merge))
        ids += torch.randint(3, 290, (response,), generator=generator).tolist()
        rows.append({"input_ids": ids, "action_mask": [0] * (len(ids) - response) + [1] * response})
        images.append(inputs)
    return rows, images


def _reference(model, rows, images, temperature):
    """Logprobs and entropies from the model's own forward and logits, one sequence at a time, no padding: its
    3-D positions from the processor's token types (the model's own `get_rope_index`)."""
    width = max(len(row["input_ids"]) for row in rows)
    logprobs, entropy = torch.zeros(len(rows), width), torch.zeros(len(rows), width)
    for i, (row, inputs) in enumerate(zip(rows, images)):
        ids = torch.tensor(row["input_ids"])[None]
        logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                       **inputs).logits[0, :-1] / temperature
        log_probs = torch.log_softmax(logits.float(), -1)
        length = ids.shape[1]
        logprobs[i, 1:length] = log_probs.gather(-1, ids[0, 1:, None]).squeeze(-1)
        entropy[i, 1:length] = -(log_probs.exp() * log_probs).sum(-1)
        mask = torch.tensor(row["action_mask"], dtype=torch.float)
        logprobs[i, :length] *= mask
        entropy[i, :length] *= mask
    return logprobs, entropy


def _left_padded(rows):
    width = max(len(row["input_ids"]) for row in rows)
    return [{"input_ids": [PAD_ID] * (width - len(row["input_ids"])) + row["input_ids"],
             "action_mask": [0] * (width - len(row["input_ids"])) + row["action_mask"],
             "attention_mask": [0] * (width - len(row["input_ids"])) + [1] * len(row["input_ids"])} for row in rows]


def _shift_right(values, rows):
    """Right-padded `[b, T]` values placed as the left-padded rows hold their tokens."""
    out = torch.zeros_like(values)
    for i, row in enumerate(rows):
        n = len(row["input_ids"])
        out[i, values.shape[1] - n:] = values[i, :n]
    return out


def test_forward_matches_the_models_logits_in_every_layout(family):
    model, processor = family
    rows, images = _rows(processor, model.config.vision_config.spatial_merge_size)
    pixel_values = torch.cat([inputs["pixel_values"] for inputs in images])
    grids = torch.cat([inputs["image_grid_thw"] for inputs in images])
    right = with_vision(rows_to_batch(rows, PAD_ID), model, pixel_values, grids)
    left = with_vision(rows_to_batch(_left_padded(rows), PAD_ID), model, pixel_values, grids)
    chunked = ForwardSettings(logits_chunk=5, unchunked_logits_max_bytes=0)
    with torch.no_grad():
        expected = _reference(model, rows, images, temperature=0.7)
        layouts = {"right-padded": right, "packed": pack(right), "one packed row": pack(right, one_row=True),
                   "shared prompts": pack(right, share_prompts=True), "chunked head": MicroBatch(pack(right), chunked)}
        assert len(pack(right, share_prompts=True)["packed_input_ids"].view(-1)) < len(pack(right)["packed_input_ids"].view(-1))
        for name, batch in layouts.items():
            logprobs, entropy = token_logprobs_and_entropy(model, batch, 0.7, actions_only=True)
            torch.testing.assert_close(logprobs, expected[0], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
            torch.testing.assert_close(entropy, expected[1], atol=1e-5, rtol=0, msg=lambda m: f"{name}: {m}")
        logprobs, entropy = token_logprobs_and_entropy(model, left, 0.7, actions_only=True)
        torch.testing.assert_close(logprobs, _shift_right(expected[0], rows), atol=1e-5, rtol=0)
        torch.testing.assert_close(entropy, _shift_right(expected[1], rows), atol=1e-5, rtol=0)
        # Without the images (or with the images swapped) the logprobs differ: the images are really read.
        swapped = {**right, "pixel_values": pixel_values.flip(0)}
        assert not torch.allclose(token_logprobs_and_entropy(model, swapped, 0.7, actions_only=True)[0], expected[0],
                                  atol=1e-3)


def test_the_images_and_the_model_get_gradients_through_packed_rows(family):
    model, processor = family
    rows, images = _rows(processor, model.config.vision_config.spatial_merge_size)
    batch = with_vision(rows_to_batch(rows, PAD_ID), model, torch.cat([inputs["pixel_values"] for inputs in images]),
                        torch.cat([inputs["image_grid_thw"] for inputs in images]))
    model.zero_grad()
    logprobs, _ = token_logprobs_and_entropy(model, pack(batch), actions_only=True)
    logprobs.sum().backward()
    visual = [p.grad for name, p in model.named_parameters() if "visual" in name]
    assert visual and all(grad is not None for grad in visual) and any(grad.abs().sum() > 0 for grad in visual)
    assert model.lm_head.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_expanded_pads_are_the_processors_own_ids(family):
    model, processor = family
    pad_id = model.config.image_token_id
    merge = model.config.vision_config.spatial_merge_size
    tokens = processor.tokenizer.convert_tokens_to_ids(["<|vision_start|>", "<|image_pad|>", "<|vision_end|>"])
    assert tokens == [model.config.vision_start_token_id, pad_id, model.config.vision_end_token_id]
    assert len(set(tokens)) == 3 and min(tokens) >= 300  # new ids, after the tiny tokenizer's 300
    for (row_images, question, _), pads in zip(SEQUENCES, PADS_PER_IMAGE):
        prompt = processor.apply_chat_template(_messages(row_images, question), add_generation_prompt=True,
                                               tokenize=False)
        assert prompt.count("<|vision_start|><|image_pad|><|vision_end|>") == len(row_images)
        own = processor(text=[prompt], images=load_images(row_images), return_tensors="pt")
        counts = image_token_counts(own["image_grid_thw"], merge)
        assert counts == pads
        expanded = expand_image_pads(processor.tokenizer(prompt)["input_ids"], pad_id, counts)
        assert expanded == own["input_ids"][0].tolist()
        torch.testing.assert_close(vision_inputs(processor, row_images)["pixel_values"], own["pixel_values"])


def test_positions_are_qwens_3d_positions_in_every_layout(family):
    model, processor = family
    image, start, end = (processor.tokenizer.convert_tokens_to_ids(token)
                         for token in ("<|image_pad|>", "<|vision_start|>", "<|vision_end|>"))
    # text, then a 2x2 grid of merged patches (a 4x4 grid of patches), then text: the image's tokens all sit at
    # time 2 over rows 2..3 and columns 2..3; the text after it resumes at 2 + max(2, 2) = 4.
    ids = [5, start] + [image] * 4 + [end, 6]
    expected = torch.tensor([[0, 1, 2, 2, 2, 2, 4, 5], [0, 1, 2, 2, 3, 3, 4, 5], [0, 1, 2, 3, 2, 3, 4, 5]])
    rows = [{"input_ids": [7, 8, 9], "action_mask": [0, 1, 1]}, {"input_ids": ids, "action_mask": [0] * 8}]
    grid = torch.tensor([[1, 4, 4]])
    padded = rows_to_batch(rows, PAD_ID)
    positions = mrope_position_ids(model, padded, grid)
    torch.testing.assert_close(positions[:, 1], expected)
    torch.testing.assert_close(positions[:, 0], torch.tensor([0, 1, 2, 0, 0, 0, 0, 0]).expand(3, -1))
    left = rows_to_batch(_left_padded(rows), PAD_ID)
    torch.testing.assert_close(mrope_position_ids(model, left, grid)[:, 0, 5:], torch.tensor([0, 1, 2]).expand(3, -1))
    packed = pack(padded, one_row=True)  # the longer sequence first, then the text-only one, restarted at 0
    torch.testing.assert_close(mrope_position_ids(model, packed, grid)[:, 0],
                               torch.cat([expected, torch.tensor([0, 1, 2]).expand(3, -1)], dim=1))
    with pytest.raises(ValueError, match="hold 1 images .* image_grid_thw has 2"):
        mrope_position_ids(model, padded, grid.repeat(2, 1))


def test_bad_pads_and_unreadable_images_raise_one_clear_error(tmp_path):
    assert expand_image_pads([3, 9, 4, 9], 9, [2, 1]) == [3, 9, 9, 4, 9]
    assert collapse_image_pads([3, 9, 9, 4, 9], 9) == [3, 9, 4, 9]  # what the engine is sent back
    with pytest.raises(ValueError, match=r"^the token ids hold 2 image pad tokens \(id 9\) for 3 images"):
        expand_image_pads([3, 9, 4, 9], 9, [2, 1, 4])
    with pytest.raises(ValueError, match=r"^the token ids hold 0 image pad tokens \(id 9\) for 1 images"):
        expand_image_pads([3, 4], 9, [4])
    broken = tmp_path / "broken.png"
    broken.write_bytes(b"not a png")
    with pytest.raises(ValueError, match=r"^image 1 \('.*broken.png'\) is not a readable image"):
        load_images([_noise(8, 8, 0), broken])
    with pytest.raises(ValueError, match=r"^image 0 \(5 bytes\) is not a readable image"):
        load_images([b"\x89PNG!"])
    with pytest.raises(ValueError, match=r"^image 0 \('.*missing.png'\) is not a readable image"):
        load_images(tmp_path / "missing.png")
    opened = load_images([_encoded(_noise(8, 4, 0)), Image.new("L", (3, 3))])
    assert [(image.mode, image.size) for image in opened] == [("RGB", (8, 4)), ("RGB", (3, 3))]


def test_inconsistent_images_raise_one_clear_error(family):
    model, processor = family
    rows, images = _rows(processor, model.config.vision_config.spatial_merge_size)
    grids = torch.cat([inputs["image_grid_thw"] for inputs in images])
    pixel_values = torch.cat([inputs["pixel_values"] for inputs in images])
    # The last sequence repeats the first one's prompt ids but shows another image under the same pads: sharing
    # that prompt would show the first image to both, so the forward refuses rather than train on it.
    other = vision_inputs(processor, [_noise(56, 56, 9)])["pixel_values"]
    swapped = torch.cat([pixel_values[:-len(other)], other])
    batch = with_vision(rows_to_batch(rows, PAD_ID), model, swapped, grids)
    token_logprobs_and_entropy(model, pack(batch), actions_only=True)  # unshared: each sequence its own image
    with pytest.raises(ValueError, match="^rows packed as sharing a prompt show different images"):
        token_logprobs_and_entropy(model, pack(batch, share_prompts=True), actions_only=True)
    # Engine ids not expanded (one pad per image) do not match their grids.
    pad_id = model.config.image_token_id
    short = [{"input_ids": [5, pad_id, 6, 7], "action_mask": [0, 0, 1, 1]}]
    with pytest.raises(ValueError, match="^row 0: the image at column 1 has 1 pads but its grid makes 4"):
        with_vision(rows_to_batch(short, PAD_ID), model, pixel_values[:16], torch.tensor([[1, 4, 4]]))
