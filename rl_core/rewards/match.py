"""An exact-answer reward for one-word or one-number answers ("red", "3"), which the math checker
(`rl_core.rewards.math`) does not read: words are no numbers to it.

`exact_answer` gives 1.0 when the completion, stripped of surrounding space, case and a closing full stop,
is the reference `sample[answer_key]` so normalised too, else 0.0: "Red." and " red" match "red", "red and
blue" does not. The vision recipe (configs/grpo_vision_shapes.yaml) scores its colours and counts with it.
"""

from __future__ import annotations

from rl_core.rewards import batched


def normalise(text) -> str:
    """Lower case, inner space runs made one space, the ends' space and a final `.`/`!` dropped."""
    return " ".join(str(text).lower().split()).rstrip(".!").strip()


@batched  # cheap: a whole rollout in one call, not a worker round trip per completion
def exact_answer(completions: list[str], samples: list[dict], answer_key: str = "answer") -> list[float]:
    """1.0 for each completion that is its row's `answer_key` (case, outer space and a final full stop aside)."""
    return [float(normalise(text) == normalise(sample[answer_key]) != "") for text, sample in zip(completions, samples)]
