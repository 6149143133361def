"""Token scorers: one small interface, the kvsieve scorers and the baselines they beat.

A scorer turns what is known about a prefix into one float per token (higher =
more important). Scores feed the layout (importance/layout.py) and the choice of
tokens under a budget. No torch or model code here: attention statistics arrive
as arrays from the engine.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

Array = np.ndarray[Any, Any]


@dataclass(frozen=True)
class PrefixEvidence:
    """What a scorer may use about a prefix of `num_tokens` tokens.

    Attributes:
        num_tokens: tokens in the prefix.
        prefill_normalized: each key's attention mass during prefill divided by the
            number of queries that could see it (engine_adapter.runner.attention).
        prefill_raw: each key's raw accumulated attention mass during prefill.
        history: decayed sum of real queries' per-query-normalised attention.
    """

    num_tokens: int
    prefill_normalized: Array | None = None
    prefill_raw: Array | None = None
    history: Array | None = None


class Scorer(Protocol):
    """Scores every token of a prefix. Pure: no state, no I/O."""

    @property
    def name(self) -> str:
        """Short name used in reports and benchmark keys."""
        ...

    def score(self, evidence: PrefixEvidence) -> Array:
        """One float32 per token; higher = load first."""
        ...


@dataclass(frozen=True)
class PrefillScorer:
    """kvsieve's prefill scorer: per-query-normalised attention mass."""

    name: str = "prefill"

    def score(self, evidence: PrefixEvidence) -> Array:
        return _required(evidence.prefill_normalized, "prefill_normalized", evidence.num_tokens)


@dataclass(frozen=True)
class HistoryScorer:
    """Attention of real queries, accumulated with decay (importance/history.py)."""

    name: str = "history"

    def score(self, evidence: PrefixEvidence) -> Array:
        return _required(evidence.history, "history", evidence.num_tokens)


@dataclass(frozen=True)
class CombinedScorer:
    """Prefill and history, each scaled to unit mean, mixed with weight `history_weight`.

    Falls back to whichever evidence exists.
    """

    history_weight: float = 0.5
    name: str = "combined"

    def score(self, evidence: PrefixEvidence) -> Array:
        parts = [
            (evidence.prefill_normalized, 1.0 - self.history_weight),
            (evidence.history, self.history_weight),
        ]
        present = [(_unit_mean(a), w) for a, w in parts if a is not None]
        if not present:
            raise ValueError("combined scorer needs prefill_normalized or history")
        total = sum(w for _, w in present) or 1.0
        return np.sum([a * (w / total) for a, w in present], axis=0).astype(np.float32)


@dataclass(frozen=True)
class RawMassScorer:
    """Baseline: raw accumulated prefill attention (favours early tokens)."""

    name: str = "raw_mass"

    def score(self, evidence: PrefixEvidence) -> Array:
        return _required(evidence.prefill_raw, "prefill_raw", evidence.num_tokens)


@dataclass(frozen=True)
class RandomScorer:
    """Baseline: a random order (seeded)."""

    seed: int = 0
    name: str = "random"

    def score(self, evidence: PrefixEvidence) -> Array:
        return np.random.default_rng(self.seed).random(evidence.num_tokens).astype(np.float32)


@dataclass(frozen=True)
class RecentScorer:
    """Baseline: the most recent tokens first."""

    name: str = "recent"

    def score(self, evidence: PrefixEvidence) -> Array:
        return np.arange(evidence.num_tokens, dtype=np.float32)


@dataclass(frozen=True)
class SinkRecentScorer:
    """Baseline (StreamingLLM-style): the first `sink` tokens, then the most recent."""

    sink: int = 4
    name: str = "sink_recent"

    def score(self, evidence: PrefixEvidence) -> Array:
        scores = np.arange(evidence.num_tokens, dtype=np.float32)
        scores[: self.sink] = evidence.num_tokens + 1.0
        return scores


def _required(values: Array | None, field: str, num_tokens: int) -> Array:
    if values is None or len(values) != num_tokens:
        raise ValueError(f"evidence.{field} must hold {num_tokens} scores")
    return np.asarray(values, dtype=np.float32)


def _unit_mean(values: Array) -> Array:
    values = np.asarray(values, dtype=np.float64)
    mean = values.mean() if values.size else 0.0
    return values / mean if mean > 0 else values
