"""A `kvsieve serve` killed with SIGKILL with hundreds of blocks in its disk backlog, several
times, at random points of a group commit (issue #40, item 2).

A real sidecar over a real socket; a client thread stores prompts as fast as the sidecar
acknowledges them. Once the backlog holds hundreds of blocks the test waits a random time
(within the writer's 1 s group period, so the kill lands before, inside or after a commit) and
kills. Each restart must then load every prompt ever acknowledged bit-exact or as a miss,
never lose a block it served after an earlier restart (those were on disk), list only what
is on disk (no orphans), and leave `kvsieve fsck` clean.
"""

from __future__ import annotations

import random
import threading
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.store.tiered import TieredStore

MODEL = ModelSpec("behind-crash", num_layers=2, num_kv_heads=2, head_dim=32)  # 16 KiB a block
BLOCK = 32
TOKENS = 8 * BLOCK
ROUNDS = 4
BACKLOG = 200  # blocks in the backlog before the kill is armed
# Group commits of up to 4,096 blocks or 1 s: hundreds of blocks each at this machine's rate.
ARGS = ["--block-tokens", str(BLOCK), "--commit-ms", "1000", "--commit-blocks", "4096"]
Array = np.ndarray[Any, Any]


def prompt(round_index: int, j: int) -> tuple[Array, Array]:
    rng = np.random.default_rng(round_index * 100_000 + j)
    return rng.integers(0, 50_000, TOKENS), rng.standard_normal(MODEL.kv_shape(TOKENS)).astype(np.float16)


def store_until_killed(address: str, round_index: int, acked: list[int]) -> None:
    """Store prompts of the round until the sidecar dies; `acked` gets each acknowledged one."""
    try:
        with KVClient(address, use_shm=False) as client:
            for j in range(100_000):
                client.store(*prompt(round_index, j), model=MODEL)
                acked.append(j)
    except Exception:  # the sidecar was killed: the store in flight was never acknowledged
        return


def wait_for_backlog(address: str, blocks: int, timeout_s: float = 120) -> None:
    """Until the disk took a first group commit and the backlog holds `blocks` again: the kill
    then lands with groups on disk and hundreds of blocks that are not (stores are acknowledged
    far faster than one commit period, so the backlog alone is there before any commit)."""
    deadline = time.monotonic() + timeout_s
    with KVClient(address, use_shm=False) as client:
        while True:
            counters = client.stats().counters
            if counters.get("disk_commits", 0) >= 1 and counters.get("disk_backlog_blocks", 0) >= blocks:
                return
            assert time.monotonic() < deadline, "the backlog never grew: nothing to kill mid-commit"
            time.sleep(0.005)


def verify(address: str, acked: dict[int, list[int]], present: set[tuple[int, int]]) -> int:
    """Load every acknowledged prompt: bit-exact or a miss; a prompt served whole after an
    earlier restart must still be whole. Adds what is whole to `present`; returns blocks seen."""
    blocks = 0
    with KVClient(address, use_shm=False) as client:
        for round_index, js in acked.items():
            for j in js:
                tokens, kv = prompt(round_index, j)
                covered, positions, loaded = client.load_arrays(tokens, model=MODEL)
                assert covered % BLOCK == 0 and positions.tolist() == list(range(covered))
                assert loaded.tobytes() == kv[:, :, :, :covered].tobytes()  # whole blocks, exact
                if (round_index, j) in present:
                    assert covered == TOKENS, "a block the disk held was lost"
                if covered == TOKENS:
                    present.add((round_index, j))
                blocks += covered // BLOCK
    return blocks


@pytest.mark.slow
def test_sigkill_mid_backlog_leaves_whole_blocks_or_misses(tmp_path: Path) -> None:
    rng = random.Random(40)
    data_dir = tmp_path / "data"
    acked: dict[int, list[int]] = {}
    present: set[tuple[int, int]] = set()
    for round_index in range(ROUNDS):
        server = Sidecar(data_dir, ARGS).start()
        try:
            verify(server.address, acked, present)
            acked[round_index] = []
            args = (server.address, round_index, acked[round_index])
            writer = threading.Thread(target=store_until_killed, args=args)
            writer.start()
            wait_for_backlog(server.address, BACKLOG)
            time.sleep(rng.uniform(0.0, 1.0))  # anywhere in the writer's 1 s group period
            server.kill()
            writer.join(60)
            assert not writer.is_alive()
        finally:
            server.kill()
        assert fsck(data_dir).clean
        with TieredStore(StoreConfig(data_dir=data_dir, block_tokens=BLOCK)) as store:
            assert store.orphans == 0  # the index lists only blocks whose parents are on disk
    server = Sidecar(data_dir, ARGS).start()
    try:
        served = verify(server.address, acked, present)
    finally:
        server.kill()
    acknowledged = sum(len(js) for js in acked.values()) * (TOKENS // BLOCK)
    assert served < acknowledged  # the kills did land with a backlog (else this proved nothing)
    assert present  # and the disk did take groups between them
