"""The engine on the real SmolLM2-135M-Instruct: reused KV gives the same answers."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch

from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

pytestmark = [pytest.mark.model, pytest.mark.slow]

LICENSE = Path("/usr/share/common-licenses/Apache-2.0")
PROMPTS = [
    "Summarise the text above in one sentence.",
    "Who may use the work described above?",
    "List two obligations the text imposes.",
    "Is there a warranty? Answer briefly.",
    "What is the text above about?",
]


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


def _context() -> str:
    text = LICENSE.read_text() if LICENSE.exists() else "Licensed under the Apache License. " * 60
    return text[:1500]


def _messages(question: str) -> list[dict[str, str]]:
    return [
        {"role": "system", "content": "Answer briefly."},
        {"role": "user", "content": _context() + "\n\n" + question},
    ]


@pytest.fixture
def store(tmp_path: Path) -> Iterator[TieredStore]:
    with TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8)) as s:
        yield s


def test_logits_after_loading_match_recomputation(lm, store: TieredStore) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine

    ids = Engine(lm).encode(_messages(PROMPTS[0]))
    recomputed = Engine(lm, None).prefill(ids).logits
    cached = Engine(lm, store)
    first = cached.prefill(ids)
    assert first.matched_tokens == 0 and first.stored_blocks == len(ids) // 32
    second = cached.prefill(ids)
    assert (
        second.matched_tokens == (len(ids) - 1) // 32 * 32 and second.loaded_tokens == second.matched_tokens
    )
    assert second.computed_tokens == len(ids) - second.matched_tokens
    # KV is stored in fp16: rounding of K and V moves logits by a few thousandths.
    assert torch.allclose(second.logits, recomputed, atol=0.05, rtol=0)
    assert int(second.logits.argmax()) == int(recomputed.argmax())


@pytest.mark.parametrize("via", ["embedded", "grpc"])
def test_greedy_answers_identical_for_five_prompts(lm, tmp_path: Path, via: str) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling

    sampling = Sampling(max_tokens=64)
    server = None
    if via == "embedded":
        backend = TieredStore(StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8))
    else:
        server = Sidecar(tmp_path / "data").start()
        backend = KVClient(server.address)
    try:
        engine = Engine(lm, backend)
        engine.generate(_messages("Warm up."), Sampling(max_tokens=1))  # caches the shared context
        for question in PROMPTS:
            expected = Engine(lm, None).generate(_messages(question), sampling)
            reused = engine.generate(_messages(question), sampling)
            assert reused.matched_tokens >= 256  # the license text came from the store
            assert reused.token_ids == expected.token_ids, question
    finally:
        backend.close()
        if server is not None:
            server.kill()


def test_partial_budget_keeps_true_positions_and_stores_nothing(lm, store: TieredStore) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling

    engine = Engine(lm, store)
    ids = engine.encode(_messages(PROMPTS[1]))
    engine.prefill(ids)
    blocks_before = store.stats().get("blocks_written")
    result = engine.generate(ids, Sampling(max_tokens=8), budget=0.25)
    # The default (layered) layout goes query-aware: a quarter of the bytes, its key summaries
    # counted (9 % of the KV with 32-token blocks), so each layer gets a little under a quarter.
    assert 0.1 * result.matched_tokens <= result.loaded_tokens <= 0.25 * result.matched_tokens
    assert result.stored_blocks == 0 and store.stats().get("blocks_written") == blocks_before
    assert result.text


def test_statistics_path_keeps_the_causal_mask(lm) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.attention import AttentionStats

    ids = torch.tensor([lm.tokenizer.encode("The quick brown fox jumps over the lazy dog again and again")])
    with torch.inference_mode():
        fast = lm.model(input_ids=ids).logits
        stats = AttentionStats(0, lm.spec.num_layers)
        explicit = lm.model(input_ids=ids, kvsieve_stats=stats).logits
    assert torch.allclose(fast, explicit, atol=1e-3)  # without the causal mask the two differ widely
    prefill = stats.prefill
    assert prefill.shape == (ids.shape[1],) and np.all(prefill >= 0) and np.all(np.isfinite(prefill))


@pytest.mark.real_weights  # random weights attend evenly: natural order can be the importance order
def test_history_scores_are_reported_and_blocks_stored_in_importance_order(lm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine

    config = StoreConfig(data_dir=tmp_path / "data", block_tokens=32, chunk_tokens=8, layout="importance")
    with TieredStore(config) as store:
        engine = Engine(lm, store)
        ids = engine.encode(_messages(PROMPTS[2]))
        engine.prefill(ids)
        engine.prefill(ids)
        assert store.stats().get("score_reports") == 1
        metas = [n.payload for n in store.tree.nodes()]
    assert metas and all(m.scores is not None for m in metas)
    for meta in metas:  # online layout: stored slots follow the prefill scores at store time
        assert not np.array_equal(meta.permutation, np.arange(len(meta.permutation)))


def test_batched_decoding_matches_one_at_a_time(lm) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling

    engine = Engine(lm, None, collect_stats=False)
    prompts = ["What is the capital of France?", "Write a haiku about the sea and the moon, please.", "2+2="]
    sampling = Sampling(max_tokens=16)
    single = [engine.generate(p, sampling).token_ids for p in prompts]
    assert [r.token_ids for r in engine.generate_batch(prompts, sampling)] == single


def test_sampling_seed_stop_and_max_tokens(lm) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.sampling import Sampling

    engine = Engine(lm, None, collect_stats=False)
    hot = Sampling(max_tokens=12, temperature=1.0, top_p=0.9, seed=7)
    assert (
        engine.generate("Tell me a story.", hot).token_ids
        == engine.generate("Tell me a story.", hot).token_ids
    )
    long = engine.generate("Count from 1 to 50, separated by commas.", Sampling(max_tokens=40))
    assert long.finish_reason == "length" and len(long.token_ids) == 40
    stopped = engine.generate(
        "Count from 1 to 50, separated by commas.", Sampling(max_tokens=40, stop=("5",))
    )
    assert stopped.finish_reason == "stop" and "5" not in stopped.text


def test_generate_command_reports_where_time_went(tmp_path: Path) -> None:
    cmd = [sys.executable, "-m", "kvstore.cli.main", "generate", "Say hello.", "--max-tokens", "4", "-v",
           "--data-dir", str(tmp_path)]  # fmt: skip
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr
    assert "computed" in result.stderr and "prefill" in result.stderr and result.stdout.strip()


def test_short_prompts_are_stored_through_a_sidecar(lm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine

    server = Sidecar(tmp_path / "data").start()  # 32-token blocks: the engine cannot know that
    try:
        with KVClient(server.address) as client:
            engine = Engine(lm, client)
            ids = engine.encode("Name three colours of the rainbow, please, in a short list.")
            assert 32 < len(ids) < 256
            assert engine.prefill(ids).stored_blocks == len(ids) // 32
            assert engine.prefill(ids).matched_tokens == (len(ids) - 1) // 32 * 32
    finally:
        server.kill()
