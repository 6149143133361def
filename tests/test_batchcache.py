"""The persistent batch cache on the real model: same greedy tokens as alone, no copy per step."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine_adapter.runner.batchcache import BatchCache
from engine_adapter.runner.sampling import Sampling

pytestmark = [pytest.mark.model]
PROMPTS = ["Name three colours of the rainbow.", "What is the capital of Italy? Answer in one sentence."]


@pytest.fixture(scope="module")
def engine():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    return Engine(load_model(quiet=True), None, collect_stats=False)


def _prefilled(engine: Any, prompt: str) -> tuple[Any, int, int]:
    """(cache, first greedy token, next position) of a prompt computed alone."""
    state = engine.prefill(engine.encode(prompt))
    return state.cache, int(state.logits.argmax()), state.next_position


def _alone(engine: Any, prompt: str, tokens: int) -> list[int]:
    return engine.generate(prompt, Sampling(max_tokens=tokens)).token_ids  # type: ignore[no-any-return]


def test_rows_decode_the_same_greedy_tokens_as_each_alone(engine) -> None:  # type: ignore[no-untyped-def]
    batch = BatchCache(engine.lm.model.config)
    rows = [_prefilled(engine, p) for p in PROMPTS]  # different lengths: one row is padded
    assert rows[0][2] != rows[1][2]
    batch.add([(i, cache) for i, (cache, _, _) in enumerate(rows)], reserve=16)
    tokens = [[first] for _, first, _ in rows]
    positions = [position for _, _, position in rows]
    for _ in range(9):
        logits = batch.step(engine.lm.model, [t[-1] for t in tokens], positions)
        positions = [p + 1 for p in positions]
        for row, token in enumerate(logits.argmax(dim=-1).tolist()):
            tokens[row].append(token)
    for prompt, got in zip(PROMPTS, tokens, strict=True):
        alone = _alone(engine, prompt, 10)  # ends early at an end-of-sequence token, not kept
        assert got[: len(alone)] == alone and len(alone) >= 3
        assert len(alone) == 10 or got[len(alone)] in engine.lm.eos_token_ids


def test_a_step_writes_in_place_and_copies_no_row(engine) -> None:  # type: ignore[no-untyped-def]
    batch = BatchCache(engine.lm.model.config)
    rows = [_prefilled(engine, p) for p in PROMPTS]
    batch.add([(i, cache) for i, (cache, _, _) in enumerate(rows)], reserve=8)
    pointers = [(k.data_ptr(), v.data_ptr()) for k, v in batch.buffers()]
    copied, rebuilds = batch.stats.rows_copied, batch.stats.rebuilds
    for step in range(8):
        batch.step(engine.lm.model, [rows[0][1], rows[1][1]], [rows[0][2] + step, rows[1][2] + step])
    assert [(k.data_ptr(), v.data_ptr()) for k, v in batch.buffers()] == pointers
    assert (batch.stats.rows_copied, batch.stats.rebuilds) == (copied, rebuilds) == (2, 1)
    assert batch.length(0) == rows[0][2] + 8 and batch.length(1) == rows[1][2] + 8
    batch.step(engine.lm.model, [rows[0][1], rows[1][1]], [rows[0][2] + 8, rows[1][2] + 8])
    assert batch.stats.rebuilds == 2  # the reserve was spent: grown once, for many steps


def test_take_and_drop_remove_rows(engine) -> None:  # type: ignore[no-untyped-def]
    batch = BatchCache(engine.lm.model.config)
    rows = [_prefilled(engine, p) for p in [*PROMPTS, PROMPTS[0]]]
    batch.add([(i, cache) for i, (cache, _, _) in enumerate(rows)], reserve=4)
    batch.step(engine.lm.model, [r[1] for r in rows], [r[2] for r in rows])
    assert len(batch) == 3
    taken = batch.take(1)
    assert len(batch) == 2 and batch.keys == [0, 2]
    assert taken.get_seq_length() == rows[1][2] + 1
    batch.drop(0)
    assert len(batch) == 1 and batch.keys == [2]
    with pytest.raises(KeyError, match="no row 0"):
        batch.drop(0)
    with pytest.raises(ValueError, match="2 tokens for 1 rows"):
        batch.step(engine.lm.model, [1, 2], [3, 4])
    batch.drop(2)
    assert len(batch) == 0 and batch.buffers() == []


def test_a_taken_row_continues_as_it_would_have_alone(engine) -> None:  # type: ignore[no-untyped-def]
    batch = BatchCache(engine.lm.model.config)
    rows = [_prefilled(engine, p) for p in PROMPTS]
    batch.add([(i, cache) for i, (cache, _, _) in enumerate(rows)], reserve=4)
    logits = batch.step(engine.lm.model, [r[1] for r in rows], [r[2] for r in rows])
    second = int(logits[1].argmax())
    cache = batch.take(1)  # leaves the batch: its KV continues on its own
    with torch.inference_mode():
        third = int(engine.extend([second], rows[1][2] + 1, cache)[-1].argmax())
    assert [rows[1][1], second, third] == _alone(engine, PROMPTS[1], 3)
