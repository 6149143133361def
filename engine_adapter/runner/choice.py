"""Which plan a request runs: `choose`, from what each plan measured where the request stands, the
estimates filling in only what was never measured; and where a request stands (`request_for`).

The rule (issue 47), at the request's key (engine_adapter/runner/plans.py):

1. Nothing measured there yet: the least estimate (a split must beat the others by `MARGIN`, the
   estimate's noise). The first request at a new length may so try a plan; before any prefill was
   measured on the device, the whole prefix is loaded (it costs least to undo).
2. Some plans measured there: the least measured. A plan never measured there is tried instead only
   where its estimate (rates, as its kind's runs turned out: calibration.py) beats that by
   `EXPLORE_MARGIN`, no plan of its kind lost there by more than `TOLERANCE` (one split that
   lost stops the others being tried there), and the place has seen fewer than
   `EXPLORE_REQUESTS` requests (after that, a later change of the estimates does not send one
   request off to try something new). A measured plan is never tried again on its
   estimate: once a plan measured more than `TOLERANCE` x another's time (or any slower at all), it
   runs no more at that key while the other keeps its measurement (engine_adapter/runner/
   measured.py says how measurements follow drift).

So an estimate that is wrong costs at most one request per kind and key, and each such request
corrects its kind's estimates for the rest. Deciding takes tens of
microseconds (bench/micro/test_micro_choice.py): a handful of options, each a dictionary look-up
and a few multiplications.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.layered_policy import MIN_LAYERED_FRACTION
from engine_adapter.runner.plans import FULL, RECOMPUTE, SPLIT, Option, Request
from kvstore.budget import Budget, resolve_budget
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

#: A split must beat the best of the other plans' estimates by this share (the estimate's noise).
MARGIN = 0.05
#: A plan never measured at a key is tried there only if estimated this much under the best measured.
EXPLORE_MARGIN = 0.1
#: The promise: no plan measured more than this many times another's runs again at that key.
TOLERANCE = 1.05
#: Plans not measured at a place are tried there during its first this many requests only: after
#: that, the estimates have had their chance, and the place keeps to what it measured.
EXPLORE_REQUESTS = 8


@dataclass(frozen=True)
class SplitPlan:
    """A request's choice: compute tokens [0, compute_tokens) of the prefix from scratch, load the
    rest of it (or, query-aware, the chunks its question needs); with the seconds behind it and
    why, for `generate -v`.

    Attributes:
        option: the plan (engine_adapter/runner/plans.py), what its run is filed under.
        estimate_s: the plan's measured seconds where `measured`, else its estimate.
        recompute_s, full_s: the estimates of recomputing and of a full load, for the reason.
    """

    option: Option
    compute_tokens: int
    prefix_tokens: int
    estimate_s: float
    recompute_s: float
    full_s: float
    reason: str
    measured: bool = False

    @property
    def load_tokens(self) -> int:
        """Prefix tokens loaded."""
        return self.prefix_tokens - self.compute_tokens

    @property
    def kind(self) -> str:
        """ "full", "recompute", "split" or "query-aware"."""
        return self.option.kind


def choose(costs: CostModel, request: Request) -> SplitPlan:
    """The plan `request` runs (module docstring)."""
    options = request.options()
    measured = [(s, o) for o in options if (s := costs.measured_s(o, request)) is not None]
    estimates = [(e, o) for o in options if (e := costs.estimate_s(o, request)) is not None]
    if measured:
        best_s, best = min(measured, key=_seconds)
        tried = {o for _, o in measured}
        lost = {o.kind for s, o in measured if s > TOLERANCE * best_s}  # e.g. one split lost: no other
        exploring = costs.requests_at(request) < EXPLORE_REQUESTS
        trials = [
            (e, o) for e, o in estimates
            if exploring and o not in tried and o.kind not in lost and e < (1 - EXPLORE_MARGIN) * best_s
        ]  # fmt: skip
        if not trials:
            why = f"{best.label}: measured {best_s:.3f} s, the least of {len(measured)} measured here"
            return _plan(costs, request, best, best_s, why, measured=True)
        e, trial = min(trials, key=_seconds)
        return _plan(costs, request, trial, e, f"trying {trial.label}: est. {e:.3f} s against "
                     f"{best.label} measured {best_s:.3f} s")  # fmt: skip
    if not costs.prefill_measured:  # nothing measured on this device yet: what costs least to undo
        full = costs.estimate_s(Option(FULL), request) or 0.0
        return _plan(costs, request, Option(FULL), full, "full load (no prefill measured yet)")
    e, least = min(estimates, key=lambda p: p[0] / (1 - MARGIN) if p[1].kind == SPLIT else p[0])
    return _plan(costs, request, least, e, f"{least.label}: est. {e:.3f} s (nothing measured here yet)")


def _seconds(pair: tuple[float, Option]) -> float:
    return pair[0]


def _plan(
    costs: CostModel, request: Request, option: Option, seconds: float, why: str, measured: bool = False
) -> SplitPlan:
    recompute = costs.estimate_s(Option(RECOMPUTE), request) or 0.0
    full = costs.estimate_s(Option(FULL), request) or 0.0
    words = f"{why}; est. recompute {recompute:.3f} s, full load {full:.3f} s ({costs.rate_words()})"
    compute = request.compute_tokens(option)
    return SplitPlan(option, compute, request.prefix_tokens, seconds, recompute, full, words, measured)


# -- where a request stands ----------------------------------------------------------------------


def request_for(
    store: Any, ids: Sequence[int], model: ModelSpec, namespace: str, *, split: bool,
    query_aware: float | None,
) -> Request:  # fmt: skip
    """Where prompt `ids` stands: one lookup of an embedded store (O(blocks), no data read). With
    no embedded store, or nothing cached, it stands at prefix 0: it can only be computed.

    Args:
        split: recompute and splits may be chosen.
        query_aware: the budget fraction of a query-aware load that may be chosen (None: not one).
    """
    if not isinstance(store, TieredStore) or len(ids) < 2:
        return Request(len(ids), token_bytes=model.token_bytes)
    # All but the last token (computed whatever is cached): read off the list, not sliced and then
    # converted (a 32k-token prompt's list costs 0.7 ms to convert, as much as the rest together).
    prefix, in_memory = memory_fraction(store, np.fromiter(ids, np.int64, len(ids) - 1), model, namespace)
    block = store.info.block_tokens or max(prefix, 1)
    qa = query_aware if prefix else None
    return Request(len(ids), prefix, in_memory, model.token_bytes, block, split, qa)


def query_aware_fraction(budget: Budget) -> float | None:
    """The budget as a fraction a query-aware load may be chosen at (the layered policy's range),
    else None (a full budget, a token count, `auto`: the engine loads the whole prefix on a device)."""
    resolved = resolve_budget(budget)
    if isinstance(resolved, float) and MIN_LAYERED_FRACTION <= resolved < 1.0:
        return resolved
    return None


def memory_fraction(
    store: TieredStore, ids: Sequence[int] | np.ndarray[Any, Any], model: Any, namespace: str
) -> tuple[int, float]:
    """(prefix tokens matched, share of their blocks the memory tier holds)."""
    found = store.lookup(np.asarray(ids), model=model, namespace=namespace)
    return int(found.num_tokens), (found.memory_blocks / found.num_blocks if found.num_blocks else 1.0)
