"""The engine's layer-by-layer path over the embedded store's own layered layout (kvstore/load/).

Skipped where the store has no `open_layers` yet (branches before the layered layout).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from engine_adapter.runner.array_layers import ArrayLayers
from engine_adapter.runner.layered import layered_prefill
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

pytestmark = [
    pytest.mark.model,
    pytest.mark.skipif(not hasattr(TieredStore, "open_layers"), reason="the store has no layered layout"),
]
QUESTION = (
    "<|im_end|>\n<|im_start|>user\nWhat is the main subject of this text?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[Any]:
    config = StoreConfig(data_dir=tmp_path / "s", block_tokens=256, chunk_tokens=16, layout="layered")
    s = TieredStore(config)
    yield s
    s.close()


def test_the_store_path_equals_the_in_process_path(lm: Any, store: Any) -> None:
    from engine_adapter.runner.engine import Engine

    doc = token_windows(lm.tokenizer, 512, 1)[0][1][:512]
    question = lm.tokenizer.encode(QUESTION)
    engine = Engine(lm, store)
    with torch.inference_mode():
        engine.prefill([*doc, question[0]])  # stores the document's two blocks
        state = engine.prefill(doc + question, budget=0.3)
        report = engine.last_layered
        assert report is not None and not report.error and state.matched_tokens == 512
        with store.load(doc, model=lm.spec) as stream:  # the same KV, served in process
            positions, kv = stream.gather(lm.spec)
            kv = np.ascontiguousarray(kv[:, :, :, np.argsort(positions, kind="stable")])
        expected = layered_prefill(lm.model, ArrayLayers(kv), question, report.chunks_per_layer)
    assert report.delivered_fraction == report.chunks_per_layer * 8 / 512 and report.read_fraction <= 0.3
    assert all(np.array_equal(report.chosen[i], expected.report.chosen[i]) for i in range(lm.spec.num_layers))
    assert (state.logits - expected.logits[0, -1]).abs().max() < 1e-4
