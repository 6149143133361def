"""fsck and relayout over the layered layout: checks, flipped bytes, skipping, migration, SIGKILL."""

from __future__ import annotations

import json
import signal
from collections import Counter
from pathlib import Path

import numpy as np
import pytest

from kvstore.config import StoreConfig
from kvstore.offline.fsck import fsck
from kvstore.offline.relayout import FAULT_ENV, relayout
from kvstore.store.tiered import TieredStore
from tests.conftest import TINY, corrupt_chunk, kvsieve, make_kv, make_tokens

N, PROMPTS = 96, 4
BASE = {"block_tokens": 32, "chunk_tokens": 16, "layer_chunk_tokens": 8}
RECORDS = TINY.num_layers + 1  # per layered block: a summary per layer and the pack of layer records


def _config(data_dir: Path, layout: str, pack: bool = True) -> StoreConfig:
    return StoreConfig(data_dir=data_dir, layout=layout, layered_pack=pack, **BASE)  # type: ignore[arg-type]


def _fill(data_dir: Path, layout: str, pack: bool = True) -> list[tuple[np.ndarray, np.ndarray]]:
    prompts = [(make_tokens(N, seed=i), make_kv(TINY, N, seed=i)) for i in range(PROMPTS)]
    with TieredStore(_config(data_dir, layout, pack)) as store:
        for tokens, kv in prompts:
            store.store(tokens, kv, model=TINY, scores=np.linspace(0, 1, N).astype(np.float32))
            scattered = np.random.default_rng(5).permutation(N).astype(np.float32)
            store.report_scores(tokens, scattered, model=TINY)  # stale for an importance layout
    return prompts


def _check_loads(data_dir: Path, prompts: list[tuple[np.ndarray, np.ndarray]]) -> Counter[str]:
    """Every prompt loads bit-exact; returns the layout kinds of the blocks."""
    with TieredStore(_config(data_dir, "importance")) as store:
        for tokens, kv in prompts:
            covered, positions, loaded = store.load_arrays(tokens, model=TINY)
            assert covered == N and sorted(positions.tolist()) == list(range(N))
            assert loaded.tobytes() == kv[:, :, :, positions].tobytes()
        return Counter(n.payload.layout for n in store.tree.nodes())


def test_fsck_is_clean_on_layered_blocks_and_reports_layouts(tmp_path: Path) -> None:
    _fill(tmp_path, "layered")
    report = fsck(tmp_path)
    assert report.clean and report.layouts == {"layered": PROMPTS * 3}
    assert report.chunks_checked == PROMPTS * 3 * RECORDS
    result = kvsieve("fsck", "--data-dir", str(tmp_path))
    assert result.returncode == 0 and f"layouts: {PROMPTS * 3} layered" in result.stdout


@pytest.mark.parametrize(
    ("pack", "record", "offset", "label"),
    [
        (True, 1, None, "summary 1 (layer 1)"),
        (True, TINY.num_layers, None, "layer pack 2"),  # the middle byte: in a chunk of a record
        (True, TINY.num_layers, 20, "layer pack 2"),  # in the pack's table
        (True, TINY.num_layers, 120, "layer pack 2"),  # in layer 0's header, inside the pack
        (False, TINY.num_layers + 1, None, "layer record 3 (layer 1)"),  # v2: the middle byte, a chunk
        (False, TINY.num_layers, 20, "layer record 2 (layer 0)"),  # v2: in the header
    ],
)
def test_fsck_finds_a_flipped_byte_in_a_summary_and_in_a_layer_record(
    tmp_path: Path, pack: bool, record: int, offset: int | None, label: str
) -> None:
    prompts = _fill(tmp_path, "layered", pack)
    with TieredStore(_config(tmp_path, "layered", pack)) as store:
        victim = store.index.match(store._root(TINY, "default"), prompts[0][0], touch=False).nodes[2].key
    corrupt_chunk(_config(tmp_path, "layered", pack), victim, record, offset)
    report = fsck(tmp_path)
    assert [(p.kind, p.key) for p in report.problems] == [("bad-chunk", victim.hex())]
    assert report.problems[0].detail.startswith(f"{label}: ")
    repaired = fsck(tmp_path, repair=True)
    assert repaired.repaired and repaired.blocks_removed == 1 and fsck(tmp_path).clean


