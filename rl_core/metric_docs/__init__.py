"""What each metric of a training job's `<run_dir>/metrics.jsonl` means (PPO and the GRPO family, SFT, DPO, the
reward model): one entry per name, in this package (`ppo.py`, `finetune.py`); a name several jobs log has one
entry that says each job's.

An entry is a name as logged, or a pattern where `<...>` stands for one path segment (`reward/fn/<name>`:
one metric per reward function). Each gives the unit, what the number is (as the code that logs it computes
it) and what a healthy run shows. `scripts/metrics_reference.py` writes docs/metrics.md from `GROUPS`, and
tests/ppo/test_metric_docs.py and each job's test (`undocumented_metrics` in tests/jobs.py) run real jobs and
fail when a logged name has no entry here.

A row holds rank 0's numbers unless an entry says otherwise. The training metrics that come from the PPO
epochs (`policy/*`, `value/*`, `rollout_correction/*`, `perf/padding_fraction`, `perf/train_grid_tokens`)
are means over every optimizer step of the step (epochs x minibatches) and over the ranks; a name ending in
`_max` or `_min` takes the largest or smallest instead. The SFT, DPO and reward-model jobs take one optimizer
step per step, and their `train/*` and `eval/*` numbers are over the whole batch or held-out set, every rank's
share summed.
"""

from __future__ import annotations

import re

from rl_core.metric_docs.finetune import FINETUNE_GROUPS
from rl_core.metric_docs.ppo import PPO_GROUPS
from rl_core.metric_docs.schema import Group, Metric

__all__ = ["GROUPS", "METRICS", "Group", "Metric", "describe", "undocumented"]

GROUPS: tuple[Group, ...] = PPO_GROUPS + FINETUNE_GROUPS
METRICS: dict[str, Metric] = {m.name: m for group in GROUPS for m in group.metrics}


def _regex(name: str) -> re.Pattern:
    return re.compile("".join("[^/]+" if part.startswith("<") else re.escape(part)
                              for part in re.split(r"(<[^>]+>)", name) if part) + r"\Z")


_PATTERNS = [(_regex(name), metric) for name, metric in METRICS.items() if "<" in name]


def describe(name: str) -> Metric | None:
    """The entry of a logged metric name: its own, else the pattern it matches; None when it has none."""
    if name in METRICS:
        return METRICS[name]
    return next((metric for regex, metric in _PATTERNS if regex.match(name)), None)


def undocumented(names) -> list[str]:
    """The names, sorted, that no entry describes."""
    return sorted({name for name in names if describe(name) is None})

