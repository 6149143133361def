"""Layer l+1's chunks guessed from layer l's input while it computes (engine_adapter/runner/layered.py
`NextLayerGuess`), with SmolLM2 over a real store.

What is checked: a load that reads from disk guesses every layer after the first and counts how much
of each choice the guess named; the guess only hints the disk, so the cold answer and every layer's
choice equal the warm one's (memory, no guess); a load memory serves guesses nothing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from engine_adapter.runner.layered import layered_prefill
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

pytestmark = pytest.mark.model
QUESTION = (
    "<|im_end|>\n<|im_start|>user\nWhat is the main subject of this text?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


def _prefill(lm: Any, store: TieredStore, doc: list[int], question: list[int], chunks: int) -> Any:
    with torch.inference_mode(), store.open_layers(doc, model=lm.spec) as load:
        return layered_prefill(lm.model, load, question, chunks, speculate=True)  # a GPU's default


def test_the_cpu_guesses_nothing_unless_asked(lm: Any, tmp_path: Path) -> None:
    config = StoreConfig(data_dir=tmp_path / "s", block_tokens=256, layout="layered")
    doc = token_windows(lm.tokenizer, 512, 1)[0][1][:512]
    question = lm.tokenizer.encode(QUESTION)
    with TieredStore(config) as store:
        store.store(doc, np.zeros(lm.spec.kv_shape(512), lm.spec.np_dtype), model=lm.spec)
    with TieredStore(config) as store, torch.inference_mode(), store.open_layers(doc, model=lm.spec) as load:
        assert load.reads_from_disk
        out = layered_prefill(lm.model, load, question, 512 // 8 // 4)  # default: a guess costs a core
    assert out.report.speculated_chunks == 0


def test_a_cold_load_guesses_ahead_and_answers_as_the_warm_one(lm: Any, tmp_path: Path) -> None:
    from engine_adapter.runner.engine import Engine

    config = StoreConfig(data_dir=tmp_path / "s", block_tokens=256, layout="layered")
    doc = token_windows(lm.tokenizer, 1024, 1)[0][1][:1024]
    question = lm.tokenizer.encode(QUESTION)
    chunks = 1024 // 8 // 4  # a quarter
    with TieredStore(config) as store:
        with torch.inference_mode():
            Engine(lm, store).prefill([*doc, question[0]])  # stores the document's four blocks
        store.flush()
        warm = _prefill(lm, store, doc, question, chunks)
    assert warm.report.speculated_chunks == 0  # memory served it: nothing to read ahead
    with TieredStore(config) as store:  # restarted: every block read from disk
        cold = _prefill(lm, store, doc, question, chunks)
        assert store.stats().counters.get("gathered_chunks.lmdb", 0) > 0
    report = cold.report
    layers = lm.spec.num_layers
    # every layer after the first was guessed: its chosen chunks all counted
    assert report.speculated_chunks == (layers - 1) * report.chunks_per_layer
    assert 0 <= report.speculation_hits <= report.speculated_chunks
    assert 0.0 <= report.speculation_hit_rate <= 1.0
    for layer in range(layers):  # a guess never changes a choice
        np.testing.assert_array_equal(report.chosen[layer], warm.report.chosen[layer])
    assert torch.equal(cold.logits, warm.logits)
