"""Layer-by-layer prefill with query-aware chunks (engine_adapter/runner/layered.py), real SmolLM2."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from bench.quality.masking import MaskPlan, masking
from bench.quality.quality_bench import SHIPPED_CONFIG, forward, prefix_state
from engine_adapter.reports import print_layered
from engine_adapter.runner.array_layers import ArrayLayers
from engine_adapter.runner.layered import CHOOSE_WITH_LAST, chunk_positions, layer_queries, layered_prefill
from engine_adapter.runner.layered_policy import (
    MIN_LAYERED_FRACTION,
    chunks_for_fraction,
    static_auto_fraction,
)
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
# The engines here run without the decode-time top-up: these tests are about the prefill's own
# choice (with the top-up on, it keeps part of the budget back: tests/test_engine_topup.py).
TAIL = 200  # the document's uncached tokens after its last whole block
QUESTION = (
    "<|im_end|>\n<|im_start|>user\nWhat is the main subject of this text?<|im_end|>\n<|im_start|>assistant\n"
)


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="module")
def doc(lm: Any) -> tuple[list[int], list[int], np.ndarray]:
    """A 256-token document, a question turn after it, and the document's KV (fp16)."""
    from engine_adapter.runner.engine import Engine

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
    from engine_adapter.runner.engine import Engine

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
        last = queries[:, -CHOOSE_WITH_LAST:]  # the engine's default: the question's last tokens choose
        chosen = choose_layer_chunks(last, approx, chunks, scale=state.scale)
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
    from engine_adapter.runner.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store, topup=None)
    _prime(engine, prefix)
    store.corrupt_layer = 7
    with torch.inference_mode():
        state = engine.prefill(prefix + question, budget=0.3)
        reference = Engine(lm, None).prefill(prefix + question)
    report = engine.last_layered
    assert report is not None and "layer 7" in report.error
    print_layered(report)
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
    from engine_adapter.runner.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store, topup=None)
    _prime(engine, prefix)
    engine.prefill(prefix + question, budget=0.3)  # a question: layer by layer
    report = engine.last_layered
    assert report is not None and not report.error and engine.last_load is None
    assert report.chunks_per_layer == chunks_for_fraction(0.3, store.opened[-1]) and store.opened[-1].closed
    assert 0 < report.summary_fraction < report.read_fraction <= 0.3
    print_layered(report)  # what `kvsieve generate -v` prints
    printed = capsys.readouterr().err
    assert f"{report.chunks_per_layer} chunks of 8 tokens per layer" in printed
    assert f"the last 16 of {len(question)} new tokens" in printed  # the default, CHOOSE_WITH_LAST
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
    from engine_adapter.runner.engine import Engine

    prefix, question, _ = doc
    engine = Engine(lm, store, topup=None)
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


@pytest.fixture(scope="module")
def long_doc(lm: Any) -> list[int]:
    """A document of one cached block (256 tokens) and an uncached tail of 200 tokens."""
    return token_windows(lm.tokenizer, PREFIX + TAIL, 1)[0][1][: PREFIX + TAIL]


@contextmanager
def layer_inputs(lm: Any) -> Iterator[dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]]]:
    """Each attention module's input (module, hidden states, cos, sin), recorded by a forward
    pre-hook registered before the engine's own (so it runs first and sees the same input)."""
    seen: dict[int, tuple[Any, torch.Tensor, torch.Tensor, torch.Tensor]] = {}

    def hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        cos, sin = kwargs["position_embeddings"]
        seen[int(module.layer_idx)] = (module, kwargs["hidden_states"].clone(), cos.clone(), sin.clone())

    handles = [
        layer.self_attn.register_forward_pre_hook(hook, with_kwargs=True) for layer in lm.model.model.layers
    ]
    try:
        yield seen
    finally:
        for handle in handles:
            handle.remove()


def _layered_choice(engine: Any, prompt: list[int]) -> dict[int, np.ndarray]:
    with torch.inference_mode():
        engine.prefill(prompt, budget=0.3)
    report = engine.last_layered
    assert report is not None and not report.error and report.matched_tokens == PREFIX
    return dict(report.chosen)


