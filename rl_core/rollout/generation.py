"""SGLang's /generate answer reduced to what a trajectory keeps: the engine's ids, their logprobs and the
policy version of each token, checked to be whole."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


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
