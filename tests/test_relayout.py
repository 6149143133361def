"""The offline re-layout job: rewrites stale layouts, reads less afterwards, survives SIGKILL."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import TINY, make_kv, make_tokens

from kvstore.config import StoreConfig
from kvstore.offline.fsck import fsck
from kvstore.offline.relayout import FAULT_ENV, relayout
from kvstore.store.tiered import TieredStore

# re-layout rewrites importance-ordered blocks (layered blocks keep prompt order: tests/test_layered_admin.py)
CONFIG = {"block_tokens": 32, "chunk_tokens": 8, "layout": "importance"}
PROMPTS = 12


def fill(data_dir: Path, seed: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """Store prompts laid out by ascending scores, then report a scattered ranking."""
    prompts = [(make_tokens(96, seed=seed + i), make_kv(TINY, 96, seed=seed + i)) for i in range(PROMPTS)]
    with TieredStore(StoreConfig(data_dir=data_dir, **CONFIG)) as store:  # type: ignore[arg-type]
        for tokens, kv in prompts:
            store.store(tokens, kv, model=TINY, scores=np.linspace(0, 1, 96).astype(np.float32))
            scattered = np.random.default_rng(seed + 99).permutation(96).astype(np.float32) * 100
            store.report_scores(tokens, scattered, model=TINY)
    return prompts


def check_loads(data_dir: Path, prompts: list[tuple[np.ndarray, np.ndarray]]) -> None:
    with TieredStore(StoreConfig(data_dir=data_dir, **CONFIG)) as store:  # type: ignore[arg-type]
        for tokens, kv in prompts:
            covered, positions, loaded = store.load_arrays(tokens, model=TINY)
            assert covered == 96
            assert loaded.tobytes() == kv[:, :, :, positions].tobytes()
            assert sorted(positions.tolist()) == list(range(96))


def test_relayout_rewrites_stale_blocks_and_reads_less(tmp_path: Path) -> None:
    prompts = fill(tmp_path)
    dry = relayout(tmp_path, dry_run=True)
    assert dry.blocks_rewritten == PROMPTS * 3 and dry.bytes_written == 0
    report = relayout(tmp_path)
    assert report.blocks_rewritten == PROMPTS * 3
    assert report.read_amp_after == 1.0 and report.read_amp_before > 1.5
    check_loads(tmp_path, prompts)
    assert fsck(tmp_path).clean
    with TieredStore(StoreConfig(data_dir=tmp_path, **CONFIG)) as store:  # type: ignore[arg-type]
        stream = store.load(prompts[0][0], model=TINY, budget=0.25)
        chunks = list(stream)
        # Each block reads only leading chunks, at most one of them partly wanted.
        for block in {c.block_index for c in chunks}:
            read = sorted(c.chunk_index for c in chunks if c.block_index == block)
            assert read == list(range(len(read)))
        assert stream.delivered_tokens < stream.selected_tokens + 3 * 8
        assert {n.payload.layout_version for n in store.tree.nodes()} == {1}
    assert relayout(tmp_path).blocks_rewritten == 0  # nothing left to do


def test_relayout_refuses_beside_a_live_store(tmp_path: Path) -> None:
    fill(tmp_path)
    with TieredStore(StoreConfig(data_dir=tmp_path, **CONFIG)):  # type: ignore[arg-type]
        cmd = [sys.executable, "-m", "kvstore.cli.main", "relayout", "--data-dir", str(tmp_path)]
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "in use by a running kvsieve" in result.stderr
    result = subprocess.run([*cmd, "--json"], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0 and json.loads(result.stdout)["blocks_rewritten"] == PROMPTS * 3


def layout_versions(data_dir: Path) -> dict[bytes, int]:
    """Layout version of every block, by key."""
    with TieredStore(StoreConfig(data_dir=data_dir, **CONFIG)) as store:  # type: ignore[arg-type]
        return {n.key: n.payload.layout_version for n in store.tree.nodes()}


def test_relayout_killed_between_its_two_transactions(tmp_path: Path) -> None:
    prompts = fill(tmp_path)
    cmd = [sys.executable, "-m", "kvstore.cli.main", "relayout", "--data-dir", str(tmp_path)]
    env = {**os.environ, FAULT_ENV: "relayout-between-transactions"}
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == -signal.SIGKILL  # it died at the fault point, mid-job
    assert Counter(layout_versions(tmp_path).values()) == {1: 1, 0: PROMPTS * 3 - 1}  # one switched
    check_loads(tmp_path, prompts)  # bit-exact: the switched block in its new layout, the rest old
    report = fsck(tmp_path)
    stale = [p for p in report.problems if p.kind == "stale-chunk"]
    assert len(report.problems) == len(stale) == 96 // CONFIG["chunk_tokens"] // 3  # the old layout's 4
    assert len({p.key for p in stale}) == 1 and "layout 0 is not current" in stale[0].detail
    again = relayout(tmp_path)
    assert again.stale_chunks_removed == len(stale) and again.blocks_rewritten == PROMPTS * 3 - 1
    check_loads(tmp_path, prompts)
    assert fsck(tmp_path).clean


@pytest.mark.slow
def test_relayout_killed_at_random_moments_stays_consistent(tmp_path: Path) -> None:
    rng = random.Random(7)
    prompts = fill(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    for round_index in range(10):
        if round_index:  # a new ranking, so that every block is stale again
            with TieredStore(StoreConfig(data_dir=tmp_path, **CONFIG)) as store:  # type: ignore[arg-type]
                for tokens, _kv in prompts:
                    scores = np.random.default_rng(round_index).random(96).astype(np.float32) * 1000
                    store.report_scores(tokens, scores, model=TINY)
        before = layout_versions(tmp_path)
        victim = [sys.executable, str(Path(__file__).parent / "relayout_victim.py"), str(tmp_path)]
        proc = subprocess.Popen(victim, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env)
        assert proc.stdin is not None and proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        finished = rng.randint(0, 12)  # of 36 blocks: the rest is still to do
        for _ in range(finished):  # the victim waits for a "go" after each block
            assert proc.stdout.readline().strip() == "block"
            proc.stdin.write("go\n")
            proc.stdin.flush()
        time.sleep(rng.uniform(0.0, 0.01))  # land anywhere inside the next block's rewrite (~20 ms)
        proc.send_signal(signal.SIGKILL)
        rest = proc.stdout.read()
        assert proc.wait() == -signal.SIGKILL and "done" not in rest  # killed mid-job
        proc.stdin.close()
        after = layout_versions(tmp_path)
        moved = sum(after[key] != version for key, version in before.items())
        assert finished <= moved < PROMPTS * 3  # the blocks it said it finished, and not all of them
        check_loads(tmp_path, prompts)
    relayout(tmp_path, min_change=0.0)
    check_loads(tmp_path, prompts)
    assert fsck(tmp_path).clean
