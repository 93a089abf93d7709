"""Multi-turn tool use with images in the first user turn (issue 71): a `ToolUseEnv` conversation whose user turn
shows images runs through the real rollout, the real chat-token layer and the real embedded engine serving a tiny
Qwen2.5-VL. With an append-only template the trajectory stays one sequence while the prompt extends (a tool
result, then a user turn); every turn the engine is sent the ids with one pad per image plus the images, and the
trainer's ids (the engine's own expansion) collapse back to exactly what it was sent; only the sampled tokens are
actions, each with its engine logprob; the images stay with the sequence; and the trainer's forward on the final
sequence gives the engine's sampling logprobs of every sampled token within 1e-4 (float32): the tokens are exact
across turns. A template that re-renders the conversation starts new sequences: each shows the images again."""

import asyncio
import dataclasses

import numpy as np
import pytest
import torch
from PIL import Image

from envs.chat import ChatSetup, ChatStep, ToolUseEnv
from envs.factory import make_env_factory
from envs.pool import EnvPool
from envs.tools import ToolCall
from offline.vision import save_vision_model
from rl_core.ppo.step import Experience
from rl_core.rollout.rollout import RolloutParts, RolloutSettings, rollout
from rl_core.rollout.trajectory import TrajectoryBuilder, image_pad_id
from workers import forward
from workers.engines.client import EngineClient
from workers.engines.launch import start_engine
from workers.engines.spec import EngineSpec
from workers.procs import ManagedProcesses
from workers.vision import collapse_image_pads, image_token_counts, load_processor, vision_inputs
from workers.worker import BatchWorker

FOLLOW_UP = "And the other corner?"
TURNS = 3  # a tool call, then a user turn, then the answer
MAX_NEW = 5


def count_pixels(colour: str) -> int:
    """Count the pixels of a colour.

    Args:
        colour: the colour's name
    """
    return 3 * len(colour)


class ScriptedVisionToolEnv(ToolUseEnv):
    """`ToolUseEnv` with its turns scripted (a random policy writes no calls): the first turn calls `count_pixels`
    (run and answered by `ToolUseEnv.step`), the second gets a user follow-up, the third is the answer."""

    async def reset(self, sample: dict) -> list[dict]:
        self.turn = 0
        return await super().reset(sample)

    async def step(self, message):
        self.turn += 1
        if self.turn == 1:
            call = ToolCall("call_0", "count_pixels", {"colour": "red"})
            return await super().step(dataclasses.replace(message, tool_calls=[call], finish_reason="stop"))
        if self.turn == 2:
            return ChatStep([{"role": "user", "content": FOLLOW_UP}])
        return await super().step(dataclasses.replace(message, tool_calls=[], finish_reason="stop"))


def noise(width, height, seed):
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (height, width, 3), dtype=np.uint8))


class Recorder:
    """The real EngineClient; every /generate's ids, images and answer kept for the assertions."""

    def __init__(self, client: EngineClient):
        self.client, self.calls = client, []

    async def generate(self, input_ids, sampling_params, return_logprob=True, rid=None, image_data=None):
        answer = await self.client.generate(input_ids, sampling_params, return_logprob=return_logprob, rid=rid,
                                            image_data=image_data)
        self.calls.append((list(input_ids), image_data, answer))
        return answer


# A Qwen2.5-VL-like chat template, append-only (each turn is written as the model saw it): image parts as one pad
# between the vision markers, the tool list in a system turn, tool results in a user turn, eos_token ends a turn.
APPEND_ONLY = (
    "{%- if tools -%}<|im_start|>system\n# Tools\n{%- for tool in tools %}\n{{ tool['function']['name'] }}"
    "{%- endfor %}{{ eos_token }}\n{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if message['role'] == 'tool' -%}<|im_start|>user\n<tool_response>{{ message['content'] }}</tool_response>"
    "{%- else -%}<|im_start|>{{ message['role'] }}\n"
    "{%- if message['content'] is string -%}{{ message['content'] }}"
    "{%- else -%}{%- for part in message['content'] -%}"
    "{%- if part['type'] == 'image' or 'image' in part -%}<|vision_start|><|image_pad|><|vision_end|>"
    "{%- elif part['type'] == 'text' -%}{{ part['text'] }}{%- endif -%}"
    "{%- endfor -%}{%- endif -%}{%- endif -%}{{ eos_token }}\n"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}<|im_start|>assistant\n{%- endif -%}"
)


@pytest.fixture(scope="module")
def vl_dir(tiny_model_dir, tmp_path_factory):
    return save_vision_model("qwen2_5_vl", tiny_model_dir, tmp_path_factory.mktemp("vl_model"))


