"""Token-level trajectories: what the trainer trains on, built from the engine's own token ids.

Tokens, never text, cross the engine boundary: `tokenize(a) + tokenize(b)` is in general not
`tokenize(a + b)`, so re-tokenizing decoded text would train on ids the engine never sampled.
The builder therefore keeps the engine's `output_ids` exactly and tokenizes only what the
framework adds (prompt, env observations), each piece on its own.

Left padding of a token-id state (OpenAI's fixed-length queries, pad distinct from EOS) gets
attention_mask 0: the trainer masks it and uses position ids = exclusive cumsum of the mask,
which makes the padded query equivalent to the unpadded one the engine is sent.

Multi-turn rule (the env's next state s' versus the current state s plus action a):
  * text observation that starts with text(s) + text(a): only the new suffix is tokenized and
    appended to the same sequence (KV cache reuse at rollout, one sequence at training);
  * token-id observation that starts with all ids of the current sequence: only the new ids
    are appended to the same sequence;
  * anything else is a fresh state: a new sequence starts with it (text tokenized on its own,
    ids used as given).
A trajectory may thus be several sequences; advantages run over all its generated tokens in
order.

An engine's /generate answer comes in through `parse_generation`: the ids, their logprobs and the policy
version of each token, checked to be whole.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

from envs.base import Observation


class EngineOutputError(RuntimeError):
    """The engine's /generate answer lacks what training needs (ids, logprobs)."""


@dataclass
class Generation:
    """One /generate answer reduced to what the trajectory keeps."""

    output_ids: list[int]
    logprobs: list[float]
    versions: list[int]  # policy version of each token
    finish_reason: str


def parse_generation(answer: dict, sent_version: int) -> Generation:
    """Take ids, logprobs and finish reason from SGLang's /generate answer.

    Every token is tagged with the older of the policy version current when the request was
    sent and the engine's `weight_version` in the answer: with partial rollout a push can land
    mid-request, so the tag bounds staleness from the oldest weights that may have sampled it.
    """
    meta = answer.get("meta_info") or {}
    ids = [int(i) for i in answer.get("output_ids") or []]
    triples = meta.get("output_token_logprobs")
    if triples is None:
        raise EngineOutputError("the engine answered without meta_info.output_token_logprobs: send return_logprob=true")
    if [int(t[1]) for t in triples] != ids:
        raise EngineOutputError(f"engine output_ids {ids[:8]}... differ from the ids in output_token_logprobs")
    reason = (meta.get("finish_reason") or {}).get("type") or "unknown"
    version = min(sent_version, _int_or(meta.get("weight_version"), sent_version))
    return Generation(ids, [float(t[0]) for t in triples], [version] * len(ids), reason)


