"""Layer-by-layer prefill with query-aware chunks (engine_adapter/layered.py) on the real SmolLM2 model."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.quality_bench import SHIPPED_CONFIG, forward, prefix_state
from bench.quality_masking import MaskPlan, masking
from bench.texts import token_windows
from engine_adapter.array_layers import ArrayLayers
from engine_adapter.commands import _print_layered
from engine_adapter.layered import chunk_positions, layered_prefill
from engine_adapter.layered_policy import MIN_LAYERED_FRACTION, chunks_for_fraction, static_auto_fraction
from importance.query_select import choose_layer_chunks
from importance.summaries import ChunkLayout
from kvstore.api import Tokens
from kvstore.budget import AutoBudget
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore
from kvstore.values import DEFAULT_NAMESPACE

pytestmark = [pytest.mark.model]
PREFIX = 256  # one store block
QUESTION = (
    "<|im_end|>\n<|im_start|>user\nWhat is the main subject of this text?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.model import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="module")
def doc(lm: Any) -> tuple[list[int], list[int], np.ndarray]:
    """A 256-token document, a question turn after it, and the document's KV (fp16)."""
    from engine_adapter.engine import Engine

    prefix = token_windows(lm.tokenizer, PREFIX, 1)[0][1][:PREFIX]
    kv16, _ = Engine(lm, None).analyze(prefix)
    return prefix, lm.tokenizer.encode(QUESTION), kv16


