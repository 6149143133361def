"""The bounded top-up during decoding (bench/quality/topup.py) and per-row masks in the masking hook."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from bench.quality.masking import MaskPlan, masking
from bench.quality.methods import chooser
from bench.quality.quality_bench import SHIPPED_CONFIG, forward, prefix_state
from bench.quality.topup import extender, top_up
from importance.summaries import ChunkLayout, FixedBudget

LAYOUT = ChunkLayout.natural(64, 8)  # 8 chunks of 8 tokens
PREFIX, NEW, OBSERVE = 96, 12, 4


def _base(*chunks: int) -> np.ndarray:
    return np.asarray(LAYOUT.token_mask(np.isin(np.arange(LAYOUT.num_chunks), chunks)))


def test_a_threshold_above_one_fetches_nothing() -> None:
    shares = np.random.default_rng(0).dirichlet(np.ones(8), size=6)
    out = top_up(_base(0, 7), shares, LAYOUT, theta=1.01, cap_tokens=64, first_row=0)
    assert out.fetched_tokens == 0
    assert (out.rows == _base(0, 7)[None]).all()


def test_the_cap_is_never_exceeded() -> None:
    rng = np.random.default_rng(1)
    for cap in (0, 7, 8, 20, 64):
        shares = rng.dirichlet(np.full(8, 0.3), size=10)  # peaked: many shares above theta
        out = top_up(_base(0), shares, LAYOUT, theta=0.05, cap_tokens=cap, first_row=0)
        extra = int(out.rows.any(axis=0).sum()) - 8
        assert out.fetched_tokens == extra <= cap
        wanted = int((shares[:, 1:] > 0.05).any(axis=0).sum())  # missing chunks some row wants
        assert extra == 8 * min(cap // 8, wanted)  # equal chunks: every wanted one while the cap has room


def test_a_chunk_fetched_at_step_t_is_hidden_from_earlier_rows() -> None:
    shares = np.full((6, 8), 0.01)
    shares[3, 5] = 0.9  # row 3 wants chunk 5
    shares[1, 4] = 0.9  # row 1 wants chunk 4, but is a prompt row (first_row=2)
    out = top_up(_base(0), shares, LAYOUT, theta=0.1, cap_tokens=64, first_row=2)
    chunk5, chunk4 = slice(40, 48), slice(32, 40)
    assert not out.rows[:3, chunk5].any() and out.rows[3:, chunk5].all()
    assert not out.rows[:, chunk4].any()
    assert out.fetched_tokens == 8


def test_fetches_go_by_descending_share_within_the_cap() -> None:
    shares = np.zeros((1, 8))
    shares[0, [2, 3, 4]] = [0.2, 0.5, 0.3]
    out = top_up(_base(0), shares, LAYOUT, theta=0.1, cap_tokens=16, first_row=0)
    fetched = sorted({int(t) // 8 for t in np.flatnonzero(out.rows[0] & ~_base(0))})
    assert fetched == [3, 4]


def test_bad_shapes_are_named() -> None:
    with pytest.raises(ValueError, match="do not match"):
        top_up(_base(0), np.zeros((2, 7)), LAYOUT, theta=0.1, cap_tokens=8, first_row=0)


@pytest.fixture(scope="module")
def model_prefix() -> tuple[Any, list[int], list[Any], Any]:
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    ids = token_windows(lm.tokenizer, PREFIX + NEW, 1)[0][1]
    with torch.inference_mode():
        pairs, state = prefix_state(lm, ids[:PREFIX])
    return lm, ids[PREFIX:], pairs, state


@pytest.mark.model
def test_top_up_in_the_model(model_prefix: Any) -> None:
    lm, new, pairs, state = model_prefix
    choose = chooser("qa_lowbit2", state, FixedBudget(0.25), SHIPPED_CONFIG)
    plans = [
        MaskPlan(PREFIX, OBSERVE, choose),
        MaskPlan(PREFIX, OBSERVE, choose, extend=extender(state, 1.01, OBSERVE)),
        MaskPlan(PREFIX, OBSERVE, choose, extend=extender(state, 0.0, OBSERVE, cap=0.25)),
    ]
    with masking(lm.model), torch.inference_mode():
        logits = forward(lm, pairs, new, list(plans))
    plain, none, eager = plans
    assert (logits[1] - logits[0]).abs().max() < 1e-4  # nothing fetched: the first choice's logits
    assert none.delivered_tokens_fraction() == plain.delivered_tokens_fraction()
    for layer, rows in eager.row_kept.items():
        assert (rows[:OBSERVE] == plain.kept[layer]).all()  # prompt rows see only the first choice
        assert rows.any(axis=0).sum() - plain.kept[layer].sum() <= PREFIX // 4  # the cap
    assert eager.delivered_tokens_fraction() > plain.delivered_tokens_fraction()
    assert (logits[2, :OBSERVE] - logits[0, :OBSERVE]).abs().max() < 1e-4  # fetched chunks hidden from them
    assert (logits[2, OBSERVE:] - logits[0, OBSERVE:]).abs().max() > 1e-3  # and seen by later rows


@pytest.mark.model
def test_per_row_masks_equal_a_layer_wide_mask_when_rows_agree(model_prefix: Any) -> None:
    lm, new, pairs, _ = model_prefix
    keep = np.zeros(PREFIX, dtype=bool)
    keep[[*range(16), *range(48, 64), *range(80, 96)]] = True
    plans = [
        MaskPlan(PREFIX, 1, lambda layer, q: keep[None]),
        MaskPlan(
            PREFIX,
            1,
            lambda layer, q: keep[None],
            extend=lambda layer, q, base: np.repeat(base, q.shape[1], 0),
        ),
    ]
    with masking(lm.model), torch.inference_mode():
        logits = forward(lm, pairs, new, list(plans))
        full = forward(lm, pairs, new, [None])[0]
    assert (logits[0] - logits[1]).abs().max() < 1e-4
    assert (logits[0] - full).abs().max() > 1e-2  # the mask matters
