"""Budgets mean bytes: chunk selection under a token budget or a coverage target, and the
fractions every load reports (embedded store on LMDB; the RPC path is in test_budgets_rpc.py)."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
from conftest import make_kv, make_tokens
from hypothesis import given, settings
from hypothesis import strategies as st

from importance.layout import budget_to_tokens, rank_chunks, select_by_coverage, select_chunks
from kvstore.budget import AutoBudget, parse_budget
from kvstore.errors import InvalidInputError
from kvstore.format.key_summary import summary_record_bytes
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

CHUNK = 8
BLOCK = 32

block_scores = st.lists(
    st.lists(st.floats(0, 100, allow_nan=False, width=32), min_size=BLOCK, max_size=BLOCK),
    min_size=1,
    max_size=6,
).map(lambda blocks: [np.asarray(b, np.float32) for b in blocks])


@settings(max_examples=300, deadline=None)
@given(block_scores, st.floats(0.001, 1.0))
def test_a_budget_never_delivers_more_than_it_allows(scores: list[Any], fraction: float) -> None:
    total = BLOCK * len(scores)
    budget = budget_to_tokens(fraction, total)
    selection = select_chunks(scores, budget, CHUNK)
    delivered = sum(s.selected_tokens for s in selection)
    # At most the budget plus one partial chunk over all blocks, and never short of it.
    assert budget <= delivered <= budget + CHUNK - 1
    assert delivered == CHUNK * sum(len(s.chunks) for s in selection)
    # The chunks taken have the best mean scores: none left out beats one taken.
    means = {(b, c): float(np.mean(s[c * CHUNK : (c + 1) * CHUNK])) for b, s in enumerate(scores)
             for c in range(BLOCK // CHUNK)}  # fmt: skip
    taken = {(b, c) for b, s in enumerate(selection) for c in s.chunks}
    if taken and len(taken) < len(means):
        assert min(means[k] for k in taken) >= max(v for k, v in means.items() if k not in taken)


@settings(max_examples=300, deadline=None)
@given(block_scores, st.floats(0.05, 1.0), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_auto_reaches_its_coverage_within_its_bounds(
    scores: list[Any], coverage: float, low: float, high: float
) -> None:
    low, high = min(low, high), max(low, high)
    total = BLOCK * len(scores)
    min_tokens, max_tokens = budget_to_tokens(low, total), budget_to_tokens(high, total)
    chosen = select_by_coverage(scores, CHUNK, coverage, min_tokens, max_tokens)
    delivered = sum(s.selected_tokens for s in chosen.blocks)
    assert min_tokens <= delivered <= max_tokens + CHUNK - 1
    ranking = rank_chunks(scores, CHUNK, normalise=True)
    assert ranking.values.sum() == pytest.approx(1.0)
    taken = len(ranking.values) and delivered // CHUNK
    assert chosen.mass == pytest.approx(float(ranking.values[:taken].sum()))
    if delivered + CHUNK <= max_tokens:  # not stopped by the maximum: the coverage is reached
        assert chosen.mass >= coverage - 1e-9
    if delivered - CHUNK >= min_tokens:  # not held up by the minimum: one chunk fewer falls short
        assert float(ranking.values[: taken - 1].sum()) < coverage


def _stored(store: TieredStore, model: ModelSpec, n: int, seed: int) -> tuple[Any, Any, Any]:
    tokens, kv = make_tokens(n, seed=seed), make_kv(model, n, seed=seed)
    scores = np.random.default_rng(seed).gamma(0.5, size=n).astype(np.float32)
    store.store(tokens, kv, model=model, scores=scores)
    assert store.flush()  # on disk too: the tests count the disk's bytes
    return tokens, kv, scores


@pytest.mark.parametrize("seed", range(4))
def test_partial_loads_deliver_their_budget_at_true_positions(
    store: TieredStore, tiny: ModelSpec, seed: int
) -> None:
    n = 128
    tokens, kv, _ = _stored(store, tiny, n, seed)
    for fraction in (0.1, 0.25, 0.3, 0.5, 0.77):
        with store.load(tokens, model=tiny, budget=fraction) as stream:
            positions, loaded = stream.gather(tiny)
        budget = budget_to_tokens(fraction, n)
        assert budget <= stream.delivered_tokens == len(positions) <= budget + CHUNK - 1
        assert len(set(positions.tolist())) == len(positions) and positions.max() < n
        assert loaded.tobytes() == kv[:, :, :, positions].tobytes()  # each token's KV at its position
        assert stream.delivered_fraction == stream.delivered_tokens / n
        prefix_bytes = sum(m.nbytes for m in store.writer.local_metas())
        assert stream.read_fraction == stream.bytes_read / prefix_bytes
        assert 0.0 < stream.estimated_coverage < 1.0


def test_budget_one_is_the_whole_prefix_bit_exact(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv, _ = _stored(store, tiny, 96, seed=7)
    for budget in (1.0, 1, AutoBudget(coverage=1.0)):
        with store.load(tokens, model=tiny, budget=budget) as stream:
            positions, loaded = stream.gather(tiny)
        order = np.argsort(positions)
        assert positions[order].tolist() == list(range(96))
        assert loaded[:, :, :, order].tobytes() == kv.tobytes()
        # the default (layered) layout's key summaries are prefix bytes a full load does not read
        summaries = 3 * tiny.num_layers * summary_record_bytes(32, tiny.num_kv_heads, tiny.head_dim)
        assert stream.delivered_fraction == 1.0 and stream.bytes_read == stream.prefix_bytes - summaries
        assert stream.estimated_coverage == pytest.approx(1.0)


def test_auto_on_the_store_reports_what_it_delivered(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv, _ = _stored(store, tiny, 128, seed=3)
    fractions = []
    for coverage in (0.3, 0.6, 0.9):
        with store.load(tokens, model=tiny, budget="auto", coverage=coverage) as stream:
            positions, loaded = stream.gather(tiny)
        assert loaded.tobytes() == kv[:, :, :, positions].tobytes()
        assert stream.estimated_coverage >= coverage
        assert 0.1 <= stream.delivered_fraction < 1.0
        fractions.append(stream.delivered_fraction)
    assert fractions == sorted(fractions) and fractions[0] < fractions[-1]
    bounded = AutoBudget(coverage=1.0, min_fraction=0.1, max_fraction=0.25)
    with store.load(tokens, model=tiny, budget=bounded) as stream:
        list(stream)
    assert stream.delivered_tokens == budget_to_tokens(0.25, 128)  # 32: whole chunks
    with store.load(tokens, model=tiny, budget=AutoBudget(coverage=0.01, min_fraction=0.5)) as stream:
        list(stream)
    assert stream.delivered_tokens == 64


@pytest.mark.parametrize(
    ("kwargs", "named"),
    [
        ({"budget": 0.0}, "budget must be a fraction in \\(0, 1\\]"),
        ({"budget": 1.5}, "1.5"),
        ({"budget": float("nan")}, "nan"),
        ({"budget": "most"}, "unknown word 'most'"),
        ({"budget": "auto", "coverage": 0.0}, "coverage must be a fraction in \\(0, 1\\], got 0.0"),
        ({"budget": "auto", "coverage": 1.2}, "coverage .* got 1.2"),
        ({"budget": 0.5, "coverage": 0.9}, "coverage applies only to budget='auto'"),
        ({"budget_tokens": 0}, "budget_tokens must be an integer >= 1, got 0"),
    ],
)
def test_bad_budgets_are_refused_before_anything_is_read(
    store: TieredStore, tiny: ModelSpec, kwargs: dict[str, Any], named: str
) -> None:
    tokens, _, _ = _stored(store, tiny, 64, seed=1)
    before = store.stats().counters
    with pytest.raises(InvalidInputError, match=named):
        store.load(tokens, model=tiny, **kwargs)
    assert store.stats().counters == before  # no load counted, no chunk read


@pytest.mark.parametrize(
    ("make", "named"),
    [
        (
            lambda: AutoBudget(min_fraction=0.6, max_fraction=0.5),
            "min_fraction 0.6 must not exceed max_fraction 0.5",
        ),
        (lambda: AutoBudget(max_fraction=0.0), "max_fraction must be a fraction in \\(0, 1\\], got 0.0"),
        (lambda: parse_budget("lots"), "got 'lots'"),
        (lambda: parse_budget("2"), "got 2.0"),
    ],
)
def test_bad_budget_objects_name_the_value(make: Any, named: str) -> None:
    with pytest.raises(InvalidInputError, match=named):
        make()


def test_parse_budget_reads_fractions_and_auto() -> None:
    assert parse_budget("0.25") == 0.25
    assert parse_budget("AUTO") == AutoBudget()
