"""The decode-time top-up (engine_adapter/runner/topup.py) on the real model over a real LMDB store.

One 512-token document (two layered blocks, 8-token chunks) and one question; the
prefill reads 30 % of the prefix layer by layer, then each decode step tops up.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch

from bench.common.texts import token_windows
from engine_adapter.runner.cache import cache_from, share_cache
from engine_adapter.runner.layered import LayeredPrefill, chunk_positions, layered_prefill
from engine_adapter.runner.layered_policy import chunks_for_fraction
from engine_adapter.runner.sampling import Sampling
from engine_adapter.runner.topup import (
    CAP,
    RESERVE_MAX_FRACTION,
    RESERVE_TOKENS,
    THETA,
    DecodeTopUp,
    TopUpSettings,
    decoding,
)
from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError
from kvstore.format.layer_pack import table_bytes
from kvstore.format.layer_record import header_bytes
from kvstore.store.tiered import TieredStore
from tests.conftest import RANDOM_WEIGHTS, corrupt_chunk

pytestmark = pytest.mark.model
PREFIX, BUDGET, STEPS = 512, 0.3, 8
QUESTION = (
    "<|im_end|>\n<|im_start|>user\nWhat is the main subject of this text?<|im_end|>\n<|im_start|>assistant\n"
)


def _config(root: Path) -> StoreConfig:
    return StoreConfig(data_dir=root, block_tokens=256, layout="layered", codec="raw")


@pytest.fixture(scope="module")
def lm() -> Any:
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture(scope="module")
def prompt(lm: Any) -> tuple[list[int], list[int]]:
    """(the document, exactly two blocks; the question after it)."""
    return token_windows(lm.tokenizer, PREFIX, 1)[0][1][:PREFIX], lm.tokenizer.encode(QUESTION)


def _stored(lm: Any, root: Path, doc: list[int], question: list[int]) -> TieredStore:
    from engine_adapter.runner.engine import Engine

    store = TieredStore(_config(root))
    with torch.inference_mode():
        Engine(lm, store).prefill([*doc, question[0]])  # stores the document's two blocks
    return store


@pytest.fixture(scope="module")
def store(lm: Any, prompt: tuple[list[int], list[int]], tmp_path_factory: Any) -> Iterator[TieredStore]:
    s = _stored(lm, tmp_path_factory.mktemp("topup") / "s", *prompt)
    yield s
    s.close()


class Decoded(NamedTuple):
    topup: DecodeTopUp
    prefill: LayeredPrefill
    tokens: list[int]
    logits: list[torch.Tensor]  # of each decode step (the first from the prefill)


@torch.inference_mode()
def _decode(lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]], settings: TopUpSettings,
            steps: int = STEPS) -> Decoded:  # fmt: skip
    """Greedy decode over a layered prefill with a top-up, as `Engine.generate` does it."""
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    load = store.open_layers(doc, model=lm.spec)
    out = layered_prefill(lm.model, load, question, chunks_for_fraction(BUDGET, load), keep_summaries=True)
    topup = DecodeTopUp(load, out, settings)
    engine, logits, tokens = Engine(lm, None), [out.logits[0, -1]], []
    with decoding(lm.model, topup):  # closes the load
        for step in range(steps):
            tokens.append(int(logits[-1].argmax()))
            logits.append(engine.extend(tokens[-1:], len(doc) + len(question) + step, out.cache)[-1])
    return Decoded(topup, out, tokens, logits)


def _full_kv(lm: Any, store: TieredStore, doc: list[int]) -> np.ndarray:
    """The stored prefix as a full load gives it: fp16 (layers, 2, kv heads, tokens, dim), position order."""
    with store.load(doc, model=lm.spec) as stream:
        positions, kv = stream.gather(lm.spec)
        return np.ascontiguousarray(kv[:, :, :, np.argsort(positions, kind="stable")])


@pytest.mark.real_weights  # the real model's attention picks chunks over theta; random weights' does not
def test_topup_fetches_chunks_over_theta_within_the_cap_bit_exact_at_their_positions(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]]
) -> None:
    run = _decode(lm, store, prompt, TopUpSettings())
    topup, report, chunk = run.topup, run.prefill.report, 8
    assert report.topup_chunks > 0 and not report.topup_error  # this question's answer does top up
    full = _full_kv(lm, store, prompt[0])
    cap_tokens = int(CAP * PREFIX)
    seen_tokens = 0
    for layer, fetches in topup.inserted.items():
        assert topup.fetched_tokens[layer] <= cap_tokens
        assert sum(len(chunks) for _, chunks in fetches) * chunk == topup.fetched_tokens[layer]
        fetched = [c for _, chunks in fetches for c in chunks]
        assert not set(fetched) & set(report.chosen[layer].tolist())  # only missing chunks
        assert len(set(fetched)) == len(fetched)
        cache = run.prefill.cache.layers[layer]
        for slot, chunks in fetches:
            positions = chunk_positions(np.asarray(chunks), chunk)
            width = len(positions)
            for side, tensor in enumerate((cache.keys, cache.values)):
                got = tensor[0, :, slot : slot + width].numpy()
                assert np.array_equal(got, full[layer, side][:, positions].astype(np.float32))
            seen_tokens += width
    assert seen_tokens == report.topup_chunks * chunk
    assert report.read_fraction > BUDGET - 0.05 and report.topup_fraction > 0


def test_the_rule_takes_missing_chunks_over_theta_largest_first_until_the_cap(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]]
) -> None:
    run = _decode(lm, store, prompt, TopUpSettings(theta=0.02, cap=0.05), steps=0)
    topup, layer = run.topup, 3
    chosen = run.prefill.report.chosen[layer]
    missing = [c for c in range(PREFIX // 8) if c not in set(chosen.tolist())]
    shares = np.zeros(PREFIX // 8)
    shares[chosen[0]] = 0.5  # already held: never fetched
    for chunk, share in zip(missing, (0.01, 0.3, 0.025, 0.2, 0.15, 0.021), strict=False):
        shares[chunk] = share
    room = int(0.05 * PREFIX) // 8  # 3 chunks
    assert room == 3
    assert topup.pick(layer, shares) == sorted([missing[1], missing[3], missing[4]])
    topup.fetched_tokens[layer] = 2 * 8  # one chunk of room left: the largest
    assert topup.pick(layer, shares) == [missing[1]]
    topup.fetched_tokens[layer] = 3 * 8
    assert topup.pick(layer, shares) == []


def test_theta_zero_without_a_cap_makes_the_step_see_the_whole_prefix(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]]
) -> None:
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    run = _decode(lm, store, prompt, TopUpSettings(theta=0.0, cap=1.0), steps=1)
    assert all(have.all() for have in run.topup.have.values())  # every chunk, every layer, at step 1
    assert run.prefill.report.topup_steps == 1
    # The same step over the full prefix and the question's KV as the prefill computed it:
    # equal up to float noise (the keys sit in another order), so the fetched KV was seen
    # by the very token that asked for it.
    full, kept = _full_kv(lm, store, doc), run.prefill.report.chunks_per_layer * 8
    pairs = []
    for layer, cache in enumerate(run.prefill.cache.layers):
        new = slice(kept, kept + len(question))
        pairs.append(tuple(
            torch.cat([torch.from_numpy(full[layer, side].astype(np.float32))[None], t[:, :, new]], dim=2)
            for side, t in enumerate((cache.keys, cache.values))
        ))  # fmt: skip
    with torch.inference_mode():
        reference = Engine(lm, None).extend(
            run.tokens, PREFIX + len(question), cache_from(lm.model.config, pairs)
        )
    assert (reference[-1] - run.logits[1]).abs().max() < 1e-3
    # Through the engine, the answer equals the full prefix's (the question's KV, computed over
    # 30 % of the prefix, is the one difference left).
    sampling = Sampling(max_tokens=STEPS, temperature=0.0)
    with torch.inference_mode():
        unbounded = TopUpSettings(theta=0.0, cap=1.0, reserve_tokens=0, within_budget=False)
        engine = Engine(lm, store, topup=unbounded)
        topped = engine.generate(doc + question, sampling, budget=BUDGET)
        full_answer = Engine(lm, store).generate(doc + question, sampling, budget=1.0)
    assert engine.last_layered is not None and engine.last_layered.delivered_fraction == 1.0
    assert topped.token_ids == full_answer.token_ids


def test_turned_off_it_is_todays_layered_path_exactly(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]]
) -> None:
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    sampling = Sampling(max_tokens=STEPS, temperature=0.0, no_repeat_ngram=0)
    with torch.inference_mode():
        off = Engine(lm, store, topup=None)
        answer = off.generate(doc + question, sampling, budget=BUDGET)
        logits = off.continuation_logits(doc + question, answer.token_ids, budget=BUDGET)
        # the layered path as it was before the top-up: the prefill, then plain forwards
        plain = Engine(lm, None)
        start = PREFIX + len(question)
        with store.open_layers(doc, model=lm.spec) as load:
            out = layered_prefill(lm.model, load, question, chunks_for_fraction(BUDGET, load))
        teacher = plain.extend(answer.token_ids[:-1], start, share_cache(out.cache, lm.model.config))
        expected = torch.cat([out.logits[0, -1:], teacher])
        greedy, step = [int(out.logits[0, -1].argmax())], out.logits[0, -1]
        while len(greedy) < len(answer.token_ids):
            step = plain.extend(greedy[-1:], start + len(greedy) - 1, out.cache)[-1]
            greedy.append(int(step.argmax()))
        on = Engine(lm, store)
        on.generate(doc + question, sampling, budget=BUDGET)
    report = off.last_layered
    assert report is not None and report.topup_chunks == report.topup_bytes == 0
    assert torch.equal(logits, expected)
    assert answer.token_ids == greedy
    topped = on.last_layered
    assert topped is not None
    if not RANDOM_WEIGHTS:  # random weights attend evenly: no chunk passes theta, nothing is topped up
        assert topped.topup_chunks > 0  # on by default
    assert on.topup == TopUpSettings(THETA, CAP, RESERVE_TOKENS)
    # the prefill keeps RESERVE_TOKENS per layer of the budget back for the top-up, which stops at it
    kept = min(RESERVE_TOKENS, RESERVE_MAX_FRACTION * PREFIX) / 8  # chunks' worth
    assert report.chunks_per_layer - kept - 1 < topped.chunks_per_layer <= report.chunks_per_layer - kept + 1
    assert topped.chunks_per_layer < report.chunks_per_layer
    assert topped.read_fraction - topped.topup_fraction < report.read_fraction
    assert report.read_fraction <= BUDGET and topped.read_fraction <= BUDGET


def test_a_store_error_during_a_top_up_stops_it_and_the_answer_goes_on(
    lm: Any, prompt: tuple[list[int], list[int]], tmp_path: Path
) -> None:
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    layer = 2
    store = _stored(lm, tmp_path / "s", doc, question)
    try:
        first = _decode(lm, store, prompt, TopUpSettings(), steps=0).prefill.report.chosen[layer]
        second_block = [n.payload for n in store.index.match(store._root(lm.spec, "default"), doc).nodes][1]
    finally:
        store.close()
    per_block = 256 // 8
    victim = next(c for c in range(per_block, 2 * per_block) if c not in set(first.tolist()))
    chunk_bytes = 2 * lm.spec.num_kv_heads * 8 * lm.spec.head_dim * 2  # raw fp16
    offset = header_bytes(per_block) + (victim - per_block) * chunk_bytes + chunk_bytes // 2
    index = second_block.record_index(layer, 0)
    if second_block.is_packed:  # the layer's record inside the block's pack (raw: all one size)
        record = header_bytes(per_block) + per_block * chunk_bytes
        index, offset = second_block.pack_index, table_bytes(lm.spec.num_layers) + layer * record + offset
    corrupt_chunk(_config(tmp_path / "s"), second_block.key, index, offset)
    sampling = Sampling(max_tokens=STEPS, temperature=0.0)
    with TieredStore(_config(tmp_path / "s")) as reopened, torch.inference_mode():
        every_chunk = TopUpSettings(theta=0.0, cap=1.0, reserve_tokens=0, within_budget=False)
        engine = Engine(lm, reopened, topup=every_chunk)  # asks for every chunk
        answer = engine.generate(doc + question, sampling, budget=BUDGET)
    report = engine.last_layered
    assert report is not None and not report.error  # the prefill never read the victim
    assert report.topup_error.startswith(f"layer {layer}:") and "checksum" in report.topup_error.lower()
    assert report.topup_steps == 1 and report.topup_chunks > 0  # layers before it topped up, then none
    assert len(answer.token_ids) == STEPS or answer.finish_reason == "stop"


def test_the_top_up_stops_at_the_budget(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]]
) -> None:
    """Asked for every chunk (theta 0, no cap), the top-up still ends the load within its budget."""
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    engine = Engine(lm, store, topup=TopUpSettings(theta=0.0, cap=1.0))
    with torch.inference_mode():
        engine.generate(doc + question, Sampling(max_tokens=STEPS, temperature=0.0), budget=BUDGET)
    report = engine.last_layered
    assert report is not None and report.topup_chunks > 0
    assert BUDGET - 0.02 < report.read_fraction <= BUDGET  # it spent the reserve, and no more


def test_bad_settings_are_refused_by_name() -> None:
    with pytest.raises(InvalidInputError, match="theta"):
        TopUpSettings(theta=1.0)
    with pytest.raises(InvalidInputError, match="cap"):
        TopUpSettings(cap=-0.1)
    with pytest.raises(InvalidInputError, match="reserve_tokens -1"):
        TopUpSettings(reserve_tokens=-1)


@pytest.mark.real_weights  # a report of a top-up needs one: see above
def test_generate_verbose_reports_the_top_up(
    lm: Any, store: TieredStore, prompt: tuple[list[int], list[int]], capsys: Any
) -> None:
    from engine_adapter.reports import print_layered
    from engine_adapter.runner.engine import Engine

    doc, question = prompt
    engine = Engine(lm, store)
    with torch.inference_mode():
        engine.generate(doc + question, Sampling(max_tokens=STEPS, temperature=0.0), budget=BUDGET)
    report = engine.last_layered
    assert report is not None and report.topup_chunks > 0
    print_layered(report)
    err = capsys.readouterr().err
    assert f"top-up while decoding: {report.topup_chunks} chunks, {report.topup_bytes} bytes" in err
    assert f"top-up {report.topup_fraction:.1%})" in err