def _int_or(value: Any, fallback: int) -> int:
    """The engine's weight_version when it is a number (the job tags pushes with step numbers)."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return fallback


@dataclass
class TokenSequence:
    """One model input. Per-token lists all have `len(input_ids)` entries."""

    input_ids: list[int] = field(default_factory=list)
    action_mask: list[int] = field(default_factory=list)  # 1 on engine-generated tokens
    behaviour_logprobs: list[float] = field(default_factory=list)  # engine logprob on generated tokens, else 0
    versions: list[int] = field(default_factory=list)  # policy version per generated token, else -1
    token_rewards: list[float] = field(default_factory=list)  # env reward on the last token of the action that earned it
    attention_mask: list[int] = field(default_factory=list)  # 0 only on the left padding of a padded state
    # The trajectory's turn (engine call, from 0) of each generated token, else -1: turn-level credit
    # (rl_core/ppo/turns.py) needs it, since two turns need not have context tokens between them.
    turns: list[int] = field(default_factory=list)
    # A prompt showing images (vision-language models): `input_ids` hold as many image pads per image as the
    # processor makes (what the trainer runs); the engine is sent `engine_prompt` (one pad per image) in place
    # of the first `prompt_length` ids, with the images as `image_data`.
    image_data: list[str] = field(default_factory=list)  # the images as data URLs (SGLang's image_data)
    pixel_values: Any = None  # the processor's `[patches, C*t*p*p]` tensor of the images
    image_grid_thw: Any = None  # `[images, 3]`
    engine_prompt: list[int] | None = None
    prompt_length: int = 0

    @property
    def real_ids(self) -> list[int]:
        """The ids without padding (equivalent under exclusive-cumsum positions)."""
        return [i for i, m in zip(self.input_ids, self.attention_mask) if m]

    @property
    def engine_ids(self) -> list[int]:
        """What the engine is sent: the real ids, a prompt with images with one pad per image."""
        if self.engine_prompt is None:
            return self.real_ids
        return self.engine_prompt + self.input_ids[self.prompt_length:]

    def __len__(self) -> int:
        return len(self.input_ids)

    @property
    def num_action_tokens(self) -> int:
        return sum(self.action_mask)

    def extend_context(self, ids: Sequence[int], num_padding: int = 0) -> None:
        """Append tokens the policy did not generate (prompt, observation); the first `num_padding` are pads."""
        n = len(ids)
        self.input_ids.extend(int(i) for i in ids)
        self.attention_mask.extend([0] * num_padding + [1] * (n - num_padding))
        self.action_mask.extend([0] * n)
        self.behaviour_logprobs.extend([0.0] * n)
        self.versions.extend([-1] * n)
        self.token_rewards.extend([0.0] * n)
        self.turns.extend([-1] * n)

    def extend_action(self, ids: Sequence[int], logprobs: Sequence[float], versions: Sequence[int],
                      turn: int = 0) -> None:
        """Append engine-generated tokens with their behaviour logprobs, policy versions and turn."""
        n = len(ids)
        self.input_ids.extend(int(i) for i in ids)
        self.attention_mask.extend([1] * n)
        self.action_mask.extend([1] * n)
        self.behaviour_logprobs.extend(float(x) for x in logprobs)
        self.versions.extend(int(v) for v in versions)
        self.token_rewards.extend([0.0] * n)
        self.turns.extend([int(turn)] * n)


@dataclass
class Trajectory:
    """Everything one env episode produced, ready for scoring and advantages."""

    sequences: list[TokenSequence]
    sample: dict
    env_reward: float = 0.0
    finish_reasons: list[str] = field(default_factory=list)  # one per engine call, plus "length" on a budget stop
    failed: bool = False
    error: str | None = None
    num_turns: int = 0
    info: dict = field(default_factory=dict)
    reward_components: dict = field(default_factory=dict)  # reward function name -> value (rl_core/rewards)
    fn_reward: float = 0.0  # their weighted sum

    @property
    def truncated(self) -> bool:
        """The last response was cut by a length limit instead of ending (EOS / stop token / env done)."""
        return bool(self.finish_reasons) and self.finish_reasons[-1] == "length"

    def final_response(self) -> tuple[list[int], list[int]]:
        """(context ids, response ids) of the last sequence: its final run of action tokens."""
        seq = self.sequences[-1]
        end = len(seq.action_mask)
        start = end
        while start > 0 and seq.action_mask[start - 1]:
            start -= 1
        context = [i for i, real in zip(seq.input_ids[:start], seq.attention_mask[:start]) if real]
        return context, seq.input_ids[start:end]

    @property
    def num_action_tokens(self) -> int:
        return sum(seq.num_action_tokens for seq in self.sequences)

    @property
    def num_tokens(self) -> int:
        return sum(len(seq) for seq in self.sequences)

    @property
    def min_version(self) -> int:
        """Oldest policy version that generated any token (-1 when nothing was generated)."""
        versions = [v for seq in self.sequences for v in seq.versions if v >= 0]
        return min(versions) if versions else -1


def encode_text(tokenizer: Any, text: str, first: bool) -> list[int]:
    """Tokenize one piece on its own; special tokens (e.g. BOS) only at the start of a sequence."""
    return list(tokenizer.encode(text, add_special_tokens=first))


class TrajectoryBuilder:
    """Builds a `Trajectory` turn by turn, keeping the engine's ids exactly.

    Usage: `start(first_state)`, then per turn `add_action(...)`, `add_reward(...)`,
    `add_observation(next_state)`; finally `build(sample)`.
    """

    def __init__(self, tokenizer: Any, processor: Any = None):
        self.tokenizer = tokenizer
        self.processor = processor  # a vision-language model's (`workers.vision.load_processor`): prompts with images
        pad, eos = getattr(tokenizer, "pad_token_id", None), getattr(tokenizer, "eos_token_id", None)
        self.pad_id = pad if pad != eos else None  # a pad equal to EOS can't be told from a real token
        self.sequences: list[TokenSequence] = []
        self.state_text: str | None = None  # the state as the env sees it: prompt + actions + observation suffixes
        self.env_reward = 0.0
        self.unplaced_reward = 0.0
        self.num_turns = 0
        self.appended_observations = 0
        self.new_sequences = 0
        self.vision: tuple | None = None  # the prompt's images: (data URLs, pixel values, grids, pads per image)

    @property
    def current(self) -> TokenSequence:
        if not self.sequences:
            raise RuntimeError("TrajectoryBuilder.start(first_state) must be called first")
        return self.sequences[-1]

    def start(self, state: Observation, images: Sequence[Any] | None = None) -> None:
        """Begin with the first state (prompt text or prompt ids); `images` (RGB PIL images, bytes, paths) are
        the prompt's, one image pad each in the state, in order."""
        self._new_sequence(state)
        if images:
            self._show_images(list(images))

    def _show_images(self, images: list | None = None) -> None:
        """The current sequence's image pads expanded to the processor's count per image, its images kept: the
        prompt's `images`, or (None) the ones the prompt showed, for a new sequence whose state shows them again."""
        from workers.vision import data_url, expand_image_pads, image_token_counts, load_images, vision_inputs

        if self.processor is None:
            raise RuntimeError("the prompt shows images but the rollout has no processor; give RolloutParts the "
                               "vision-language model's processor (workers.vision.load_processor)")
        seq = self.current
        if 0 in seq.attention_mask:
            raise ValueError("a prompt with images cannot be left-padded")
        if images is not None:
            images = load_images(images)
            inputs = vision_inputs(self.processor, images)
            merge = getattr(self.processor, "image_processor", self.processor).merge_size
            self.vision = ([data_url(image) for image in images], inputs["pixel_values"], inputs["image_grid_thw"],
                           image_token_counts(inputs["image_grid_thw"], merge))
        urls, pixel_values, grid_thw, counts = self.vision
        expanded = expand_image_pads(seq.input_ids, image_pad_id(self.processor, self.tokenizer), counts)
        seq.engine_prompt, seq.prompt_length = list(seq.input_ids), len(expanded)
        seq.input_ids = []
        for values in (seq.attention_mask, seq.action_mask, seq.behaviour_logprobs, seq.versions, seq.token_rewards,
                       seq.turns):
            del values[:]
        seq.extend_context(expanded)
        seq.image_data, seq.pixel_values, seq.image_grid_thw = list(urls), pixel_values, grid_thw

    def add_action(self, output_ids: Sequence[int], logprobs: Sequence[float], version: int | Sequence[int]) -> str:
        """Append the engine's output ids as they are; return their decoded text (the env's action)."""
        if len(logprobs) != len(output_ids):
            raise ValueError(f"{len(output_ids)} output ids but {len(logprobs)} logprobs: the engine must return one logprob per id")
        versions = [version] * len(output_ids) if isinstance(version, int) else list(version)
        if len(versions) != len(output_ids):
            raise ValueError(f"{len(output_ids)} output ids but {len(versions)} versions")
        self.current.extend_action(output_ids, logprobs, versions, turn=self.num_turns)
        text = self.tokenizer.decode(list(output_ids), skip_special_tokens=True)
        self.state_text = (self.state_text or "") + text
        return text

    def add_reward(self, reward: float) -> None:
        """Put an env reward on the last generated token so far (the action that earned it)."""
        reward = float(reward)
        self.env_reward += reward
        for seq in reversed(self.sequences):
            positions = [t for t, m in enumerate(seq.action_mask) if m]
            if positions:
                seq.token_rewards[positions[-1]] += reward
                return
        self.unplaced_reward += reward  # no action token yet: kept in the total, nothing to credit

    def add_observation(self, observation: Observation) -> bool:
        """Add the env's next state; return True if it extended the current sequence, False if one started."""
        if isinstance(observation, str):
            if self.state_text is not None and observation.startswith(self.state_text):
                suffix = observation[len(self.state_text):]
                self.current.extend_context(encode_text(self.tokenizer, suffix, first=False) if suffix else [])
                self.state_text = observation
                self.appended_observations += 1
                return True
        else:
            ids = _as_ids(observation)
            # a prompt with images: the env saw (and extends) the engine's ids, one pad per image
            prefix = self.current.input_ids if self.current.engine_prompt is None else self.current.engine_ids
            if len(ids) >= len(prefix) and ids[:len(prefix)] == prefix:
                self.current.extend_context(ids[len(prefix):])
                self.state_text = self.tokenizer.decode(ids, skip_special_tokens=False)
                self.appended_observations += 1
                return True
        self._new_sequence(observation)
        self.new_sequences += 1
        # A new state that shows the prompt's images again (a chat template that re-rendered the conversation):
        # its pads are the images' too, which the engine is sent with it and the trainer expands.
        if self.vision is not None and image_pad_id(self.processor, self.tokenizer) in self.current.input_ids:
            self._show_images()
        return False

    def drop_trailing_context(self) -> None:
        """Remove what follows the last action: an observation the model never acts on (it left no room in
        the context) must not reach the trainer, whose model has no positions for it. A sequence it started
        is dropped whole."""
        seq = self.current
        actions = [t for t, m in enumerate(seq.action_mask) if m]
        if not actions:
            if len(self.sequences) > 1:
                self.sequences.pop()
            return
        cut = actions[-1] + 1
        for values in (seq.input_ids, seq.action_mask, seq.behaviour_logprobs, seq.versions, seq.token_rewards,
                       seq.attention_mask, seq.turns):
            del values[cut:]

    def _new_sequence(self, state: Observation) -> None:
        seq = TokenSequence()
        if isinstance(state, str):
            seq.extend_context(encode_text(self.tokenizer, state, first=True))
            self.state_text = state
        else:
            ids = _as_ids(state)
            seq.extend_context(ids, num_padding=self._left_padding(ids))
            self.state_text = self.tokenizer.decode(ids, skip_special_tokens=False)
        if not seq.input_ids:
            raise ValueError("a state must not be empty: the env returned an empty observation for a new sequence")
        self.sequences.append(seq)

    def _left_padding(self, ids: list[int]) -> int:
        """Leading pad tokens of a left-padded state (OpenAI: fixed-length queries), never all of it."""
        n = 0
        while self.pad_id is not None and n < len(ids) - 1 and ids[n] == self.pad_id:
            n += 1
        return n

    def build(self, sample: dict, finish_reasons: list[str] | None = None, info: dict | None = None) -> Trajectory:
        info = dict(info or {})
        info.update(appended_observations=self.appended_observations, new_sequences=self.new_sequences)
        if self.unplaced_reward:
            info["unplaced_reward"] = self.unplaced_reward
        return Trajectory(sequences=self.sequences, sample=sample, env_reward=self.env_reward,
                          finish_reasons=list(finish_reasons or []), num_turns=self.num_turns, info=info)


def image_pad_id(processor: Any, tokenizer: Any) -> int:
    """The id of `<|image_pad|>`: the processor's own, else the tokenizer's."""
    pad = getattr(processor, "image_token_id", None)
    return int(pad) if pad is not None else int(tokenizer.convert_tokens_to_ids("<|image_pad|>"))


def _as_ids(observation: Any) -> list[int]:
    """Token ids from an observation (list/tuple/array of ints), or a clear error."""
    try:
        ids = [int(i) for i in observation]
    except (TypeError, ValueError) as err:
        raise TypeError(f"an observation must be text (str) or token ids (list[int]), got {type(observation).__name__}") from err
    return ids