@pytest.fixture(scope="module")
def engine_url(vl_dir, tmp_path_factory):
    spec = EngineSpec(kind="embedded", model_path=vl_dir, dtype="float32", device="cpu", seed=0, num_threads=1)
    with ManagedProcesses() as procs:
        yield start_engine(spec, tmp_path_factory.mktemp("vl_engine") / "engine.log", procs, deadline_s=120).url


@pytest.fixture(scope="module")
def model(vl_dir):
    from transformers import AutoModelForImageTextToText

    return AutoModelForImageTextToText.from_pretrained(vl_dir, dtype=torch.float32).eval()


def run_conversations(url, processor, template):
    """Two conversations (one image; two images of other sizes) through the rollout; returns the result, each
    /generate's (ids sent, images sent, answer) and what the engine ran for those ids and images (its own
    expansion, asked of it afterwards as a prefill)."""
    tokenizer = processor.tokenizer
    if template is not None:
        tokenizer.chat_template = template
    setup = ChatSetup.build(tokenizer, ["tests.rollout.test_vision_multiturn:count_pixels"], "hermes",
                            toolbox_options={"timeout_s": 5})
    pool = EnvPool(make_env_factory(ScriptedVisionToolEnv, {"max_tool_turns": 2}, chat=setup), num_envs=2,
                   step_timeout_s=30, max_failed_ratio=0.0)
    # Rows as the data loader gives them: image parts in the first user turn, the images beside (56x56: 4 pads
    # each, 56x28: 2), a seed each so the random policy's tokens are reproducible.
    samples = [{"messages": [{"role": "user", "content": [{"type": "image"}] * len(images) +
                              [{"type": "text", "text": "What colour is the corner?"}]}],
                "images": images, "sampling_seed": 7 + 5 * k} for k, images in enumerate(PICTURES)]
    settings = RolloutSettings({"max_new_tokens": MAX_NEW, "temperature": 1.0}, max_turns=TURNS + 1,
                               max_total_tokens=512, progress=False)

    async def main():
        async with EngineClient(url, timeout_s=120) as client:
            recorder = Recorder(client)
            try:
                result = await rollout(samples, settings, RolloutParts(recorder, pool, tokenizer, None, processor), 0)
            finally:
                await pool.close()
                setup.close()
            ran = await asyncio.gather(*(client.post("/generate", {
                "input_ids": ids, "image_data": images, "return_logprob": True, "logprob_start_len": 0,
                "sampling_params": {"max_new_tokens": 0}}) for ids, images, _ in recorder.calls))
            return result, [(*call, [e[1] for e in prefill["meta_info"]["input_token_logprobs"]])
                            for call, prefill in zip(recorder.calls, ran)]
    return asyncio.run(main())


PICTURES = [[noise(56, 56, 0)], [noise(56, 28, 1), noise(56, 56, 2)]]


