"""fsck finds flipped bytes and broken links; --repair removes them; the exit code tells."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import lmdb
import numpy as np
import pytest
from conftest import corrupt_chunk, kvsieve, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.store.tiered import TieredStore


@pytest.fixture(params=["layered", "importance"])
def config(small_config: StoreConfig, request: pytest.FixtureRequest) -> StoreConfig:
    """`small_config` in each layout (fsck's counts and damage differ between them)."""
    return dataclasses.replace(small_config, layout=request.param)


def records_per_block(config: StoreConfig, tiny: ModelSpec) -> int:
    """4 chunks of an importance-layout block; a layered block's summary per layer and its layer pack."""
    return tiny.num_layers + 1 if config.layout == "layered" else config.block_tokens // config.chunk_tokens


def filled(config: StoreConfig, tiny: ModelSpec) -> list[bytes]:
    tokens = make_tokens(96)
    with TieredStore(config) as s:
        s.store(tokens, make_kv(tiny, 96), model=tiny)
        s.store(make_tokens(64, seed=5), make_kv(tiny, 64, 5), model=tiny)
        return [n.key for n in s.tree.match(s._root(tiny, "default"), np.asarray(tokens, np.uint32)).nodes]


def test_clean_store_is_clean(config: StoreConfig, tiny: ModelSpec) -> None:
    filled(config, tiny)
    report = fsck(config.data_dir)  # type: ignore[arg-type]
    assert report.clean and report.exit_code == 0
    assert (report.blocks_checked, report.chunks_checked) == (5, 5 * records_per_block(config, tiny))
    result = kvsieve("fsck", "--data-dir", str(config.data_dir))
    assert result.returncode == 0 and "clean" in result.stdout


def test_flipped_byte_is_reported_then_repaired(config: StoreConfig, tiny: ModelSpec) -> None:
    keys = filled(config, tiny)
    corrupt_chunk(config, keys[1], chunk_index=records_per_block(config, tiny) - 1)
    result = kvsieve("fsck", "--data-dir", str(config.data_dir), "--json")
    report = json.loads(result.stdout)
    assert result.returncode == 2
    assert [(p["key"], p["kind"]) for p in report["problems"]] == [(keys[1].hex(), "bad-chunk")]
    result = kvsieve("fsck", "--data-dir", str(config.data_dir), "--repair")
    assert result.returncode == 1 and "removed 2 blocks" in result.stdout  # the bad one and its child
    assert fsck(config.data_dir).clean  # type: ignore[arg-type]
    with TieredStore(config) as s:
        assert s.lookup(make_tokens(96), model=tiny).num_tokens == 32
        assert s.lookup(make_tokens(64, seed=5), model=tiny).num_tokens == 64


def test_missing_parent_and_stray_chunks_are_found(config: StoreConfig, tiny: ModelSpec) -> None:
    records = records_per_block(config, tiny)
    keys = filled(config, tiny)
    env = lmdb.open(str(config.lmdb_dir), max_dbs=4)
    blocks = env.open_db(b"blocks")
    with env.begin(write=True) as txn:
        txn.delete(keys[0], db=blocks)  # its chunks stay behind, unreferenced
    env.close()
    report = fsck(config.data_dir)  # type: ignore[arg-type]
    kinds = sorted({p.kind for p in report.problems})
    assert kinds == ["orphan-block", "orphan-chunk"]
    assert sum(p.kind == "orphan-chunk" for p in report.problems) == records
    repaired = fsck(config.data_dir, repair=True)  # type: ignore[arg-type]
    assert repaired.blocks_removed == 2 and repaired.chunks_removed == records
    assert fsck(config.data_dir).clean  # type: ignore[arg-type]


def test_fsck_of_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    result = kvsieve("fsck", "--data-dir", str(tmp_path / "nothing"))
    assert result.returncode == 3 and "no kvsieve store" in result.stderr  # could not run at all


def test_fsck_repair_beside_a_live_store_cannot_run(small_config: StoreConfig, tiny: ModelSpec) -> None:
    filled(small_config, tiny)
    with TieredStore(small_config):
        result = kvsieve("fsck", "--data-dir", str(small_config.data_dir), "--repair")
    assert result.returncode == 3 and "in use by a running kvsieve" in result.stderr
    assert "Traceback" not in result.stderr