def test_relayout_leaves_layered_blocks_alone(tmp_path: Path) -> None:
    prompts = _fill(tmp_path, "layered")
    report = relayout(tmp_path, min_change=0.0)
    assert report.blocks_rewritten == 0 and report.layered_blocks_skipped == PROMPTS * 3
    assert _check_loads(tmp_path, prompts) == {"layered": PROMPTS * 3}
    assert fsck(tmp_path).clean


def test_relayout_to_layered_migrates_every_block(tmp_path: Path) -> None:
    prompts = _fill(tmp_path, "importance")
    dry = relayout(tmp_path, to_layered=True, dry_run=True)
    assert dry.blocks_migrated == PROMPTS * 3 and dry.bytes_written == 0
    result = kvsieve("relayout", "--data-dir", str(tmp_path), "--to-layered", "--json")
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["blocks_migrated"] == PROMPTS * 3
    assert _check_loads(tmp_path, prompts) == {"layered": PROMPTS * 3}
    report = fsck(tmp_path)
    assert report.clean and report.chunks_checked == PROMPTS * 3 * RECORDS
    with TieredStore(_config(tmp_path, "layered")) as store:
        assert store.stats().tiers["lmdb"].num_chunks == PROMPTS * 3 * RECORDS
        tokens, kv = prompts[1]
        with store.open_layers(tokens, model=TINY) as load:
            assert load.matched_tokens == N
            np.testing.assert_array_equal(load.read_layer(1, [0, 11]).kv[:, :, 8:], kv[1][:, :, 88:])
    assert relayout(tmp_path, to_layered=True).blocks_migrated == 0  # nothing left to do


def test_relayout_to_layered_repacks_v2_blocks_and_they_load_bit_exact(tmp_path: Path) -> None:
    prompts = _fill(tmp_path, "layered", pack=False)  # layout v2: a value per layer record
    v2_records = 2 * TINY.num_layers
    assert fsck(tmp_path).chunks_checked == PROMPTS * 3 * v2_records
    result = kvsieve("relayout", "--data-dir", str(tmp_path), "--to-layered")
    assert result.returncode == 0, result.stderr
    assert f"repacked {PROMPTS * 3} of layout v2 (0 already packed)" in result.stdout
    assert _check_loads(tmp_path, prompts) == {"layered": PROMPTS * 3}
    report = fsck(tmp_path)
    assert report.clean and report.chunks_checked == PROMPTS * 3 * RECORDS  # and no v2 record is left
    with TieredStore(_config(tmp_path, "layered")) as store:
        tokens, kv = prompts[2]
        assert all(n.payload.is_packed for n in store.tree.nodes())
        with store.open_layers(tokens, model=TINY) as load:
            np.testing.assert_array_equal(load.read_layer(0, [1, 6]).kv[:, :, :8], kv[0][:, :, 8:16])
    again = relayout(tmp_path, to_layered=True)
    assert (again.blocks_repacked, again.layered_blocks_skipped) == (0, PROMPTS * 3)


def test_relayout_to_layered_killed_between_its_two_transactions(tmp_path: Path) -> None:
    prompts = _fill(tmp_path, "importance")
    result = kvsieve(
        "relayout",
        "--data-dir",
        str(tmp_path),
        "--to-layered",
        env={FAULT_ENV: "relayout-between-transactions"},
    )
    assert result.returncode == -signal.SIGKILL  # it died at the fault point, mid-job
    assert _check_loads(tmp_path, prompts) == {"layered": 1, "importance": PROMPTS * 3 - 1}
    stale = fsck(tmp_path).problems
    assert {p.kind for p in stale} == {"stale-chunk"} and len(stale) == 32 // 16  # the old layout's chunks
    again = relayout(tmp_path, to_layered=True)
    assert again.stale_chunks_removed == len(stale) and again.blocks_migrated == PROMPTS * 3 - 1
    assert _check_loads(tmp_path, prompts) == {"layered": PROMPTS * 3}
    assert fsck(tmp_path).clean


def test_relayout_to_layered_refuses_a_chunk_size_that_does_not_divide(tmp_path: Path) -> None:
    prompts = _fill(tmp_path, "importance")
    with pytest.raises(ValueError, match="layer_chunk_tokens must divide the blocks' 32 tokens, got 12"):
        relayout(tmp_path, to_layered=True, layer_chunk_tokens=12)
    assert _check_loads(tmp_path, prompts) == {"importance": PROMPTS * 3}  # nothing was written
