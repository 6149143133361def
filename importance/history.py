"""Scores from the history of real queries: per-block accumulation with exponential decay.

After each request the engine reports how its new tokens attended to the prefix
(normalised per query). A block's history score is the decayed sum of those
reports, so tokens that real queries keep looking at rise, and old interest fades
with a configurable half-life counted in reports.
"""

from __future__ import annotations

from typing import Any

import numpy as np

Array = np.ndarray[Any, Any]


def decay_factor(half_life_reports: float) -> float:
    """Per-report multiplier that halves a score after `half_life_reports` reports."""
    if half_life_reports <= 0:
        raise ValueError(f"half_life_reports must be > 0, got {half_life_reports}")
    return float(0.5 ** (1.0 / half_life_reports))


def accumulate(old: Array | None, report: Array, decay: float) -> Array:
    """New history score of a block: decay * old + report (old None = first report)."""
    report = np.asarray(report, dtype=np.float32)
    if old is None:
        return report.copy()
    return (decay * np.asarray(old, dtype=np.float32) + report).astype(np.float32)