@pytest.mark.parametrize("last", [16, None])
def test_the_engine_chooses_with_the_last_new_tokens_queries(
    lm: Any, doc: Any, long_doc: list[int], store: Any, last: int | None
) -> None:
    from engine_adapter.runner.engine import Engine

    question = doc[1]
    engine = Engine(lm, store, topup=None, choose_with_last=last)
    _prime(engine, long_doc[:PREFIX])
    new = TAIL + len(question)
    with layer_inputs(lm) as seen, torch.inference_mode():
        state = engine.prefill(long_doc + question, budget=0.3)
    report = engine.last_layered
    assert report is not None and not report.error and report.matched_tokens == PREFIX
    assert (report.new_tokens, report.query_tokens) == (new, new if last is None else last)
    assert state.computed_tokens == new
    served = ArrayLayers(store.opened[-1].kv)  # the same KV, its summaries read afresh
    rows = slice(-report.query_tokens, None)
    for layer in range(lm.spec.num_layers):
        module, hidden, cos, sin = seen[layer]
        assert hidden.shape[1] == new  # every new token goes through every layer, as before
        with torch.inference_mode():
            queries = layer_queries(module, hidden[:, rows], cos[:, rows], sin[:, rows])[0].float().numpy()
        expected = choose_layer_chunks(
            queries, served.key_summary(layer), report.chunks_per_layer, scale=float(module.scaling)
        )
        assert np.array_equal(report.chosen[layer], expected)
        assert state.cache.layers[layer].keys.shape[2] == report.chunks_per_layer * 8 + new


@pytest.mark.real_weights  # what the question's queries choose, against the tail's, is the real attention's
def test_choosing_with_the_question_not_the_documents_tail(
    lm: Any, doc: Any, long_doc: list[int], store: Any
) -> None:
    """With a 200-token uncached tail, the last tokens choose differently from all of them,
    and the question's own tokens choose closer to what the question alone would.

    Not equal to the question alone: with the tail the question sits 200 positions later
    (RoPE turns each query by its distance to every key) and its hidden states have
    attended to the tail too. So the test asserts what holds: closer, per layer on average.
    """
    from engine_adapter.runner.engine import Engine

    question = doc[1]
    _prime(Engine(lm, store, topup=None), long_doc[:PREFIX])
    prompt = long_doc + question
    every = _layered_choice(Engine(lm, store, topup=None, choose_with_last=None), prompt)
    beyond = _layered_choice(Engine(lm, store, topup=None, choose_with_last=10_000), prompt)  # > new tokens
    assert beyond.keys() == every.keys() and all(np.array_equal(c, every[i]) for i, c in beyond.items())
    last16 = _layered_choice(Engine(lm, store, topup=None, choose_with_last=16), prompt)
    differing = sum(not np.array_equal(last16[i], every[i]) for i in every)
    asked = _layered_choice(Engine(lm, store, topup=None, choose_with_last=len(question)), prompt)
    alone_engine = Engine(lm, store, topup=None, choose_with_last=None)
    alone = _layered_choice(alone_engine, long_doc[:PREFIX] + question)

    def overlap(a: dict[int, np.ndarray], b: dict[int, np.ndarray]) -> float:
        """Mean over layers: the share of a's chosen chunks that b chose too, the forced
        first and last two chunks (always both) left out."""
        free = [np.setdiff1d(a[i], [0, 1, 30, 31]) for i in a]
        return float(np.mean([len(np.intersect1d(f, b[i])) / len(f) for i, f in zip(a, free, strict=True)]))

    print(
        f"layers differing (last 16 vs all): {differing}/{len(every)}; overlap with the question alone: "
        f"last {len(question)} {overlap(asked, alone):.3f}, last 16 {overlap(last16, alone):.3f}, "
        f"all {overlap(every, alone):.3f}"
    )
    assert differing >= len(every) // 2
    assert overlap(asked, alone) > overlap(every, alone) + 0.05
    assert overlap(last16, alone) > overlap(every, alone) + 0.05


def test_choose_with_last_below_one_is_refused(lm: Any) -> None:
    from engine_adapter.runner.engine import Engine
    from kvstore.errors import InvalidInputError

    with pytest.raises(InvalidInputError, match="choose_with_last must be >= 1"):
        Engine(lm, None, choose_with_last=0)
    with pytest.raises(InvalidInputError, match="choose_with_last must be >= 1"):
        layered_prefill(lm.model, ArrayLayers(np.zeros((30, 2, 3, PREFIX, 64), np.float16)), [1, 2], 4, 0)


def test_the_generate_flag_sets_the_engines_choice() -> None:
    import argparse

    from engine_adapter.commands import _generate_flags

    parser = argparse.ArgumentParser()
    _generate_flags(parser)
    assert parser.parse_args(["q"]).choose_with_last == CHOOSE_WITH_LAST  # the Engine's default
    assert parser.parse_args(["q", "--choose-with-last", "all"]).choose_with_last is None
    assert parser.parse_args(["q", "--choose-with-last", "8"]).choose_with_last == 8
    with pytest.raises(SystemExit):
        parser.parse_args(["q", "--choose-with-last", "0"])