@pytest.mark.timeout(180)
@pytest.mark.parametrize("template", ["append_only", "re_rendering"])
def test_a_tool_conversation_with_images_in_the_first_turn_keeps_exact_tokens(vl_dir, engine_url, model, template):
    """`append_only`: one sequence while the prompt extends. `re_rendering`: the tiny model's own template writes
    a past assistant turn otherwise than the model saw it (`Assistant: ` after its `Assistant:`), so each turn
    starts a new sequence holding the re-rendered conversation: each shows the prompt's images again, and the
    engine gets them with it."""
    processor = load_processor(vl_dir)
    tokenizer, pad = processor.tokenizer, image_pad_id(processor, processor.tokenizer)
    result, calls = run_conversations(engine_url, processor, APPEND_ONLY if template == "append_only" else None)
    assert not result.failed and len(result.trajectories) == len(PICTURES)
    assert len(calls) == TURNS * len(PICTURES)
    for traj, images in zip(result.trajectories, PICTURES):
        assert traj.num_turns == TURNS and traj.info["tool_calls"] == 1 and traj.info["answered"]
        if template == "append_only":  # nothing re-tokenized, nothing re-sent
            assert len(traj.sequences) == 1 and traj.info["appended_observations"] == TURNS - 1
            assert traj.info["new_sequences"] == 0 and traj.info["template_divergences"] == 0
        else:
            assert len(traj.sequences) == TURNS and traj.info["template_divergences"] == TURNS - 1

        inputs = vision_inputs(processor, images)
        counts = image_token_counts(inputs["image_grid_thw"], processor.image_processor.merge_size)
        # This trajectory's engine calls (its images), in turn order: each sends the ids with one pad per image,
        # and the images; the engine's own expansion of them is the trainer's ids, which collapse back to them.
        mine = sorted((call for call in calls if call[1] == traj.sequences[0].image_data), key=lambda c: len(c[0]))
        assert len(mine) == TURNS
        spans = {id(seq): [] for seq in traj.sequences}
        for turn, (ids, sent, answer, expanded) in enumerate(mine):
            assert ids.count(pad) == len(images) and expanded.count(pad) == sum(counts)
            assert answer["meta_info"]["image_tokens"] == sum(counts)
            assert answer["meta_info"]["prompt_tokens"] == len(expanded)
            out = answer["output_ids"]
            (seq,) = [seq for seq in traj.sequences if seq.input_ids[:len(expanded) + len(out)] == expanded + out]
            assert collapse_image_pads(seq.input_ids[:len(expanded)], pad) == ids
            assert sent == seq.image_data  # SGLang needs the images whenever the ids carry pads
            span = list(range(len(expanded), len(expanded) + len(out)))
            sampled = [entry[0] for entry in answer["meta_info"]["output_token_logprobs"]]
            assert [seq.behaviour_logprobs[k] for k in span] == sampled
            assert [seq.turns[k] for k in span] == [turn] * len(out) and out
            spans[id(seq)] += span
            if turn and template == "append_only":  # the prompt extends: the last call's ids and answer first
                before_ids, _, before, _ = mine[turn - 1]
                assert ids[:len(before_ids) + len(before["output_ids"])] == before_ids + before["output_ids"]
        for seq in traj.sequences:
            # The images stay with the sequence: the processor's pixel values and grids, the pads expanded to them.
            torch.testing.assert_close(seq.pixel_values, inputs["pixel_values"], atol=0, rtol=0)
            assert seq.image_grid_thw.tolist() == inputs["image_grid_thw"].tolist()
            assert len(seq.image_data) == len(images)
            assert seq.input_ids.count(pad) == sum(counts) and seq.engine_ids.count(pad) == len(images)
            # Only the policy's tokens are actions, each with its engine logprob and version.
            actions = spans[id(seq)]
            assert [k for k, m in enumerate(seq.action_mask) if m] == actions and actions[-1] == len(seq) - 1
            assert all(seq.behaviour_logprobs[k] < 0 and seq.versions[k] == 0 for k in actions)
            assert all(seq.behaviour_logprobs[k] == 0 and seq.versions[k] == -1 and seq.turns[k] == -1
                       for k in range(len(seq)) if k not in set(actions))
        # The tool's answer, then the user's follow-up, as context the last sequence holds.
        last = traj.sequences[-1]
        text = tokenizer.decode([t for t, m in zip(last.input_ids, last.action_mask) if not m])
        assert str(count_pixels("red")) in text and FOLLOW_UP in text

    # The trainer's forward on the final sequences, with their images, gives the engine's sampling logprobs.
    exp = Experience.from_trajectories(result.trajectories, tokenizer.pad_token_id)
    assert len(exp.batch["image_rows"]) == sum(len(t.sequences) * len(images)
                                               for t, images in zip(result.trajectories, PICTURES))
    worker = BatchWorker(0, 1, torch.device("cpu"), max_tokens=2 * exp.batch["input_ids"].shape[1], layout="rows",
                         vision_model=model)
    with torch.no_grad():
        logprobs = worker.compute_and_share(exp.batch, lambda micro: (forward.token_logprobs(model, micro, 1.0),))[0]
    mask = exp.batch["action_mask"].bool()
    torch.testing.assert_close(logprobs[mask], exp.batch["behaviour_logprobs"][mask], atol=1e-4, rtol=0)


def test_a_new_sequence_shows_the_prompts_images_again_or_none(vl_dir):
    """A state that is no extension starts a new sequence: with the prompt's pads it carries the prompt's images
    (the engine must get them with it), without pads it is text only, and another count of pads is the env's
    error (a failed trajectory), never an engine's 400 that would stop the rollout."""
    processor = load_processor(vl_dir)
    tokenizer, pad = processor.tokenizer, image_pad_id(processor, processor.tokenizer)
    prompt = tokenizer.encode("<|vision_start|><|image_pad|><|vision_end|>what?", add_special_tokens=False)
    builder = TrajectoryBuilder(tokenizer, processor)
    builder.start(prompt, images=PICTURES[0])
    builder.add_action([5, 6], [-1.0, -1.0], 0)
    assert not builder.add_observation(prompt + [7])
    first, again = builder.sequences
    assert again.engine_ids == prompt + [7] and again.input_ids.count(pad) == first.input_ids.count(pad) == 4
    assert again.image_data == first.image_data and again.image_grid_thw.tolist() == [[1, 4, 4]]
    torch.testing.assert_close(again.pixel_values, first.pixel_values, atol=0, rtol=0)
    builder.add_action([8], [-1.0], 0)
    assert not builder.add_observation([9, 10])  # a summary without the image
    assert builder.current.image_data == [] and builder.current.pixel_values is None
    assert builder.current.engine_ids == [9, 10]
    builder.add_action([11], [-1.0], 0)
    with pytest.raises(ValueError, match="2 image pad tokens"):
        builder.add_observation(prompt + prompt)
