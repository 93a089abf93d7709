"""The shape of an entry of the metrics registry: a metric and the group it is listed under."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Metric:
    name: str  # as logged, or a pattern: <...> is one path segment
    unit: str
    meaning: str
    healthy: str


@dataclass(frozen=True)
class Group:
    title: str
    about: str
    metrics: tuple[Metric, ...]
