"""A PPO step's batch with images (issue 71): trajectories whose prompts show images become an `Experience` that
carries each sequence's pixel values and grids; the worker's micro-batches (padded and packed, several of them)
get exactly their rows' images, so the trainer's logprobs equal a tiny Qwen2.5-VL model's own forward, one
sequence at a time; a minibatch selection keeps rows and images together; text-only batches are as before."""

import pytest
import torch
from PIL import Image

from offline.vision import IMAGE_PAD, save_vision_model
from rl_core.ppo.step import STEP_BATCH_ROWS, Experience
from rl_core.prompt_encoding import PromptEncoder
from rl_core.rollout.trajectory import TrajectoryBuilder, parse_generation
from workers import forward
from workers.layout import rows_to_batch
from workers.vision import load_processor
from workers.worker import BatchWorker

PAD_ID = 1  # the tiny tokenizer's [PAD]
TEMPERATURE = 0.7


@pytest.fixture(scope="module")
def vl(tmp_path_factory, tiny_model_dir):
    from transformers import AutoModelForImageTextToText

    path = save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path_factory.mktemp("vl") / "model")
    return AutoModelForImageTextToText.from_pretrained(path).eval(), load_processor(path)


def _noise(width, height, seed):
    generator = torch.Generator().manual_seed(seed)
    return Image.fromarray(torch.randint(0, 256, (height, width, 3), generator=generator, dtype=torch.uint8).numpy())


# Per trajectory: its images, its question, its response length (different images, lengths and pad counts).
PROMPTS = [([_noise(56, 56, 0)], "what is it?", 4),
           ([_noise(56, 28, 1), Image.new("RGB", (56, 56), (200, 30, 30))], "compare the two pictures.", 9),
           ([_noise(56, 56, 2)], "and this one?", 6)]


def _trajectories(processor):
    """Trajectories as the rollout builds them, each from an engine answer as /generate returns it."""
    encoder, generator = PromptEncoder(processor.tokenizer, 200), torch.Generator().manual_seed(0)
    out = []
    for images, question, length in PROMPTS:
        builder = TrajectoryBuilder(processor.tokenizer, processor)
        builder.start(encoder(question, images=len(images)), images=images)
        ids = torch.randint(3, 290, (length,), generator=generator).tolist()  # the tiny vocabulary, no special ids
        logprobs = (-torch.rand(length, generator=generator)).tolist()
        answer = {"output_ids": ids, "meta_info": {"output_token_logprobs": [[lp, i, None] for lp, i in zip(logprobs, ids)],
                                                   "finish_reason": {"type": "stop"}}}
        gen = parse_generation(answer, 0)
        builder.add_action(gen.output_ids, gen.logprobs, gen.versions)
        out.append(builder.build({"group_id": len(out)}))
    return out


def _reference(model, sequences):
    """Per sequence, the model's own forward on its ids and images alone: logprobs of its tokens (prompt and
    response) at the sampling temperature, `[N, T]` as the step batch lays them out."""
    width = max(len(seq) for seq in sequences)
    expected = torch.zeros(len(sequences), width)
    with torch.no_grad():
        for row, seq in enumerate(sequences):
            ids = torch.tensor(seq.input_ids)[None]
            logits = model(input_ids=ids, mm_token_type_ids=(ids == model.config.image_token_id).int(),
                           pixel_values=seq.pixel_values, image_grid_thw=seq.image_grid_thw).logits[0, :-1]
            logprobs = torch.log_softmax(logits.float() / TEMPERATURE, -1).gather(-1, ids[0, 1:, None]).squeeze(-1)
            expected[row, 1:len(seq)] = logprobs
    return expected


def _logprobs(worker, model, batch):
    return worker.compute_and_share(batch, lambda micro: (forward.token_logprobs(model, micro, TEMPERATURE),))[0]


def test_micro_batches_give_each_sequence_its_own_images(vl):
    model, processor = vl
    trajectories = _trajectories(processor)
    exp = Experience.from_trajectories(trajectories, PAD_ID)
    sequences = exp.sequences
    pad = processor.tokenizer.convert_tokens_to_ids(IMAGE_PAD)
    assert [seq.input_ids.count(pad) for seq in sequences] == [4, 2 + 4, 4]
    assert exp.batch["image_rows"].tolist() == [0, 1, 1, 2]
    assert exp.batch["image_grid_thw"].tolist() == [[1, 4, 4], [1, 2, 4], [1, 4, 4], [1, 4, 4]]
    torch.testing.assert_close(exp.batch["pixel_values"], torch.cat([seq.pixel_values for seq in sequences]))
    expected = _reference(model, sequences)
    lengths = [len(seq) for seq in sequences]
    for layout in (None, "rows", "one_row"):
        # room for two of the shorter sequences at most: several micro-batches, the longest alone
        worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=max(lengths) + 4 if layout is None else
                             max(lengths) + min(lengths), layout=layout, vision_model=model)
        plan = worker.plan(exp.batch)
        assert len(plan) >= 2 and sorted(row for rows, _ in plan for row in rows) == [0, 1, 2], (layout, plan)
        assert layout is None or any(len(rows) == 2 for rows, _ in plan), (layout, plan)
        got = _logprobs(worker, model, exp.batch)
        torch.testing.assert_close(got, expected, atol=1e-5, rtol=0, msg=lambda m: f"{layout}: {m}")
        assert got[exp.batch["action_mask"].bool()].abs().min() > 0
    # a minibatch (trajectories 2 and 0, in that order) keeps each row's images with it
    rows = exp.select([2, 0])
    assert rows["image_rows"].tolist() == [0, 1]
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=2 * max(lengths), layout="rows", vision_model=model)
    torch.testing.assert_close(_logprobs(worker, model, rows), expected[[2, 0]], atol=1e-5, rtol=0)
    # the images are really read: rows 0 and 2 (same grid) shown each other's image give other logprobs
    swapped = dict(exp.batch, image_rows=torch.tensor([2, 1, 1, 0]))
    assert not torch.allclose(_logprobs(worker, model, swapped)[[0, 2]], expected[[0, 2]], atol=1e-3)
    with pytest.raises(ValueError, match="no vision_model"):
        BatchWorker(0, 1, torch.device("cpu"), max_tokens=200).micro_batch(exp.batch, [0])


def test_text_only_batches_are_as_before(vl):
    _, processor = vl
    builder = TrajectoryBuilder(processor.tokenizer, processor)
    builder.start([5, 6, 7])
    builder.add_action([8, 9], [-0.5, -0.25], 0)
    traj = builder.build({"group_id": 0})
    exp = Experience.from_trajectories([traj, traj], PAD_ID)
    assert set(exp.batch) == set(STEP_BATCH_ROWS["rollout"])
    seq = traj.sequences[0]
    before = rows_to_batch([{"input_ids": seq.input_ids, "action_mask": seq.action_mask,
                             "attention_mask": seq.attention_mask, "behaviour_logprobs": seq.behaviour_logprobs,
                             "token_rewards": seq.token_rewards}] * 2, PAD_ID)
    assert all(torch.equal(exp.batch[key], before[key]) for key in before)
    assert set(exp.select([1])) == set(before) and seq.engine_ids == seq.input_ids == [5, 6, 7, 8, 9]
    micro = BatchWorker(0, 1, torch.device("cpu"), max_tokens=100).micro_batch(exp.batch, [0, 1])
    assert set(micro) == set(before)
