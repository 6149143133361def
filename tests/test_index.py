"""StoreIndex: the one owner of eviction (memory included), leases and load plans, over a real
memory tier and LMDB on tmp_path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
from test_tiers_contract import FP, NS, make_block

from kvstore.config import StoreConfig
from kvstore.errors import StoreFullError
from kvstore.format.block_meta import BlockMeta
from kvstore.index.store_index import StoreIndex
from kvstore.load import plan as plan_module
from kvstore.load.plan import plan_load
from kvstore.stats import Counters
from kvstore.tiers import create_tier
from kvstore.tiers.base import Tier
from kvstore.tiers.memory import MemoryTier

ROOT = (NS, FP)


def index_over(
    memory: MemoryTier, policy: str = "lru", local: list[Tier] | None = None, cache: bool = True
) -> StoreIndex:
    config = StoreConfig(block_tokens=8, chunk_tokens=2, memory_policy=policy)
    return StoreIndex(config, memory, local or [], memory_is_cache=cache, counters=Counters())


def held(memory: MemoryTier, meta: BlockMeta) -> list[bool]:
    return [c is not None for c in memory.get_chunks(meta, [0, 1, 2, 3])]


def test_memory_cache_evicts_least_recently_used_chunks() -> None:
    a, ca = make_block(12)
    b, cb = make_block(13)
    memory = MemoryTier(a.nbytes + b.nbytes // 2)
    index = index_over(memory)
    assert index.put_in_memory(a, ca)
    index.touch_memory(a, [2, 3])  # chunks 2 and 3 of a become the most recent
    assert index.put_in_memory(b, cb)
    assert held(memory, a) == [False, False, True, True]
    assert held(memory, b) == [True] * 4
    assert index.memory_evictions == 2


def test_memory_cache_keeps_pinned_blocks() -> None:
    a, ca = make_block(14)
    b, cb = make_block(15)
    memory = MemoryTier(a.nbytes + 10)
    index = index_over(memory)
    index.insert(ROOT, a)
    assert index.put_in_memory(a, ca)
    with index.held([index.tree.get(a.key)]):  # type: ignore[list-item]
        assert not index.put_in_memory(b, cb)
    assert held(memory, a) == [True] * 4 and not memory.contains(b.key)


def test_score_policy_evicts_low_importance_chunks_first() -> None:
    a, ca = make_block(40)
    b, cb = make_block(41)
    # Importance order: a's chunk 0 holds most of its mass, chunk 3 the least.
    a = replace(a, scores=np.array([8, 8, 4, 4, 2, 2, 1, 1], dtype=np.float32))
    b = replace(b, scores=np.array([8, 8, 4, 4, 2, 2, 1, 1], dtype=np.float32))
    memory = MemoryTier(a.nbytes + b.nbytes // 2)
    index = index_over(memory, policy="score")
    index.put_in_memory(a, ca)
    index.put_in_memory(b, cb)  # needs two of a's chunks' room: the two least important go
    assert held(memory, a) == [True, True, False, False]


def test_score_policy_weighs_access_frequency() -> None:
    a, ca = make_block(42)
    b, cb = make_block(43)
    c, cc = make_block(44)
    memory = MemoryTier(2 * a.nbytes)
    index = index_over(memory, policy="score")
    index.put_in_memory(a, ca)
    index.put_in_memory(b, cb)
    for _ in range(3):
        index.touch_memory(a, [0, 1, 2, 3])  # a is read often, b never
    index.put_in_memory(c, cc)
    assert held(memory, a) == [True] * 4
    assert held(memory, b) == [False] * 4


def test_memory_as_the_only_copy_never_loses_a_chunk_of_a_listed_block() -> None:
    a, ca = make_block(16)
    b, cb = make_block(17)
    memory = MemoryTier(a.nbytes + b.nbytes // 2)
    index = index_over(memory, cache=False)
    index.insert(ROOT, a)
    assert index.put_in_memory(a, ca)
    assert not index.put_in_memory(b, cb)  # no chunk of a is given up on its own
    assert held(memory, a) == [True] * 4
    index.reserve_memory(b.nbytes)  # whole blocks leave, through the tree
    assert not memory.contains(a.key) and index.tree.get(a.key) is None
    assert index.memory_evictions == 4


def test_reserve_memory_refuses_when_everything_is_pinned() -> None:
    a, ca = make_block(18)
    memory = MemoryTier(a.nbytes)
    index = index_over(memory, cache=False)
    index.insert(ROOT, a)
    index.put_in_memory(a, ca)
    index.grant(index.match(ROOT, a.tokens), ttl_s=60)
    with pytest.raises(StoreFullError, match="pinned"):
        index.reserve_memory(10)
    assert held(memory, a) == [True] * 4


def test_disk_eviction_frees_every_local_tier(tmp_path: Path) -> None:
    a, ca = make_block(19)
    lmdb = create_tier("lmdb", path=tmp_path / "l")
    memory = MemoryTier(1 << 20)
    index = index_over(memory, local=[lmdb])
    lmdb.put_block(a, ca)
    index.put_in_memory(a, ca)
    index.insert(ROOT, a)
    index.evict(1)
    assert not lmdb.contains(a.key) and not memory.contains(a.key) and index.tree.num_blocks == 0
    lmdb.close()


def test_a_lease_counts_its_keys_and_expires_on_the_holder_clock() -> None:
    a, _ = make_block(20)
    now = [100.0]
    config = StoreConfig(block_tokens=8, chunk_tokens=2)
    index = StoreIndex(config, MemoryTier(1 << 20), [], memory_is_cache=False, counters=Counters(),
                       clock=lambda: now[0])  # fmt: skip
    index.insert(ROOT, a)
    lease = index.grant(index.match(ROOT, a.tokens), ttl_s=30)
    assert (lease.num_keys, lease.ttl_s, lease.expires_at) == (1, 30, 130.0)
    assert index.lease_keys(lease.lease_id) == (a.key,) and index.tree.is_pinned(a.key)
    now[0] = 130.0
    index.leases.sweep()
    assert index.lease_keys(lease.lease_id) == () and not index.tree.is_pinned(a.key)


def test_load_plan_selects_the_chunk_holding_the_top_scored_tokens() -> None:
    a, _ = make_block(21)  # stored in prompt order: slots 6 and 7 (chunk 3) score highest
    index = index_over(MemoryTier(1 << 20))
    index.insert(ROOT, replace(a, scores=np.arange(8, dtype=np.float32)))
    plan = plan_load(index.match(ROOT, a.tokens), 0.25)
    assert (plan.matched_tokens, plan.selected_tokens, plan.chunks) == (8, 2, [[3]])
    assert [m.key for m in plan.blocks] == [a.key]


@pytest.mark.parametrize("budget", [1.0, 8, 100])
def test_a_budget_holding_every_token_plans_every_chunk_in_order_without_ranking(
    budget: float | int, monkeypatch: pytest.MonkeyPatch
) -> None:
    a, _ = make_block(21)
    index = index_over(MemoryTier(1 << 20))
    index.insert(ROOT, replace(a, scores=np.arange(8, dtype=np.float32)[::-1].copy()))
    match = index.match(ROOT, a.tokens)
    ranked = plan_load(match, 7)  # one token short: ranked, and it still takes every chunk

    def no_ranking(*args: object) -> None:
        raise AssertionError("ranked the chunks of a load that takes them all")

    monkeypatch.setattr(plan_module, "select_chunks", no_ranking)
    monkeypatch.setattr(plan_module, "rank_chunks", no_ranking)
    plan = plan_load(match, budget)
    assert plan.chunks == ranked.chunks == [[0, 1, 2, 3]]
    assert plan.selected_tokens == ranked.selected_tokens == 8
    assert plan.estimated_coverage == 1.0 and ranked.estimated_coverage == pytest.approx(1.0)
