"""When the engine loads a cached prefix layer by layer with query-aware chunks, and how many.

docs/importance.md ("Layer-by-layer loading in the engine") has the measurements behind
the thresholds. The layered path is taken when all of these hold, else the static
importance order (`PrefixStore.load(budget)`) decides:

- the budget is partial: a fraction below 1.0 (at 1.0 everything is read anyway) or
  `auto` (the store's own coverage plan says how much; the queries say which);
- the budget's fraction is at least `MIN_LAYERED_FRACTION`: below it the 6.6 %
  summary leaves too little for chunks and the static order answers better;
- it leaves room for the summary, the forced first and last chunks and at least one
  chosen chunk;
- the request has at least `MIN_QUERY_TOKENS` new tokens after the matched prefix;
- the store holds the prefix in the layered layout (`open_layers` matched > 0).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from typing import Any, NamedTuple

from importance.query_select import CHUNK_TOKENS, RECENT_TOKENS, SINK_TOKENS
from kvstore.api import LayeredLoad, PrefixStore
from kvstore.budget import AutoBudget, Budget, resolve_budget
from kvstore.model import ModelSpec

#: New tokens needed to choose with. One token (plain continuation) overfits: top-1 0.73
#: against 0.82 for the static order (issue 9); a chat turn brings at least its markers
#: ("<|im_end|>\n<|im_start|>user\n ... <|im_start|>assistant\n", 10+ tokens) and the
#: benchmark's questions 15-25. 4 keeps continuations of a few tokens on the static order.
MIN_QUERY_TOKENS = 4
#: Smallest budget fraction that takes the layered path ("at least ~0.2", docs/importance.md).
MIN_LAYERED_FRACTION = 0.2


class LayeredPlan(NamedTuple):
    """An open layered load (the caller closes it), the chunks to read in every layer, and the
    fraction of the prefix's bytes the whole request may read (the decode-time top-up's limit)."""

    load: LayeredLoad
    chunks: int
    fraction: float


def plan_layered(
    store: PrefixStore, ids: Sequence[int], budget: Budget, *, model: ModelSpec, namespace: str,
    reserve: Callable[[int], float] | None = None,
) -> LayeredPlan | None:  # fmt: skip
    """The layered load to use for prompt `ids` at `budget`, or None for the static path.

    Opens `store.open_layers(ids[:-1])` (reads no KV) only when the budget qualifies;
    closes it again when the path is not taken. `reserve(matched tokens)` is the share of the
    prefix's bytes left out of the chunks chosen (the decode-time top-up's part of the budget).

    Raises:
        InvalidInputError: a bad budget (as `PrefixStore.load` would).
    """
    resolved = resolve_budget(budget)
    if isinstance(resolved, float | int) and not MIN_LAYERED_FRACTION <= resolved < 1.0:
        return None
    if len(ids) < 1 + MIN_QUERY_TOKENS:
        return None  # too short a prompt: too few new tokens whatever is cached
    # Every PrefixStore opens layered loads; one with no layered blocks (or an older sidecar) matches 0.
    load = store.open_layers(list(ids[:-1]), model=model, namespace=namespace)
    edges = edge_chunk_count(int(load.chunk_tokens))
    try:
        fraction = _fraction(store, ids, resolved, load, model, namespace)
        chunks = 0 if fraction is None else _chunks_keeping(fraction, load, reserve, edges)
    except BaseException:
        load.close()
        raise
    if fraction is None or chunks <= edges:
        load.close()
        return None
    return LayeredPlan(load, chunks, fraction)


def _chunks_keeping(
    fraction: float, load: LayeredLoad, reserve: Callable[[int], float] | None, edges: int
) -> int:
    """Chunks per layer `fraction` buys once `reserve(matched tokens)` is kept back; the reserve
    never takes away the one chosen chunk beside the `edges` that the whole fraction buys."""
    kept = 0.0 if reserve is None else reserve(int(load.matched_tokens))
    floor = min(chunks_for_fraction(fraction, load), edges + 1)
    return max(chunks_for_fraction(fraction - kept, load), floor)


def _fraction(
    store: PrefixStore, ids: Sequence[int], budget: float | int | AutoBudget, load: LayeredLoad,
    model: ModelSpec, namespace: str,
) -> float | None:  # fmt: skip
    """The fraction of the prefix's bytes `load` may read, or None when the layered path does
    not qualify."""
    n = int(load.matched_tokens)
    if n <= 0 or len(ids) - n < MIN_QUERY_TOKENS or n % int(load.chunk_tokens):
        return None
    if isinstance(budget, AutoBudget):
        fraction = static_auto_fraction(store, ids, budget, model, namespace)
        return None if fraction is None or fraction < MIN_LAYERED_FRACTION else fraction
    return float(budget)


def chunks_for_fraction(fraction: float, load: LayeredLoad) -> int:
    """Chunks per layer that `fraction` of the prefix's bytes buys once the summaries are paid.

    floor((fraction - summary_bytes / prefix_bytes) x matched / chunk_tokens), within
    [0, chunks of the prefix].
    """
    n, chunk = int(load.matched_tokens), int(load.chunk_tokens)
    summary = load.summary_bytes / load.prefix_bytes if load.prefix_bytes else 0.0
    return max(0, min(n // chunk, math.floor((fraction - summary) * n / chunk + 1e-9)))


def edge_chunk_count(chunk_tokens: int = CHUNK_TOKENS) -> int:
    """Chunks always read per layer: those holding the first and last tokens of the prefix."""
    return -(-SINK_TOKENS // chunk_tokens) + -(-RECENT_TOKENS // chunk_tokens)


def static_auto_fraction(
    store: PrefixStore, ids: Sequence[int], budget: AutoBudget, model: ModelSpec, namespace: str
) -> float | None:
    """The fraction of the prefix the store's own `auto` plan would deliver (reads no chunk).

    An embedded store plans when the load opens; a sidecar's stream says its plan only
    once it streams, so None there (the static path then serves `auto`).
    """
    stream: Any = store.load(list(ids[:-1]), model=model, namespace=namespace, budget=budget)
    with stream:
        matched, selected = int(stream.matched_tokens), int(stream.selected_tokens)
    return selected / matched if matched else None
