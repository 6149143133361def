"""TieredStore: lookup / store / load through real tiers, and bad input touching nothing."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
from conftest import corrupt_chunk, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.errors import InvalidInputError, NotFoundError, StoreFullError
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore


def test_store_then_load_is_bit_exact(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(100), make_kv(tiny, 100)
    result = store.store(tokens, kv, model=tiny)
    assert (result.num_tokens, result.new_blocks) == (96, 3)
    assert store.lookup(tokens, model=tiny).num_tokens == 96
    covered, positions, loaded = store.load_arrays(tokens, model=tiny)
    assert covered == 96
    assert positions.tolist() == list(range(96))
    assert loaded.tobytes() == kv[:, :, :, :96].tobytes()


def test_only_new_blocks_are_written(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(128), make_kv(tiny, 128)
    store.store(tokens[:64], kv[:, :, :, :64], model=tiny)
    second = store.store(tokens, kv, model=tiny)
    assert second.new_blocks == 2
    assert store.stats().get("blocks_written") == 4
    again = store.store(tokens, kv, model=tiny)
    assert (again.new_blocks, again.bytes_written) == (0, 0)


def test_lookup_of_longer_and_divergent_prompts(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(96), make_kv(tiny, 96)
    store.store(tokens, kv, model=tiny)
    longer = np.concatenate([tokens, make_tokens(50, seed=9)])
    assert store.lookup(longer, model=tiny).num_tokens == 96
    divergent = tokens.copy()
    divergent[40] += 1
    assert store.lookup(divergent, model=tiny).num_tokens == 32


def test_namespaces_and_models_are_isolated(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(64), make_kv(tiny, 64)
    store.store(tokens, kv, model=tiny, namespace="tenant-a")
    assert store.lookup(tokens, model=tiny, namespace="tenant-b").num_tokens == 0
    other = ModelSpec("test-tiny", 2, 2, 4, weights_digest="different")
    assert store.lookup(tokens, model=other, namespace="tenant-a").num_tokens == 0
    assert store.load_arrays(tokens, model=tiny, namespace="tenant-b")[0] == 0


def test_restarted_store_is_warm(small_config: StoreConfig, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(96), make_kv(tiny, 96)
    with TieredStore(small_config) as s:
        s.store(tokens, kv, model=tiny)
    with TieredStore(small_config) as s:
        assert s.lookup(tokens, model=tiny).num_tokens == 96
        covered, _, loaded = s.load_arrays(tokens, model=tiny)
        assert covered == 96 and loaded.tobytes() == kv[:, :, :, :96].tobytes()
        assert s.stats().get("chunk_hits.lmdb") == 3  # a layer pack per block (the default layout)
        s.load_arrays(tokens, model=tiny)  # promoted: now served from memory
        assert s.stats().get("chunk_hits.memory") == 3


@pytest.mark.parametrize("codec", ["raw", "shuffle-zstd"])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16", "float32"])
def test_every_dtype_and_codec_round_trips(tmp_path: Path, codec: str, dtype: str) -> None:
    model = ModelSpec("t", 2, 1, 8, dtype=dtype)
    config = StoreConfig(data_dir=tmp_path, block_tokens=16, chunk_tokens=4, codec=codec)
    tokens, kv = make_tokens(40), make_kv(model, 40)
    with TieredStore(config) as s:
        s.store(tokens, kv, model=model)
    with TieredStore(config) as s:  # from disk, then from memory
        for _ in range(2):
            covered, _, loaded = s.load_arrays(tokens, model=model)
            assert covered == 32 and loaded.tobytes() == kv[:, :, :, :32].tobytes()


@pytest.mark.parametrize(
    ("field", "mutate", "message"),
    [
        ("shape", lambda t, kv, s: (t, kv[:, :, :, :-1], s), "shape"),
        ("dtype", lambda t, kv, s: (t, kv.astype(np.float32), s), "dtype"),
        ("tokens", lambda t, kv, s: (t.astype(float), kv, s), "integers"),
        ("negative", lambda t, kv, s: (t * 0 - 1, kv, s), r"\[0, "),
        ("scores", lambda t, kv, s: (t, kv, np.ones(3)), "scores"),
        ("nan scores", lambda t, kv, s: (t, kv, np.full(len(t), np.nan)), "finite"),
    ],
)
def test_bad_store_input_writes_nothing(
    store: TieredStore, tiny: ModelSpec, field: str, mutate, message: str
) -> None:
    tokens, kv = make_tokens(64), make_kv(tiny, 64)
    bad_tokens, bad_kv, bad_scores = mutate(tokens, kv, None)
    with pytest.raises(InvalidInputError, match=message):
        store.store(bad_tokens, bad_kv, model=tiny, scores=bad_scores)
    assert store.stats().tiers["lmdb"].num_blocks == 0
    assert store.tree.num_blocks == 0


@pytest.mark.parametrize("budget", [0.0, -0.5, 1.5, float("nan"), "half"])
def test_budget_outside_unit_interval_is_rejected(
    store: TieredStore, tiny: ModelSpec, budget: object
) -> None:
    with pytest.raises(InvalidInputError, match=r"budget must be a fraction in \(0, 1\]"):
        store.load(make_tokens(64), model=tiny, budget=budget)  # type: ignore[arg-type]


def test_partial_budget_reads_leading_chunks_of_each_block(store: TieredStore, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(64), make_kv(tiny, 64)
    store.store(tokens, kv, model=tiny)
    stream = store.load(tokens, model=tiny, budget=0.25)
    chunks = list(stream)
    # 16 of 64 tokens, no scores: each block gives its first chunk of 8 tokens.
    assert [(c.block_index, c.chunk_index) for c in chunks] == [(0, 0), (1, 0)]
    assert stream.selected_tokens == 16 and stream.delivered_tokens == 16
    for c in chunks:
        assert c.kv.tobytes() == kv[:, :, :, c.positions].tobytes()


def test_scores_order_tokens_inside_blocks(small_config: StoreConfig, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(32), make_kv(tiny, 32)
    scores = np.zeros(32, np.float32)
    important = [3, 9, 17, 30, 1, 22, 5, 12]
    scores[important] = np.arange(len(important), 0, -1)
    with TieredStore(dataclasses.replace(small_config, layout="importance")) as store:
        store.store(tokens, kv, model=tiny, scores=scores)
        stream = store.load(tokens, model=tiny, budget_tokens=8)
        chunks = list(stream)
    assert len(chunks) == 1 and chunks[0].positions.tolist() == important
    assert chunks[0].kv.tobytes() == kv[:, :, :, important].tobytes()
    assert stream.read_amplification == pytest.approx(chunks[0].nbytes / (8 * tiny.token_bytes))


def test_disk_budget_evicts_least_recently_used_blocks(tmp_path: Path, tiny: ModelSpec) -> None:
    probe = StoreConfig(data_dir=tmp_path / "probe", block_tokens=32, chunk_tokens=8)
    with TieredStore(probe) as s:
        block_bytes = s.store(make_tokens(32), make_kv(tiny, 32), model=tiny).bytes_written
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=32, chunk_tokens=8, disk_bytes=3 * block_bytes)
    prompts = [make_tokens(32, seed=i) for i in range(4)]
    with TieredStore(config) as s:
        for i in range(3):
            s.store(prompts[i], make_kv(tiny, 32, i), model=tiny)
        s.lookup(prompts[0], model=tiny)  # prompt 1 is now the least recently used
        s.store(prompts[3], make_kv(tiny, 32, 3), model=tiny)
        held = [s.lookup(p, model=tiny).num_tokens for p in prompts]
        assert held == [32, 0, 32, 32]
        assert s.stats().tiers["lmdb"].used_bytes <= 3 * block_bytes
        assert s.stats().get("evictions.disk") == 1


def test_pinned_blocks_are_not_evicted_and_full_store_says_so(tmp_path: Path, tiny: ModelSpec) -> None:
    probe = StoreConfig(data_dir=tmp_path / "probe", block_tokens=32, chunk_tokens=8)
    with TieredStore(probe) as s:
        block_bytes = s.store(make_tokens(32), make_kv(tiny, 32), model=tiny).bytes_written
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=32, chunk_tokens=8, disk_bytes=block_bytes)
    with TieredStore(config) as s:
        first = make_tokens(32, seed=1)
        s.store(first, make_kv(tiny, 32, 1), model=tiny)
        lease = s.pin(first, model=tiny, ttl_s=60)
        with pytest.raises(StoreFullError):
            s.store(make_tokens(32, seed=2), make_kv(tiny, 32, 2), model=tiny)
        assert s.lookup(first, model=tiny).num_tokens == 32
        s.unpin(lease.lease_id)
        s.store(make_tokens(32, seed=2), make_kv(tiny, 32, 2), model=tiny)
        assert s.lookup(first, model=tiny).num_tokens == 0


def test_leases_expire_and_unknown_leases_are_not_found(small_config: StoreConfig, tiny: ModelSpec) -> None:
    now = [1000.0]  # an injected clock: expiry is decided by it, not by how fast this machine is
    with TieredStore(small_config, clock=lambda: now[0]) as store:
        tokens = make_tokens(32)
        store.store(tokens, make_kv(tiny, 32), model=tiny)
        lease = store.pin(tokens, model=tiny, ttl_s=10)
        now[0] += 9
        assert store.stats().active_leases == 1  # one second before expiry
        now[0] += 1
        stats = store.stats()
        assert (stats.active_leases, stats.get("leases_expired")) == (0, 1)  # at expiry
        with pytest.raises(NotFoundError):
            store.unpin(lease.lease_id)
        with pytest.raises(InvalidInputError, match="ttl_s"):
            store.pin(tokens, model=tiny, ttl_s=0)


def test_flipped_byte_on_disk_is_a_miss_and_counted(small_config: StoreConfig, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(96), make_kv(tiny, 96)
    with TieredStore(small_config) as s:
        s.store(tokens, kv, model=tiny)
        second_block = s.tree.match(s._root(tiny, "default"), np.asarray(tokens, np.uint32)).nodes[1]
    corrupt_chunk(small_config, second_block.key, chunk_index=2)
    with TieredStore(small_config) as s:
        # The first block is intact; the corrupt one and what follows are a miss.
        covered, _, loaded = s.load_arrays(tokens, model=tiny)
        assert covered == 32
        assert loaded.tobytes() == kv[:, :, :, :32].tobytes()
        assert s.stats().get("checksum_failures") == 1
        assert s.lookup(tokens, model=tiny).num_tokens == 32


def test_memory_only_store(tiny: ModelSpec) -> None:
    with TieredStore(StoreConfig(block_tokens=32, chunk_tokens=8, memory_bytes=1 << 20)) as s:
        tokens, kv = make_tokens(64), make_kv(tiny, 64)
        s.store(tokens, kv, model=tiny)
        covered, _, loaded = s.load_arrays(tokens, model=tiny)
        assert covered == 64 and loaded.tobytes() == kv.tobytes()


def test_sidecars_share_blocks_through_redis(tmp_path: Path, redis_url: str, tiny: ModelSpec) -> None:
    tokens, kv = make_tokens(96, seed=77), make_kv(tiny, 96, seed=77)
    a = StoreConfig(data_dir=tmp_path / "a", block_tokens=32, chunk_tokens=8, remote_url=redis_url)
    b = StoreConfig(data_dir=tmp_path / "b", block_tokens=32, chunk_tokens=8, remote_url=redis_url)
    with TieredStore(a) as first:
        first.store(tokens, kv, model=tiny)
    with TieredStore(b) as second:
        assert second.lookup(tokens, model=tiny).num_tokens == 96
        covered, _, loaded = second.load_arrays(tokens, model=tiny)
        assert covered == 96 and loaded.tobytes() == kv[:, :, :, :96].tobytes()
        assert second.stats().get("chunk_hits.redis") == 3  # a layer pack per block
        assert second.lookup(tokens, model=tiny, namespace="other").num_tokens == 0


@pytest.mark.parametrize("policy", ["lru", "score"])
def test_memory_only_lookup_never_promises_what_load_cannot_deliver(tiny: ModelSpec, policy: str) -> None:
    with TieredStore(StoreConfig(block_tokens=32, chunk_tokens=8, memory_policy=policy)) as probe:
        block_bytes = probe.store(make_tokens(32), make_kv(tiny, 32), model=tiny).bytes_written
    config = StoreConfig(block_tokens=32, chunk_tokens=8, memory_bytes=5 * block_bytes, memory_policy=policy)
    prompts = [(make_tokens(64, seed=i), make_kv(tiny, 64, seed=i)) for i in range(8)]
    with TieredStore(config) as s:
        for stored, (tokens, kv) in enumerate(prompts, start=1):
            scores = np.random.default_rng(stored).random(64).astype(np.float32)  # uneven chunk mass
            s.store(tokens, kv, model=tiny, scores=scores)
            for earlier, earlier_kv in prompts[:stored]:
                promised = s.lookup(earlier, model=tiny).num_tokens
                covered, positions, loaded = s.load_arrays(earlier, model=tiny)
                assert covered == promised
                assert loaded.tobytes() == earlier_kv[:, :, :, positions].tobytes()
        held = [s.lookup(t, model=tiny).num_tokens for t, _ in prompts]
        assert held[-1] == 64 and 0 in held  # eviction happened, the newest prompt stayed whole
        assert s.stats().get("evictions.memory") > 0
        assert s.stats().get("chunk_misses") == 0


def test_store_is_all_or_nothing_when_the_budget_is_held(tmp_path: Path, tiny: ModelSpec) -> None:
    probe = StoreConfig(data_dir=tmp_path / "probe", block_tokens=32, chunk_tokens=8)
    with TieredStore(probe) as s:
        block_bytes = s.store(make_tokens(32), make_kv(tiny, 32), model=tiny).bytes_written
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=32, chunk_tokens=8, disk_bytes=2 * block_bytes)
    pinned, two_blocks = make_tokens(32, seed=1), make_tokens(64, seed=2)
    with TieredStore(config) as s:
        s.store(pinned, make_kv(tiny, 32, 1), model=tiny)
        s.pin(pinned, model=tiny, ttl_s=600)
        with pytest.raises(StoreFullError, match="nothing of this call was kept"):
            s.store(two_blocks, make_kv(tiny, 64, 2), model=tiny)  # its first block alone would fit
        assert s.lookup(two_blocks, model=tiny).num_tokens == 0
        assert s.stats().tiers["lmdb"].num_blocks == 1
    with TieredStore(config) as s:
        assert s.lookup(two_blocks, model=tiny).num_tokens == 0  # nothing of it on disk either
        assert s.lookup(pinned, model=tiny).num_tokens == 32
