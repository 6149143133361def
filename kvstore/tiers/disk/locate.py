"""Where an LMDB value lies in the data file, found from its B-tree node without touching the value.

py-lmdb touches one byte of every page of a value it hands out (its `preload`, done with the GIL
released so that no page fault is taken with it held later). To learn where a 32 MiB layer pack
lies, that read the whole pack from disk: 20-25 ms cold per pack here with kernel readahead, 0.6 s
without (8,196 faults), before a partial load read the quarter of it it wanted (docs/performance.md,
"Partial loads"). It also made every cold full load read each value twice: once by faults, once by
`pread`.

A value larger than a page lives in overflow pages, and its leaf node keeps the first overflow page's
number right after the key (LMDB's node layout, mdb.c `MDB_node`, little-endian: data size as two
u16, flags u16 with `F_BIGDATA` = 1, key size u16, the key, then the page number as u64). A cursor's
key, asked for with buffers, is a view into that leaf page, so the node header lies just before it:
the value starts `pgno * page size + 16` (the overflow page's header) bytes into the file. Nothing but
the leaf page is read.

A place found this way is checked once against the mapped address of a value of at most 1 MiB
(`NodeLocator.agrees`) before it is trusted (another LMDB build could lay nodes out otherwise), and
every byte read from it is still verified by its reader (identity and checksums).
"""

from __future__ import annotations

import ctypes
import itertools
import struct
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

_NODE = struct.Struct("<HHHH")  # data size low, data size high, flags, key size
_PGNO = struct.Struct("<Q")
F_BIGDATA = 0x01
PAGE_HEADER = 16  # bytes before an overflow page's data (mdb.c `PAGEHDRSZ`, 64-bit builds)
#: The check reads a value this large at most (a block's summary; never a 32 MiB pack).
CHECK_BYTES = 1 << 20
#: `runs_ahead` has the kernel read at most this much of one run.
RUN_AHEAD_BYTES = 16 << 20


def node_span(key: Any, page_size: int) -> tuple[int, int] | None:
    """(file offset, bytes) of the big value whose leaf node holds `key` (a buffer view of the key
    inside its leaf page, from a cursor of a `buffers=True` transaction); None when the node holds
    its value inline (not an overflow value) or does not look like a node for this key."""
    view = np.frombuffer(key, np.uint8)
    address, size = int(view.ctypes.data), int(view.nbytes)
    low, high, flags, key_size = _NODE.unpack(ctypes.string_at(address - _NODE.size, _NODE.size))
    if key_size != size or not flags & F_BIGDATA:
        return None
    (pgno,) = _PGNO.unpack(ctypes.string_at(address + size, _PGNO.size))
    return pgno * page_size + PAGE_HEADER, low | (high << 16)


class NodeLocator:
    """Finds big values by their nodes once a first one agreed with its mapped place. Thread-safe
    (a verdict is set once, to the same value by whichever thread gets there first).

    Args:
        page_size: the environment's page size.
        file_span: (view into the map, bytes) -> (file offset, bytes) of that view, or None.
    """

    def __init__(self, page_size: int, file_span: Callable[[Any, int], tuple[int, int] | None]) -> None:
        self.page_size, self._file_span = page_size, file_span
        self.agrees: bool | None = None  # None: not checked yet

    def place(self, txn: Any, cursor: Any, key: bytes) -> Any:
        """Where the value of `key` lies: (file offset, bytes) from its node, else a view of it in the
        map (a small value, or nodes not found to agree); None if not held. `cursor` is `txn`'s (a
        py-lmdb read transaction with buffers)."""
        if not cursor.set_key(key):
            return None
        if self.agrees is None and (big := node_span(cursor.key(), self.page_size)):
            self._check(txn, cursor if big[1] <= CHECK_BYTES else None)
        span = node_span(cursor.key(), self.page_size) if self.agrees else None
        return span if span is not None else cursor.value()

    def runs_ahead(self, txn: Any, cursor: Any, runs: Sequence[Sequence[bytes]]) -> list[tuple[int, int]]:
        """(file offset, bytes) from each run's first value over as many pages as its values would
        take were they all that value's size and adjacent (a block's summaries: one transaction wrote
        them in order), for the kernel to read at once: locating the other values faults in each
        one's first page otherwise, one random 4 KiB read each (2,048 of them, 0.13 s, at 16k tokens
        of an 8B shape cold). Only the first value of each run is located; runs of one value, and a
        single run (a load's own reads ahead cover it), are skipped."""
        spans = []
        for keys in runs if len(runs) > 1 else ():
            first = self.place(txn, cursor, keys[0]) if len(keys) > 1 else None
            if isinstance(first, tuple):
                pages = -(-(first[1] + PAGE_HEADER) // self.page_size)
                nbytes = min(pages * self.page_size * len(keys), RUN_AHEAD_BYTES)
                spans.append((first[0] - PAGE_HEADER, nbytes))
        return spans

    def _check(self, txn: Any, cursor: Any | None) -> None:
        """Compare the node's place of one big value of at most `CHECK_BYTES` (the one under
        `cursor`, else the first near the start) with its place in the map. Its pages are touched:
        py-lmdb hands out no mapped address otherwise."""
        if cursor is None:
            cursor = txn.cursor()
            keys = itertools.islice(cursor.iternext(keys=True, values=False), 4096)
            if not any(_checkable(node_span(k, self.page_size)) for k in keys):
                return  # none near the start: checked on a later call
        view = cursor.value()
        found, mapped = node_span(cursor.key(), self.page_size), self._file_span(view, len(view))
        if found is not None and mapped is not None:
            self.agrees = found == mapped


def _checkable(span: tuple[int, int] | None) -> bool:
    return span is not None and span[1] <= CHECK_BYTES