class LayeredTieredStore(TieredStore):
    """A real TieredStore whose `open_layers` serves its own stored KV layer by layer (ArrayLayers).

    `corrupt_layer` flips a byte of that layer's KV after the load is made: its checksum fails.
    """

    def __init__(self, config: StoreConfig) -> None:
        super().__init__(config)
        self.corrupt_layer: int | None = None
        self.opened: list[ArrayLayers] = []

    def open_layers(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> ArrayLayers:
        with self.load(tokens, model=model, namespace=namespace) as stream:
            positions, kv = stream.gather(model)
            kv = np.ascontiguousarray(kv[:, :, :, np.argsort(positions, kind="stable")])
        layers = ArrayLayers(kv)
        if self.corrupt_layer is not None and layers.matched_tokens:
            kv[self.corrupt_layer, 1, 0, 3, 0] += np.float16(1.0)
        self.opened.append(layers)
        return layers


@pytest.fixture()
def store(tmp_path: Path) -> Iterator[LayeredTieredStore]:
    s = LayeredTieredStore(StoreConfig(data_dir=tmp_path / "store", block_tokens=PREFIX, chunk_tokens=16))
    yield s
    s.close()


def greedy(engine: Any, logits: torch.Tensor, cache: Any, position: int, steps: int = 4) -> list[int]:
    out = [int(logits.argmax())]
    for _ in range(steps - 1):
        logits = engine.extend(out[-1:], position, cache)[-1]
        position += 1
        out.append(int(logits.argmax()))
    return out


def test_every_chunk_gives_the_full_prefix_answer(lm: Any, doc: Any) -> None:
    from engine_adapter.engine import Engine

    prefix, question, kv16 = doc
    engine = Engine(lm, None)
    with torch.inference_mode():
        out = layered_prefill(lm.model, ArrayLayers(kv16), question, PREFIX // 8)
        full = engine.prefill(prefix + question)
    rows = full.cache.layers[0].keys.shape[2] - PREFIX
    assert out.report.delivered_fraction == 1.0 and rows == len(question)
    assert torch.allclose(out.logits[0, -1], full.logits, atol=0.05, rtol=0)
    end = PREFIX + len(question)
    with torch.inference_mode():
        assert greedy(engine, out.logits[0, -1], out.cache, end) == greedy(
            engine, full.logits, full.cache, end
        )


def test_partial_load_equals_the_masking_simulation(lm: Any, doc: Any) -> None:
    prefix, question, kv16 = doc
    layers = ArrayLayers(kv16)
    chunks = chunks_for_fraction(0.3, layers)
    pairs, state = prefix_state(lm, prefix)
    summaries = state.summaries("lowbit2", SHIPPED_CONFIG)  # the benchmark's own summaries
    layout = ChunkLayout.natural(PREFIX, 8)

    def simulate(layer: int, queries: np.ndarray) -> np.ndarray:
        approx = np.swapaxes(summaries[layer].fields["keys_t"], 1, 2)
        chosen = choose_layer_chunks(queries, approx, chunks, scale=state.scale)
        return layout.token_mask(np.isin(np.arange(layout.num_chunks), chosen))[None]

    plan = MaskPlan(PREFIX, len(question), simulate)
    with torch.inference_mode():
        out = layered_prefill(lm.model, layers, question, chunks)
        with masking(lm.model):
            masked = forward(lm, pairs, question, [plan])[0]
            full = forward(lm, pairs, question, [None])[0]
    assert (out.logits[0] - masked).abs().max() < 1e-4
    assert (masked - full).abs().max() > 1e-2  # the selection matters: the check above can fail
    for layer, chosen in out.report.chosen.items():
        assert np.array_equal(
            layout.token_mask(np.isin(np.arange(layout.num_chunks), chosen)), plan.kept[layer][0]
        )
    assert len({tuple(c) for c in out.report.chosen.values()}) > 1  # layers choose differently


def test_each_layer_holds_its_chosen_chunks_at_true_positions(lm: Any, doc: Any) -> None:
    _, question, kv16 = doc
    layers = ArrayLayers(kv16)
    chunks = chunks_for_fraction(0.3, layers)
    with torch.inference_mode():
        out = layered_prefill(lm.model, layers, question, chunks)
    allowance = (0.3 - layers.summary_bytes / layers.prefix_bytes) * PREFIX
    assert chunks * 8 <= allowance < (chunks + 1) * 8
    assert layers.delivered_tokens == chunks * 8 * lm.spec.num_layers
    assert out.report.read_fraction <= 0.3 and out.report.delivered_fraction == chunks * 8 / PREFIX
    for layer, chosen in out.report.chosen.items():
        assert len(chosen) == chunks and {0, 1, 30, 31} <= set(chosen.tolist())  # first and last 16 tokens
        held = out.cache.layers[layer]
        expected = torch.from_numpy(kv16[layer][:, :, chunk_positions(chosen, 8)].astype(np.float32))
        assert torch.equal(held.keys[0, :, : chunks * 8], expected[0])  # post-RoPE keys: true positions
        assert torch.equal(held.values[0, :, : chunks * 8], expected[1])
        assert held.keys.shape[2] == chunks * 8 + len(question)


def _prime(engine: Any, prefix: list[int]) -> None:
    """First request: computes and stores the document's block."""
    engine.prefill([*prefix, lm_token(engine)])


def lm_token(engine: Any) -> int:
    return int(engine.lm.tokenizer.encode("\n")[0])


def test_a_checksum_error_mid_pass_recomputes_the_prompt(
    lm: Any, doc: Any, store: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine_adapter.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store)
    _prime(engine, prefix)
    store.corrupt_layer = 7
    with torch.inference_mode():
        state = engine.prefill(prefix + question, budget=0.3)
        reference = Engine(lm, None).prefill(prefix + question)
    report = engine.last_layered
    assert report is not None and "layer 7" in report.error
    _print_layered(report)
    assert "abandoned" in capsys.readouterr().err
    victim = store.opened[-1]
    assert victim.delivered_tokens == 7 * report.chunks_per_layer * 8 and victim.closed  # failed mid-pass
    assert state.matched_tokens == 0 and state.computed_tokens == PREFIX + len(question)
    assert torch.allclose(state.logits, reference.logits, atol=1e-5, rtol=0)
    end = PREFIX + len(question)
    with torch.inference_mode():
        assert greedy(engine, state.logits, state.cache, end) == greedy(
            engine, reference.logits, reference.cache, end
        )


def test_policy_layered_only_for_several_new_tokens_at_a_partial_budget(
    lm: Any, doc: Any, store: Any, capsys: pytest.CaptureFixture[str]
) -> None:
    from engine_adapter.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store)
    _prime(engine, prefix)
    engine.prefill(prefix + question, budget=0.3)  # a question: layer by layer
    report = engine.last_layered
    assert report is not None and not report.error and engine.last_load is None
    assert report.chunks_per_layer == chunks_for_fraction(0.3, store.opened[-1]) and store.opened[-1].closed
    assert 0 < report.summary_fraction < report.read_fraction <= 0.3
    _print_layered(report)  # what `kvsieve generate -v` prints
    printed = capsys.readouterr().err
    assert f"{report.chunks_per_layer} chunks of 8 tokens per layer" in printed
    assert (
        f"read {report.read_fraction:.1%}" in printed
        and f"summaries {report.summary_fraction:.1%}" in printed
    )
    opened = len(store.opened)
    engine.prefill([*prefix, lm_token(engine)], budget=0.3)  # one new token: static order
    assert engine.last_layered is None and engine.last_load is not None
    assert len(store.opened) == opened + 1 and store.opened[-1].bytes_read == 0 and store.opened[-1].closed
    engine.prefill(prefix + question, budget=1.0)  # everything: the normal load, nothing opened
    assert engine.last_layered is None and engine.last_load is not None
    assert engine.last_load.delivered_fraction == 1.0 and len(store.opened) == opened + 1
    engine.prefill(prefix + question, budget=0.1)  # too small for the summary: static order
    assert engine.last_layered is None and len(store.opened) == opened + 1


def test_auto_reads_what_the_static_plan_would_deliver(lm: Any, doc: Any, store: Any) -> None:
    from engine_adapter.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store)
    _prime(engine, prefix)
    fraction = static_auto_fraction(store, prefix + question, AutoBudget(), lm.spec, DEFAULT_NAMESPACE)
    assert fraction is not None and 0 < fraction <= 1.0
    engine.prefill(prefix + question, budget="auto")
    report = engine.last_layered
    if fraction < MIN_LAYERED_FRACTION:
        assert report is None and engine.last_load is not None
    else:
        assert report is not None and report.chunks_per_layer == chunks_for_fraction(
            fraction, store.opened[-1]
        )
        assert report.read_fraction <= fraction + 1e-9
