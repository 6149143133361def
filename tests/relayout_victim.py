"""Helper for test_relayout.py: run the re-layout job until killed, saying after each block.

It prints "ready" before the job starts and "block" after each block's rewrite is
complete (both transactions committed), then waits for a line on stdin before the next
block: the test paces it, so that however slow the test's own process is (a loaded CI
machine), the job is killed after a chosen number of blocks, with work still to do, and
the test knows how far it got.
"""

from __future__ import annotations

import sys

from kvstore.format.block_meta import BlockMeta
from kvstore.offline.relayout import relayout
from kvstore.tiers.disk.lmdb import LmdbTier

_drop_layout = LmdbTier.drop_layout


def _drop_layout_and_say(self: LmdbTier, old: BlockMeta) -> None:
    _drop_layout(self, old)
    print("block", flush=True)
    sys.stdin.readline()  # "go": the test lets the next block start


if __name__ == "__main__":
    LmdbTier.drop_layout = _drop_layout_and_say  # type: ignore[method-assign]
    print("ready", flush=True)
    relayout(sys.argv[1], min_change=0.0)
    print("done", flush=True)
