"""Images from a prompt file to a trajectory (issue 71, vision-language RL): rows show images through an `images`
column and/or chat image parts; the prompt encodes to the engine's ids (one image pad per image, between the
vision markers) with its images kept as RGB PIL images; an unreadable image is one line naming the row and the
image (the job stops, or the row is skipped); the trajectory trains on the processor's expanded ids, whose
collapse is what the engine is sent, and later turns extend that same sequence."""

import asyncio
import base64
import io
import json
import logging

import pytest
from PIL import Image

from envs.base import Env, StepResult
from envs.pool import EnvPool
from offline.vision import IMAGE_PAD, VISION_END, VISION_START, save_vision_model
from rl_core.data import PromptDataError, load_prompt_dataset
from rl_core.prompt_encoding import PromptEncoder
from rl_core.rollout.prompts import PromptLoader, PromptSamples
from rl_core.rollout.rollout import RolloutParts, RolloutSettings, rollout
from rl_core.rollout.trajectory import TrajectoryBuilder, parse_generation
from workers.vision import collapse_image_pads, expand_image_pads, image_token_counts, load_images, load_processor, \
    vision_inputs

RED, BLUE, GREEN = (200, 30, 30), (20, 40, 220), (10, 180, 60)


@pytest.fixture(scope="module")
def processor(tmp_path_factory, tiny_model_dir):
    return load_processor(save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path_factory.mktemp("vl") / "model"))


def _png(colour, size=(56, 56)) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, colour).save(out, format="PNG")
    return out.getvalue()


def _write_prompts(folder, broken: bool = True):
    """Rows: an image part with its own (relative) path; a placeholder part taking the `images` column; a plain
    string content with two images in the column (placed before the text); a data URL; and an unreadable image."""
    (folder / "red.png").write_bytes(_png(RED))
    (folder / "blue.png").write_bytes(_png(BLUE, (56, 28)))
    (folder / "broken.png").write_bytes(b"not a png at all")
    green = "data:image/png;base64," + base64.b64encode(_png(GREEN)).decode()
    user = lambda content: [{"role": "user", "content": content}]  # noqa: E731
    rows = [{"messages": user([{"type": "image", "image": "red.png"}, {"type": "text", "text": "what colour?"}]),
             "answer": "red"},
            {"messages": user([{"type": "text", "text": "and this?"}, {"type": "image"}]), "images": ["blue.png"],
             "answer": "blue"},
            {"messages": user("compare them."), "images": ["blue.png", str(folder / "red.png")], "answer": "both"},
            {"messages": user([{"type": "image", "image": green}, {"type": "text", "text": "this?"}]),
             "answer": "green"}]
    if broken:
        rows.insert(2, {"messages": user([{"type": "image"}, {"type": "image"}, {"type": "text", "text": "?"}]),
                        "images": ["red.png", "broken.png"], "answer": "none"})
    path = folder / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _colours(images):
    return [image.getpixel((0, 0)) for image in images]


def test_an_unreadable_image_is_one_line_naming_the_row_and_the_image(tmp_path, caplog):
    path = _write_prompts(tmp_path)
    with pytest.raises(PromptDataError) as stopped:
        load_prompt_dataset(path, text_key=None)
    message = str(stopped.value)
    assert "\n" not in message
    assert message.startswith(f"{path}, row 3: image 1 ('{tmp_path / 'broken.png'}') is not a readable image")
    assert "data.on_malformed=skip" in message
    with caplog.at_level(logging.WARNING, logger="rl_core.data"):
        dataset = load_prompt_dataset(path, text_key=None, on_malformed="skip")
    assert (len(dataset), dataset.skipped) == (4, 1)
    assert [row["answer"] for row in dataset.rows] == ["red", "blue", "both", "green"]
    lines = [record.getMessage() for record in caplog.records]
    assert len(lines) == 1 and lines[0].startswith(f"{path}, row 3: image 1 (") and "broken.png" in lines[0]
    # a missing file, and image parts that the images column does not fill, are bad rows too
    (tmp_path / "more.jsonl").write_text(
        json.dumps({"prompt": "x", "images": ["gone.png"]}) + "\n" +
        json.dumps({"prompt": [{"role": "user", "content": [{"type": "image"}, {"type": "image"}]}],
                    "images": ["red.png"]}) + "\n")
    with pytest.raises(PromptDataError, match=r"more.jsonl, row 1: image 0 \('.*gone.png'\) is not a readable image"):
        load_prompt_dataset(tmp_path / "more.jsonl", text_key="prompt")
    (tmp_path / "more.jsonl").write_text("\n".join((tmp_path / "more.jsonl").read_text().splitlines()[1:]) + "\n")
    with pytest.raises(PromptDataError, match="row 1: its messages have 2 image parts .* has 1 images"):
        load_prompt_dataset(tmp_path / "more.jsonl", text_key="prompt")


