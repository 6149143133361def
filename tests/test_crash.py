"""A writer killed with SIGKILL mid-store, 20 times: only whole, bit-exact blocks or misses."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from crash_writer import CONFIG_KW, MODEL, SHARED, prompt

from kvstore.config import StoreConfig
from kvstore.offline.fsck import fsck
from kvstore.store.tiered import TieredStore

ROUNDS = 20


@pytest.mark.slow
def test_sigkill_mid_store_leaves_whole_blocks_or_misses(tmp_path: Path) -> None:
    rng = random.Random(1234)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parent), *sys.path])}
    checked_blocks = 0
    for round_index in range(ROUNDS):
        writer = str(Path(__file__).parent / "crash_writer.py")
        args = [sys.executable, writer, str(tmp_path), str(round_index)]
        proc = subprocess.Popen(args, stdout=subprocess.PIPE, env=env)
        assert proc.stdout is not None and proc.stdout.readline().strip() == b"ready"
        done = rng.randint(0, 3)  # prompts finished before the kill; 10,000 are queued
        for _ in range(done):
            assert proc.stdout.readline().strip() == b"stored"
        time.sleep(rng.uniform(0.0, 0.05))  # land anywhere inside the next store
        proc.send_signal(signal.SIGKILL)
        assert proc.wait() == -signal.SIGKILL  # it died by the signal, in the middle of its work
        blocks = verify_rounds(tmp_path, [round_index])
        assert blocks >= done * 512 // CONFIG_KW["block_tokens"]  # every prompt it reported is whole
        checked_blocks += blocks
    assert checked_blocks > ROUNDS  # the writer got real work done between kills
    assert verify_rounds(tmp_path, list(range(ROUNDS))) == checked_blocks  # later rounds lost nothing
    report = fsck(tmp_path)
    assert report.clean, report.problems


def verify_rounds(data_dir: Path, rounds: list[int]) -> int:
    """Reopen the store and check every prompt of `rounds`; returns the blocks verified."""
    blocks = 0
    with TieredStore(StoreConfig(data_dir=data_dir, **CONFIG_KW)) as store:  # type: ignore[arg-type]
        assert store.orphans == 0
        for round_index in rounds:
            for j in range(1_000):
                tokens, kv = prompt(round_index, j)
                hit = store.lookup(tokens, model=MODEL).num_tokens
                if hit == 0 and j > 0:
                    break
                assert hit in (SHARED if j else 0, len(tokens))  # a Store is all or nothing
                covered, positions, loaded = store.load_arrays(tokens, model=MODEL)
                assert covered == hit and covered % CONFIG_KW["block_tokens"] == 0
                assert positions.tolist() == list(range(covered))
                assert loaded.tobytes() == kv[:, :, :, :covered].tobytes()
                blocks += covered // CONFIG_KW["block_tokens"]
                if hit < len(tokens) - len(tokens) % CONFIG_KW["block_tokens"]:
                    break  # the writer was killed within this prompt
    return blocks
