"""How much of a cached prefix to load and how much to compute, on estimates alone (engine_adapter/
runner/costs.py and choice.py; what measurements change: tests/test_choice.py), and
the split itself (engine_adapter/runner/split.py): the head computed while the tail loads, on the
CPU with the staged device path, a random Llama of a small shape and a real store."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import measured_costs

from engine_adapter.runner.choice import choose
from engine_adapter.runner.costs import CostModel, Rates
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel, random_llama, spec_from_config
from engine_adapter.runner.plans import Request
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

TOKEN_BYTES = 128 << 10  # an 8B model's KV per token
BLOCK = 256


def _at(prefix: int, memory_fraction: float, query_aware: float | None = None) -> Request:
    """A request of `prefix` cached tokens (8B-shaped KV) and a 64-token question."""
    return Request(prefix + 64, prefix, memory_fraction, TOKEN_BYTES, BLOCK, query_aware=query_aware)


def test_a_fast_disk_loads_everything() -> None:
    plan = choose(measured_costs(200.0, 32_000), _at(4096, memory_fraction=0.0))
    assert plan.kind == "full" and plan.load_tokens == 4096 and "full" in plan.reason


def test_a_slow_disk_computes_the_head_while_the_tail_loads() -> None:
    costs = measured_costs(1.7, 32_000)  # the H200 machine's disk against an 8B model in fp16
    plan = choose(costs, _at(4096, memory_fraction=0.0))
    assert plan.kind == "split" and plan.compute_tokens % BLOCK == 0 and 0 < plan.load_tokens < 4096
    assert plan.estimate_s < min(plan.recompute_s, plan.full_s)
    # balanced: the head's compute and the tail's read take about as long
    assert costs.compute_s(plan.compute_tokens) == pytest.approx(
        costs.read_s("disk", plan.load_tokens * TOKEN_BYTES), rel=0.35
    )
    assert plan.reason.startswith("split ") and "nothing measured here yet" in plan.reason


def test_memory_makes_loading_win_and_a_very_fast_device_recomputes() -> None:
    warm = choose(measured_costs(1.7, 32_000), _at(4096, memory_fraction=1.0))
    assert warm.kind == "full"
    fast = choose(measured_costs(0.05, 10_000_000), _at(4096, memory_fraction=0.0))
    assert fast.kind == "recompute" and fast.compute_tokens == 4096


def test_until_measured_loads_win_and_the_fit_finds_the_attention_term() -> None:
    assert choose(CostModel(), _at(4096, memory_fraction=0.0)).kind == "full"
    costs = CostModel(Rates())
    per_token, per_pair = 2e-5, 1e-9
    for n, start in ((512, 0), (4096, 0), (64, 8192), (16384, 0)):
        costs.observe_prefill(n, start, n * per_token + n * (start + n / 2) * per_pair)
    assert costs.compute_s(1000, 1000) == pytest.approx(1000 * per_token + 1000 * 1500 * per_pair, rel=1e-6)


def _tiny_lm(tmp_path: Path) -> LoadedModel:
    torch.manual_seed(0)
    model = random_llama((128, 256, 4, 4, 2, 1000), "cpu", torch.float32)
    return LoadedModel(
        model, None, spec_from_config(model.config, tmp_path / "tiny", "float16"), tmp_path / "tiny"
    )


@pytest.mark.parametrize("forced", ["split", "recompute"])
def test_the_split_gives_the_full_loads_answer(tmp_path: Path, forced: str) -> None:
    lm = _tiny_lm(tmp_path)
    ids = np.random.default_rng(1).integers(0, 1000, 8 * 32 + 10).tolist()
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8, host_arena=True)
    with TieredStore(config) as store:
        Engine(lm, store, collect_stats=False).prefill(ids)  # computes and stores 8 blocks
    with TieredStore(config) as store:  # memory empty: the prefix is on disk
        full = Engine(lm, store, collect_stats=False, transfer=KVTransfer(torch.device("cpu"), staging=True))
        full.costs = measured_costs(1000.0, 1.0)  # loading wins
        expected = full.prefill(ids)
        assert (
            full.last_split is not None and full.last_split.kind == "full" and expected.loaded_tokens == 256
        )
    with TieredStore(config) as store:
        engine = Engine(
            lm, store, collect_stats=False, transfer=KVTransfer(torch.device("cpu"), staging=True)
        )
        engine.costs = measured_costs(0.001, 1000) if forced == "split" else measured_costs(1e-6, 1e9)
        got = engine.prefill(ids)
    plan = engine.last_split
    assert plan is not None and plan.kind == forced
    loaded = plan.load_tokens if forced == "split" else 0
    assert 0 < plan.load_tokens < 256 if forced == "split" else plan.load_tokens == 0
    assert got.loaded_tokens == loaded and got.computed_tokens == len(ids) - loaded
    assert torch.allclose(got.logits, expected.logits, atol=2e-3, rtol=0)  # fp16 KV against fp32 compute
    assert int(got.logits.argmax()) == int(expected.logits.argmax())


def test_query_aware_is_chosen_on_a_device_only_where_it_was_measured_faster() -> None:
    costs = measured_costs(1.7, 32_000)
    request = _at(16384, memory_fraction=1.0, query_aware=0.25)
    assert choose(costs, request).kind == "full"  # never measured: a full load (exact) it is
    costs.observe_layered(16384, 2.33)  # what the H200 measured at 16k, 8B shape
    assert choose(costs, request).kind == "full"
    fast = measured_costs(1.7, 32_000)
    fast.observe_layered(16384, 0.01)
    plan = choose(fast, request)
    assert plan.kind == "query-aware" and plan.option.budget == 0.25 and plan.load_tokens == 16384


def test_a_corrupt_tail_block_is_computed_instead(tmp_path: Path) -> None:
    from tests.conftest import corrupt_chunk

    lm = _tiny_lm(tmp_path)
    ids = np.random.default_rng(2).integers(0, 1000, 8 * 32 + 10).tolist()
    config = StoreConfig(data_dir=tmp_path / "kv", block_tokens=32, chunk_tokens=8, host_arena=True)
    with TieredStore(config) as store:
        reference = Engine(lm, None, collect_stats=False).prefill(ids)
        Engine(lm, store, collect_stats=False).prefill(ids)
        last = max(store.listed_blocks(), key=lambda m: m.start)
    corrupt_chunk(config, last.key, last.pack_index)  # the prefix's last block: in the tail
    with TieredStore(config) as store:
        engine = Engine(
            lm, store, collect_stats=False, transfer=KVTransfer(torch.device("cpu"), staging=True)
        )
        engine.costs = measured_costs(0.001, 1000)
        got = engine.prefill(ids)
        assert engine.last_split is not None and engine.last_split.kind == "split"
        assert got.loaded_tokens == engine.last_split.load_tokens - 32  # all of the tail but that block
        assert store.stats().counters["checksum_failures"] == 1
    assert torch.allclose(got.logits, reference.logits, atol=2e-3, rtol=0)