def test_prompts_encode_to_one_pad_per_image_with_their_images(tmp_path, processor):
    tokenizer = processor.tokenizer
    dataset = load_prompt_dataset(_write_prompts(tmp_path, broken=False), text_key=None)
    items = PromptLoader(dataset, batch_size=4, seed=0, encode=PromptEncoder(tokenizer, 200), shuffle=False).next_batch()
    assert [_colours(item.images) for item in items] == [[RED], [BLUE], [BLUE, RED], [GREEN]]
    assert all(image.mode == "RGB" for item in items for image in item.images)
    assert items[1].images[0].size == (56, 28)
    start, pad, end = tokenizer.convert_tokens_to_ids([VISION_START, IMAGE_PAD, VISION_END])
    merge = processor.image_processor.merge_size
    for item in items:
        ids = item.prompt_ids
        assert ids.count(pad) == len(item.images)
        assert all(ids[i - 1:i + 2] == [start, pad, end] for i, token in enumerate(ids) if token == pad)
        # the processor's own ids of the same chat (its images in place of the parts) are these, expanded
        content = item.row["messages"][0]["content"]
        parts = ([{"type": "image"}] * len(item.images) + [{"type": "text", "text": content}]
                 if isinstance(content, str) else [{"type": p["type"], **({"text": p["text"]} if p.get("text") else {})}
                                                   for p in content])
        text = processor.apply_chat_template([{"role": "user", "content": parts}], add_generation_prompt=True,
                                             tokenize=False)
        own = processor(text=[text], images=list(item.images), return_tensors="pt")
        counts = image_token_counts(own["image_grid_thw"], merge)
        assert expand_image_pads(ids, pad, counts) == own["input_ids"][0].tolist()
    rendered = [tokenizer.decode(item.prompt_ids) for item in items]  # the parts in their order
    assert rendered[1].index("and this?") < rendered[1].index(VISION_START) and rendered[1].count(IMAGE_PAD) == 1
    assert rendered[2].index(VISION_START) < rendered[2].index("compare them.") and rendered[2].count(IMAGE_PAD) == 2
    samples = next(PromptSamples(PromptLoader(dataset, batch_size=4, seed=0, encode=PromptEncoder(tokenizer, 200),
                                              shuffle=False), group_size=2, seed=0))
    assert [_colours(sample["images"]) for sample in samples[4:6]] == [[BLUE, RED]] * 2
    assert samples[4]["images"] is not samples[5]["images"] and samples[4]["answer"] == "both"


def _answer(output_ids, logprobs):
    """An engine's /generate answer as SGLang returns it."""
    return {"output_ids": output_ids, "text": "",
            "meta_info": {"output_token_logprobs": [[lp, token, None] for lp, token in zip(logprobs, output_ids)],
                          "finish_reason": {"type": "stop"}, "weight_version": "3"}}


