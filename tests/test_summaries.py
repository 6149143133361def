"""Key summaries and query-aware chunk selection (importance/summaries.py, importance/selection.py)."""

from __future__ import annotations

import numpy as np
import pytest

from importance.selection import choose_chunks, edge_chunks, mix_static
from importance.summaries import (
    AutoBudget,
    ChunkLayout,
    FixedBudget,
    auto_budget,
    chunk_mass,
    fixed_budget,
    parse_budget,
    probe_head,
    quantize_keys,
    static_chunk_mass,
    summarize,
)

RNG = np.random.default_rng(7)
KV_HEADS, QUERY_HEADS, DIM = 3, 9, 64


def keys(n: int = 200) -> np.ndarray:
    k = RNG.standard_normal((KV_HEADS, n, DIM)).astype(np.float32)
    k[:, :, :4] *= 8.0  # a few large channels, as RoPE'd keys have
    return k


def queries(m: int = 5) -> np.ndarray:
    return RNG.standard_normal((QUERY_HEADS, m, DIM)).astype(np.float32)


def exact_chunk_logits(k: np.ndarray, q: np.ndarray, layout: ChunkLayout, scale: float) -> np.ndarray:
    group = QUERY_HEADS // KV_HEADS
    out = np.empty((QUERY_HEADS, q.shape[1], layout.num_chunks))
    for h in range(QUERY_HEADS):
        token = (q[h] @ k[h // group].T) * scale  # (m, n) prompt order
        for c in range(layout.num_chunks):
            members = layout.order[c * layout.chunk_tokens : (c + 1) * layout.chunk_tokens]
            out[h, :, c] = np.log(np.exp(token[:, members]).sum(axis=1))
    return out


@pytest.mark.parametrize("layout_kind", ["natural", "importance"])
def test_minmax_bounds_every_dot_product_of_its_chunk(layout_kind: str) -> None:
    k, q = keys(), queries()
    layout = (
        ChunkLayout.natural(200, 16)
        if layout_kind == "natural"
        else ChunkLayout.by_importance(RNG.random(200), 16, block_tokens=64)
    )
    bound = summarize("minmax", k, layout).chunk_logits(q, scale=1.0) - np.log(layout.sizes)
    chunk = layout.chunk_of_token()
    for h in range(QUERY_HEADS):
        dots = q[h] @ k[h // 3].T  # (m, n)
        worst = np.full((q.shape[1], layout.num_chunks), -np.inf)
        np.maximum.at(worst.T, chunk, dots.T)
        assert np.all(bound[h] >= worst - 1e-3)
    single = summarize("minmax", k, ChunkLayout.natural(200, 1)).chunk_logits(q, scale=1.0)
    assert np.allclose(single[0], q[0] @ k[0].T, atol=1e-3)  # one-token chunks: the bound is exact


def test_exact_summary_gives_the_true_chunk_logits_and_lowbit_is_close() -> None:
    k, q = keys(), queries()
    layout = ChunkLayout.natural(200, 16)
    truth = exact_chunk_logits(k, q, layout, 0.125)
    assert np.allclose(summarize("exact", k, layout).chunk_logits(q, 0.125), truth, atol=1e-3)
    eight_bit = summarize("lowbit8", k, layout).chunk_logits(q, 0.125)
    two_bit = summarize("lowbit2", k, layout).chunk_logits(q, 0.125)
    assert np.abs(eight_bit - truth).max() < np.abs(two_bit - truth).max()
    assert np.corrcoef(two_bit.ravel(), truth.ravel())[0, 1] > 0.8  # random keys: the hardest case


def test_summary_bytes_fractions() -> None:
    k, layout = keys(256), ChunkLayout.natural(256, 16)
    # min+max: 2 keys per 16-token chunk; K+V: 32 keys' worth.
    assert summarize("minmax", k, layout).bytes_fraction == pytest.approx(1 / 16)
    assert summarize("mean", k, layout).bytes_fraction == pytest.approx(1 / 32)
    assert summarize("exact", k, layout).bytes_fraction == pytest.approx(1 / 2)
    # 2 bits per key channel against 32 bits (K+V fp16), plus a fp16 offset and step per channel per block.
    assert summarize("lowbit2", k, layout).bytes_fraction == pytest.approx(1 / 16 + 1 / 256)


def test_a_probe_summary_is_one_heads_lowbit_scored_by_that_heads_queries_only() -> None:
    k, q = keys(256), queries()
    k[1] *= 3.0  # head 1 spreads the most
    layout = ChunkLayout.natural(256, 16)
    assert probe_head(k) == 1
    probe, full = summarize("probe2", k, layout), summarize("lowbit2", k, layout)
    assert probe.bytes_fraction == pytest.approx(full.bytes_fraction / KV_HEADS)
    logits = probe.chunk_logits(q, 0.125)
    group = QUERY_HEADS // KV_HEADS
    assert logits.shape == (group, q.shape[1], layout.num_chunks)  # head 1's three query heads
    # the same logits as the full summary's for those query heads: head 1's codes are the same
    assert np.allclose(logits, full.chunk_logits(q, 0.125)[group : 2 * group], atol=1e-4)
    with pytest.raises(ValueError, match="unknown summary kind"):
        summarize("probe9", k, layout)


def test_quantized_keys_stay_within_half_a_step() -> None:
    k = keys(300)
    for bits in (2, 4):
        q = quantize_keys(k, bits, group_tokens=256)
        for start in (0, 256):
            part, approx = k[:, start : start + 256], q[:, start : start + 256]
            step = (part.max(axis=1) - part.min(axis=1)) / ((1 << bits) - 1)
            # fp16 offsets and steps (rounded outwards): half a step plus fp16's rounding
            assert np.all(np.abs(part - approx) <= step[:, None] / 2 * (1 + 2e-3) + 1e-5)
        assert len({float(x) for x in q[0, :256, 0]}) <= 1 << bits


def test_chunk_mass_rows_sum_to_one_per_layer_and_per_kv_head() -> None:
    layout = ChunkLayout.natural(200, 16)
    logits = summarize("mean", keys(), layout).chunk_logits(queries(), 0.125)
    per_head = chunk_mass(logits, KV_HEADS, per_kv_head=True)
    per_layer = chunk_mass(logits, KV_HEADS, per_kv_head=False)
    assert per_head.shape == (KV_HEADS, layout.num_chunks) and per_layer.shape == (1, layout.num_chunks)
    assert np.allclose(per_head.sum(axis=1), 1.0) and np.allclose(
        per_layer.mean(axis=0), per_head.mean(axis=0)
    )


@pytest.mark.parametrize("fraction", [0.07, 0.1, 0.25, 0.37, 0.5, 1.0])
@pytest.mark.parametrize("summary", [0.0, 0.0625])
def test_a_fixed_budget_is_never_exceeded(fraction: float, summary: float) -> None:
    layout = ChunkLayout.natural(1000, 16)  # the last chunk holds 8 tokens
    mass = RNG.random((3, layout.num_chunks))
    forced = edge_chunks(layout, 1, 1)
    choice = choose_chunks(mass, layout, FixedBudget(fraction), summary, forced)
    tokens = (choice.chosen * layout.sizes).sum(axis=1)
    assert np.all(tokens + summary * 1000 <= fraction * 1000 + 1e-6)
    assert np.all(choice.delivered_fraction <= fraction + 1e-9)
    assert np.all(fraction * 1000 - (tokens + summary * 1000) < 16)  # within one chunk of the budget
    if fraction >= 0.25:
        assert choice.chosen[:, forced].all()  # sinks and the recent chunk come first


def test_a_budget_below_the_summary_is_refused() -> None:
    layout = ChunkLayout.natural(160, 16)
    with pytest.raises(ValueError, match=r"budget 0.05 .*summary alone.*0.0625"):
        choose_chunks(np.ones((1, 10)), layout, FixedBudget(0.05), summary_fraction=0.0625)


def test_the_top_chunks_by_mass_are_chosen() -> None:
    layout = ChunkLayout.natural(160, 16)
    mass = np.array([[0.0, 5, 1, 0, 9, 0, 0, 2, 0, 0]])
    choice = choose_chunks(mass, layout, FixedBudget(0.3))
    assert np.flatnonzero(choice.chosen[0]).tolist() == [1, 4, 7]
    assert choice.covered_mass[0] == pytest.approx(16 / 17)
    assert layout.token_mask(choice.chosen)[0].sum() == 48


def test_auto_stops_at_coverage_within_its_bounds() -> None:
    layout = ChunkLayout.natural(1600, 16)
    peaked = np.zeros((1, 100))
    peaked[0, :3] = 1.0
    flat = np.ones((1, 100))
    budget = auto_budget(coverage=0.9, min_fraction=0.1, max_fraction=0.5)
    low = choose_chunks(peaked, layout, budget)  # 3 chunks cover it all: the min fraction applies
    high = choose_chunks(flat, layout, budget)  # 90 % of a flat mass needs 90 chunks: capped at 50 %
    assert low.delivered_fraction[0] == pytest.approx(0.1) and low.chosen[0, :3].all()
    assert high.delivered_fraction[0] == pytest.approx(0.5)
    middle = choose_chunks(flat, layout, auto_budget(0.3, 0.1, 0.5))
    assert middle.delivered_fraction[0] == pytest.approx(0.3) and middle.covered_mass[0] >= 0.3


def test_summary_bytes_count_against_auto_bounds() -> None:
    layout = ChunkLayout.natural(1600, 16)
    choice = choose_chunks(np.ones((2, 100)), layout, AutoBudget(1.0, 0.1, 0.25), summary_fraction=0.05)
    assert np.all(choice.delivered_fraction <= 0.25 + 1e-9)


def test_edge_chunks_follow_the_layout() -> None:
    natural = ChunkLayout.natural(64, 16)
    assert edge_chunks(natural, 1, 1).tolist() == [True, False, False, True]
    scores = np.zeros(64)
    scores[[0, 63]] = 1.0  # sink and last token ranked first: both in chunk 0 of the importance order
    by_importance = ChunkLayout.by_importance(scores, 16, 64)
    marks = edge_chunks(by_importance, 1, 1)
    assert marks[0] and marks.sum() >= 2


def test_static_mass_and_mixing() -> None:
    layout = ChunkLayout.natural(64, 16)
    static = static_chunk_mass(np.repeat([4.0, 0.0, 0.0, 4.0], 16), layout)
    assert static.tolist() == [0.5, 0.0, 0.0, 0.5]
    mixed = mix_static(np.array([[0.0, 1.0, 0.0, 0.0]]), static, 0.5)
    assert np.allclose(mixed, [[0.25, 0.5, 0.0, 0.25]])
    with pytest.raises(ValueError, match=r"static_weight .* 1.5"):
        mix_static(mixed, static, 1.5)


@pytest.mark.parametrize("bad", [0, -0.1, 1.5, float("nan")])
def test_bad_budgets_name_the_value(bad: float) -> None:
    with pytest.raises(ValueError, match=f"budget must be in \\(0, 1\\], got {bad!r}"):
        fixed_budget(bad)
    with pytest.raises(ValueError, match=f"coverage must be in \\(0, 1\\], got {bad!r}"):
        auto_budget(coverage=bad)


def test_budget_words() -> None:
    assert parse_budget("0.25") == FixedBudget(0.25)
    assert parse_budget(" AUTO ") == AutoBudget()
    assert parse_budget("auto:0.8") == AutoBudget(coverage=0.8)
    with pytest.raises(ValueError, match="'most'"):
        parse_budget("most")
    with pytest.raises(ValueError, match=r"coverage must be in .* got 1.2"):
        parse_budget("auto:1.2")
    with pytest.raises(ValueError, match=r"min_fraction 0.6 is above max_fraction 0.5"):
        auto_budget(0.9, 0.6, 0.5)
    with pytest.raises(ValueError, match="unknown summary kind 'lowbit9'"):
        summarize("lowbit9", keys(32), ChunkLayout.natural(32, 16))
