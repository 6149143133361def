"""Load budgets: a fraction of the prefix's tokens, a token count, or `auto` (a coverage target).

A fraction or count is honest in bytes: the load delivers whole chunks, best mean
score first, until they hold the budget's tokens (at most one partial chunk over).
`auto` delivers the fewest chunks whose estimated attention mass reaches a coverage
target, between a minimum and a maximum fraction. See docs/importance.md.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvstore.errors import InvalidInputError

AUTO = "auto"


@dataclass(frozen=True)
class AutoBudget:
    """`budget="auto"`: the fewest chunks holding `coverage` of the estimated attention mass.

    Attributes:
        coverage: target share of the mass, in (0, 1].
        min_fraction: deliver at least this share of the prefix's tokens, in (0, 1].
        max_fraction: and at most this share (rounded up to a chunk), in [min_fraction, 1].
    """

    coverage: float = 0.9
    min_fraction: float = 0.1
    max_fraction: float = 1.0

    def __post_init__(self) -> None:
        for name in ("coverage", "min_fraction", "max_fraction"):
            _check_fraction(name, getattr(self, name))
        if self.min_fraction > self.max_fraction:
            raise InvalidInputError(
                f"min_fraction {self.min_fraction!r} must not exceed max_fraction {self.max_fraction!r}"
            )


Budget = float | str | AutoBudget
"""What `load(budget=...)` accepts: a fraction in (0, 1], the word "auto", or an AutoBudget."""


def resolve_budget(budget: Any, budget_tokens: Any = None, coverage: Any = None) -> float | int | AutoBudget:
    """Check a load's budget arguments and return one typed budget, before anything is read.

    Returns:
        A token count (int) when `budget_tokens` is given, else a fraction (float) or
        an `AutoBudget` (`coverage` applies only to "auto").

    Raises:
        InvalidInputError: naming the bad value.
    """
    if budget_tokens is not None:
        if (
            isinstance(budget_tokens, bool)
            or not isinstance(budget_tokens, int | np.integer)
            or budget_tokens < 1
        ):
            raise InvalidInputError(f"budget_tokens must be an integer >= 1, got {budget_tokens!r}")
        return int(budget_tokens)
    if isinstance(budget, str) and budget.strip().lower() == AUTO:
        budget = AutoBudget()
    if isinstance(budget, AutoBudget):
        if coverage is None:
            return budget
        return AutoBudget(
            float(_check_fraction("coverage", coverage)), budget.min_fraction, budget.max_fraction
        )
    if coverage is not None:
        raise InvalidInputError(f"coverage applies only to budget='auto', got budget={budget!r}")
    if isinstance(budget, str):
        raise InvalidInputError(f"budget must be a fraction in (0, 1] or 'auto', got unknown word {budget!r}")
    return float(_check_fraction("budget", budget))


def parse_budget(text: str) -> float | AutoBudget:
    """A budget from a command line: 'auto' or a number; InvalidInputError names the value."""
    if text.strip().lower() == AUTO:
        return AutoBudget()
    try:
        value = float(text)
    except ValueError:
        raise InvalidInputError(f"budget must be a fraction in (0, 1] or 'auto', got {text!r}") from None
    return float(_check_fraction("budget", value))


def _check_fraction(name: str, value: Any) -> float:
    ok = isinstance(value, int | float | np.floating) and not isinstance(value, bool)
    if not ok or not 0.0 < float(value) <= 1.0 or math.isnan(float(value)):
        raise InvalidInputError(f"{name} must be a fraction in (0, 1], got {value!r}")
    return float(value)