def test_the_trajectory_trains_on_expanded_ids_whose_collapse_the_engine_is_sent(processor):
    tokenizer = processor.tokenizer
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    images = [Image.new("RGB", (56, 56), RED), Image.new("RGB", (56, 28), BLUE)]
    sent = PromptEncoder(tokenizer, 200)([{"role": "user", "content": "compare."}], images=2)
    builder = TrajectoryBuilder(tokenizer, processor)
    builder.start(sent, images=images)
    seq = builder.current
    assert seq.engine_ids == sent
    output, logprobs = [40, 41, 42], [-0.5, -1.25, -2.0]
    gen = parse_generation(_answer(output, logprobs), sent_version=5)
    builder.add_action(gen.output_ids, gen.logprobs, gen.versions)
    assert collapse_image_pads(seq.input_ids, pad) == sent + output == seq.engine_ids
    assert seq.input_ids.count(pad) == 4 + 2 and len(seq.input_ids) == len(sent) + 4 + output.__len__()
    assert seq.action_mask == [0] * (len(seq) - 3) + [1] * 3
    assert seq.behaviour_logprobs[-3:] == logprobs and seq.versions[-3:] == [3, 3, 3]
    assert all(len(values) == len(seq.input_ids) for values in (seq.action_mask, seq.attention_mask, seq.turns))
    own = vision_inputs(processor, images)
    assert seq.pixel_values.equal(own["pixel_values"]) and seq.image_grid_thw.tolist() == [[1, 4, 4], [1, 2, 4]]
    assert _colours(load_images(seq.image_data)) == [RED, BLUE]  # the data URLs the engine gets
    # later turns extend the same sequence: token ids that extend what the engine was sent, then text
    assert builder.add_observation(seq.engine_ids + [50, 51]) is True
    assert builder.add_observation(builder.state_text + " more") is True
    assert len(builder.sequences) == 1 and seq.engine_ids[:len(sent) + 5] == sent + output + [50, 51]
    builder.add_action([60], [-0.1], 6)
    assert collapse_image_pads(seq.input_ids, pad) == seq.engine_ids and seq.engine_ids[-1] == 60
    assert seq.input_ids.count(pad) == 6 and seq.action_mask[-1] == 1 and sum(seq.action_mask) == 4
    # the prompt's pads must match its images
    with pytest.raises(ValueError, match="hold 2 image pad tokens .* for 1 images"):
        TrajectoryBuilder(tokenizer, processor).start(sent, images=images[:1])


class _OneTurn(Env):
    async def reset(self, sample):
        return None

    async def step(self, action):
        return StepResult(observation=None, reward=1.0, done=True)


class _Engine:
    """The engine's side of /generate reduced to its answer (the ids sent and the images kept)."""

    def __init__(self):
        self.calls = []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, image_data=None):
        self.calls.append((list(input_ids), image_data, sampling_params.get("n", 1)))
        # the last prompt's answers sample the image pad: no image under it, those trajectories fail
        answer = _answer([40, self.image_pad if list(input_ids) == self.failing else 41], [-1.0, -2.0])
        return [answer] * sampling_params["n"] if "n" in sampling_params else answer


def test_the_rollout_sends_single_pads_and_the_images(processor):
    tokenizer = processor.tokenizer
    encoder = PromptEncoder(tokenizer, 200)
    red, blue = Image.new("RGB", (56, 56), RED), Image.new("RGB", (56, 28), BLUE)
    prompts = [(encoder("red?", images=1), [red]), (encoder("both?", images=2), [red, blue]),
               (encoder("text only"), None)]
    prompts.append((encoder("pad!", images=1), [blue]))
    samples = [{"prompt_ids": ids, **({"images": images} if images else {}), "group_id": g}
               for g, (ids, images) in enumerate(prompts) for _ in range(2)]
    engine = _Engine()
    engine.image_pad, engine.failing = tokenizer.convert_tokens_to_ids(IMAGE_PAD), prompts[-1][0]

    async def main():
        pool = EnvPool(_OneTurn, num_envs=8, step_timeout_s=10, max_failed_ratio=0.5)
        try:
            return await rollout(samples, RolloutSettings({"max_new_tokens": 4}, progress=False),
                                 RolloutParts(engine, pool, tokenizer, processor=processor), 0)
        finally:
            await pool.close()

    result = asyncio.run(main())
    # each group one call with n = 2 (its images the same), the ids one pad per image, the images as data URLs
    sent = sorted((ids, None if images is None else tuple(_colours(load_images(images))), n)
                  for ids, images, n in engine.calls)
    assert sent == sorted([(prompts[0][0], (RED,), 2), (prompts[1][0], (RED, BLUE), 2), (prompts[2][0], None, 2),
                           (prompts[3][0], (BLUE,), 2)])
    assert len(result.trajectories) == 6 and len(result.failed) == 2
    assert all("image pad token" in traj.error and traj.sample["group_id"] == 3 for traj in result.failed)
    pad = tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    for traj, sample in zip(result.trajectories, samples):
        seq = traj.sequences[0]
        assert collapse_image_pads(seq.input_ids, pad) == sample["prompt_ids"] + [40, 41]
        assert seq.input_ids.count(pad) == {0: 0, 1: 4, 2: 6}[len(sample.get("images", []))]
        assert (seq.pixel_values is None) == ("images" not in sample)
