"""Token-level trajectory building: exact engine ids, append vs new-sequence, GAE chain, alignment."""

import pytest
from transformers import AutoTokenizer

from rl_core.rollout.trajectory import Trajectory, TrajectoryBuilder


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    return AutoTokenizer.from_pretrained(tiny_model_dir)


def split_that_changes_tokens(tokenizer, text):
    """A split point where tokenize(a) + tokenize(b) != tokenize(a + b)."""
    for i in range(1, len(text)):
        a, b = text[:i], text[i:]
        if tokenizer.encode(a) + tokenizer.encode(b) != tokenizer.encode(text):
            return a, b
    raise AssertionError("the tiny tokenizer merged nothing across any split")


def test_builder_keeps_engine_ids_where_retokenizing_would_not(tokenizer):
    a, b = split_that_changes_tokens(tokenizer, "the old man walked to the market and felt happy.")
    prompt_ids = tokenizer.encode(a)
    sampled_ids = tokenizer.encode(b)  # what the engine sampled after the prompt
    assert prompt_ids + sampled_ids != tokenizer.encode(a + b)  # the trap this module avoids

    builder = TrajectoryBuilder(tokenizer)
    builder.start(a)
    text = builder.add_action(sampled_ids, [-0.5] * len(sampled_ids), version=3)
    seq = builder.build({}).sequences[0]
    assert seq.input_ids == prompt_ids + sampled_ids
    assert text == b and builder.state_text == a + b


def test_append_case_tokenizes_only_the_suffix_on_its_own(tokenizer):
    builder = TrajectoryBuilder(tokenizer)
    builder.start("she smiled at")
    action_ids = tokenizer.encode(" the bright")
    action_text = builder.add_action(action_ids, [-1.0] * len(action_ids), version=0)
    suffix = " morning sun."
    assert builder.add_observation("she smiled at" + action_text + suffix) is True
    traj = builder.build({})
    assert len(traj.sequences) == 1
    seq = traj.sequences[0]
    prompt_ids = tokenizer.encode("she smiled at")
    assert seq.input_ids == prompt_ids + action_ids + tokenizer.encode(suffix)
    assert seq.action_mask == [0] * len(prompt_ids) + [1] * len(action_ids) + [0] * len(tokenizer.encode(suffix))
    assert traj.info["appended_observations"] == 1 and traj.info["new_sequences"] == 0


def test_text_that_is_not_an_extension_starts_a_new_sequence(tokenizer):
    builder = TrajectoryBuilder(tokenizer)
    builder.start("the dark room")
    builder.add_action([5, 6, 7], [-1.0, -2.0, -3.0], version=1)
    assert builder.add_observation("a new summarised state") is False
    builder.add_action([8, 9], [-4.0, -5.0], version=2)
    traj = builder.build({})
    assert len(traj.sequences) == 2
    assert traj.sequences[1].input_ids == tokenizer.encode("a new summarised state") + [8, 9]
    assert builder.state_text == "a new summarised state" + tokenizer.decode([8, 9], skip_special_tokens=True)


def test_token_observations_extend_only_on_an_exact_token_prefix(tokenizer):
    builder = TrajectoryBuilder(tokenizer)
    builder.start([1, 1, 40, 41])  # left-padded ids, used as they are
    builder.add_action([50, 51], [-0.1, -0.2], version=0)
    assert builder.add_observation([1, 1, 40, 41, 50, 51, 60]) is True  # extends: only [60] added
    builder.add_action([70], [-0.3], version=0)
    assert builder.add_observation([90, 91]) is False  # fresh state: new sequence, ids as given
    traj = builder.build({})
    assert [s.input_ids for s in traj.sequences] == [[1, 1, 40, 41, 50, 51, 60, 70], [90, 91]]


def test_left_padding_of_a_token_state_is_masked_and_not_sent(tokenizer):
    pad = tokenizer.pad_token_id
    assert pad != tokenizer.eos_token_id  # OpenAI detail the tiny assets follow
    builder = TrajectoryBuilder(tokenizer)
    builder.start([pad, pad, 40, pad, 41])  # only the leading run is padding
    builder.add_action([50], [-0.1], version=0)
    seq = builder.current
    assert seq.attention_mask == [0, 0, 1, 1, 1, 1]
    assert seq.real_ids == [40, pad, 41, 50]
    all_pads = TrajectoryBuilder(tokenizer)
    all_pads.start([pad, pad])
    assert all_pads.current.attention_mask == [0, 1]  # never an empty engine input


def generated(traj, per_token: str) -> list:
    """The per-token list `per_token` at every generated token, sequence after sequence."""
    return [getattr(seq, per_token)[t] for seq in traj.sequences for t, m in enumerate(seq.action_mask) if m]


def test_generated_tokens_keep_their_order_across_sequences_and_align_logprobs(tokenizer):
    builder = TrajectoryBuilder(tokenizer)
    builder.start("we found")
    builder.add_action([10, 11], [-0.1, -0.2], version=4)
    builder.add_reward(0.5)
    builder.add_observation("we found" + tokenizer.decode([10, 11], skip_special_tokens=True) + " more")
    builder.add_action([12], [-0.3], version=5)
    builder.add_reward(0.25)
    builder.add_observation("something else entirely")
    builder.add_action([13, 14], [-0.4, -0.5], version=5)
    builder.add_reward(1.0)
    traj = builder.build({"id": 7})

    assert generated(traj, "input_ids") == [10, 11, 12, 13, 14]  # generation order, across both sequences
    assert [seq.num_action_tokens for seq in traj.sequences] == [3, 2]
    assert generated(traj, "behaviour_logprobs") == [-0.1, -0.2, -0.3, -0.4, -0.5]
    assert generated(traj, "versions") == [4, 4, 5, 5, 5]
    rewards = generated(traj, "token_rewards")
    assert rewards == [0.0, 0.5, 0.25, 0.0, 1.0]  # each on the last token of the action that earned it
    assert traj.env_reward == 1.75 and traj.min_version == 4 and traj.num_action_tokens == 5
    for seq in traj.sequences:  # every per-token list is aligned with input_ids
        n = len(seq.input_ids)
        assert len(seq.action_mask) == len(seq.behaviour_logprobs) == len(seq.versions) == len(seq.token_rewards) == n
        assert seq.attention_mask == [1] * n  # no padding anywhere here
        assert all(lp == 0.0 and v == -1 for lp, v, m in zip(seq.behaviour_logprobs, seq.versions, seq.action_mask) if not m)


def test_builder_rejects_misaligned_or_malformed_input(tokenizer):
    builder = TrajectoryBuilder(tokenizer)
    with pytest.raises(RuntimeError, match="start"):
        builder.add_action([1], [0.0], version=0)
    builder.start("hello")
    with pytest.raises(ValueError, match="one logprob per id"):
        builder.add_action([1, 2], [0.0], version=0)
    with pytest.raises(TypeError, match="text .* or token ids"):
        builder.add_observation(3.5)
    with pytest.raises(ValueError, match="empty"):
        builder.add_observation([])


def test_empty_trajectory_has_no_tokens():
    traj = Trajectory(sequences=[], sample={}, failed=True, error="env broke")
    assert traj.num_action_tokens == traj.num_tokens == 0 and traj.min_version == -1
