"""Copying chunks of KV into one array: the last copy of every load path.

A chunk of 16 tokens lands in a `(layers, 2, heads, tokens, dim)` array as
`layers * 2 * heads` separate runs of `16 * dim` elements (2 KiB for fp16 SmolLM2).
Copies made of runs that small reached 0.37-0.42 of a contiguous memcpy of the same
bytes on the development machine, two threads copying disjoint chunks 0.69-0.78
(numpy releases the GIL while it copies; bench/micro/test_place.py measures both).

So the chunks of a block, as the stream delivers them, are split in two by bytes:
one half copied on the calling thread, the other on one pool thread, and the next
block is read after both halves are done. Copying a block at a time keeps the copies
overlapping the disk's readahead of later blocks; the calling thread copies while
the pool thread does, so the pool thread never waits for a GIL held by Python work
(handing it every chunk while the caller read the stream measured slower than one thread).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NamedTuple, TypeVar

import numpy as np

from kvstore.errors import InvalidInputError
from kvstore.values import LoadedChunk

Array = np.ndarray[Any, Any]

# Below this many bytes one thread copies: the hop to the pool costs more than it saves.
PARALLEL_MIN_BYTES = 2 << 20
# Chunks copied together at most (a block of SmolLM2 is 5.9 MB): copies start before the
# stream ends, so they overlap the reads of what follows.
BLOCK_BYTES = 8 << 20
Index = slice | Array  # along the token axis (3) of the destination
Copy = tuple[Array, Index, Array]  # (destination, token index, source)

T = TypeVar("T")

_pool: ThreadPoolExecutor | None = None
_pool_lock = threading.Lock()


class Destination:
    """The array a load will be gathered into, lent to the reader before the blocks are read, so
    that a block whose chunks must be joined anyway (a layered block joins its layers) joins them
    here: `place_chunks` then finds those chunks in place and copies nothing (one copy of every
    byte instead of two). Slots are claimed in stream order, as `place_chunks` fills them.
    Not thread-safe: one load's reader owns it.

    Args:
        out: (layers, 2, heads, slots, dim), written in place.
    """

    def __init__(self, out: Array) -> None:
        self.out = out
        self.next_slot = 0

    def claim(self, num_tokens: int) -> Array:
        """The next `num_tokens` slots, (layers, 2, heads, num_tokens, dim), a view of `out`; they
        are filled by the block being read and `advance` moves past them. An empty view (which fits
        no block) once `out` is full."""
        end = min(self.next_slot + num_tokens, self.out.shape[3])
        return self.out[:, :, :, self.next_slot : end]

    def advance(self, num_tokens: int) -> None:
        """The block just read delivered `num_tokens` tokens, wherever it put them. Mutates."""
        self.next_slot += num_tokens


class Placed(NamedTuple):
    """What `place_chunks` wrote: the positions of the filled slots, in slot order, and how many."""

    positions: Array
    num_tokens: int


def parallel_copies() -> bool:
    """Whether copies are split across two threads (the process may run on two cores or more)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    return cores > 1


def place_chunks(chunks: Iterable[LoadedChunk], out: Array, *, at_positions: bool) -> Placed:
    """Copy every chunk's KV into `out`, converting dtype on the way if `out`'s differs.

    Chunks are copied a block at a time as the stream delivers them, so the copies of one
    block overlap the disk reads of the next (the tier's readahead runs meanwhile).

    Args:
        chunks: a load stream or a list of its chunks.
        out: destination of shape (layers, 2, heads, slots, dim), written in place.
        at_positions: each chunk goes to its tokens' positions (slot = position, as an
            engine's cache holds a prefix); otherwise chunks fill slots 0.. in stream order.

    Returns:
        `Placed`: the positions of the filled slots, in slot order, and their count.

    Raises:
        InvalidInputError: a chunk's shape does not fit `out`, or it would write past its
            end (the chunks of earlier blocks were copied; nothing of that block is).
    """
    if out.ndim != 5:
        raise InvalidInputError(f"out must have shape (layers, 2, heads, slots, dim), got {out.shape}")
    parts: list[Array] = []
    group: list[LoadedChunk] = []
    group_bytes = 0
    slot = 0
    for chunk in chunks:
        if group and (chunk.block_index != group[-1].block_index or group_bytes >= BLOCK_BYTES):
            slot = _place_group(group, out, slot, at_positions, parts)
            group, group_bytes = [], 0
        _check_shape(chunk, out)
        group.append(chunk)
        group_bytes += chunk.kv.nbytes
    if group:
        slot = _place_group(group, out, slot, at_positions, parts)
    positions = np.concatenate(parts) if parts else np.zeros(0, np.int64)
    return Placed(positions, slot)


def _place_group(
    group: list[LoadedChunk], out: Array, slot: int, at_positions: bool, parts: list[Array]
) -> int:
    """Copy one group of chunks (one block's, as delivered); returns the next free slot."""
    sizes = [len(c.positions) for c in group]
    positions = np.concatenate([c.positions for c in group])
    ends = np.cumsum(sizes, dtype=np.int64)  # within the group
    starts = ends - np.asarray(sizes, np.int64)
    if at_positions:
        if len(positions) and (positions.min() < 0 or positions.max() >= out.shape[3]):
            raise InvalidInputError(
                f"chunk positions {positions.min()}..{positions.max()} lie outside the "
                f"{out.shape[3]} slots of out"
            )
        if len(np.unique(positions)) != len(positions):  # two threads: the winner would be chance
            raise InvalidInputError("chunks of one block name the same position twice")
        runs = _runs(positions, starts, ends)  # one vectorised pass
        copies: list[Copy] = [
            (out, slice(int(positions[a]), int(positions[a]) + n) if run else positions[a : a + n], c.kv)
            for c, a, n, run in zip(group, starts, sizes, runs, strict=True)
            if n  # a chunk of no tokens copies nothing (and has no first position)
        ]
    else:
        if slot + int(ends[-1]) > out.shape[3]:
            raise InvalidInputError(
                f"chunks fill {slot + int(ends[-1])} slots, more than the {out.shape[3]} of out"
            )
        copies = [
            (out, slice(slot + int(a), slot + int(b)), c.kv)
            for c, a, b in zip(group, starts, ends, strict=True)
        ]
    first_byte = out.__array_interface__["data"][0]  # once per group: 32 chunks a block
    run_copies([copy for copy in copies if not _in_place(*copy, first_byte)])
    parts.append(positions)
    return slot + int(ends[-1])


def _check_shape(chunk: LoadedChunk, out: Array) -> None:
    kv, n = chunk.kv, len(chunk.positions)
    if kv.ndim != 5 or kv.shape[:3] != out.shape[:3] or kv.shape[4] != out.shape[4] or kv.shape[3] != n:
        raise InvalidInputError(
            f"chunk {chunk.block_index}/{chunk.chunk_index} has KV shape {kv.shape}, which does not "
            f"fit a destination of shape {out.shape} with {n} tokens"
        )


def _in_place(dst: Array, index: Index, src: Array, dst_first_byte: int) -> bool:
    """Whether `src` already is `dst[:, :, :, index]` (a view of it that a `Destination` lent):
    the same first byte, shape and strides (checked without making the view: 256 chunks a load).
    `dst_first_byte`: the address of `dst`'s first byte."""
    if not isinstance(index, slice) or src.strides != dst.strides or src.dtype != dst.dtype:
        return False
    start, stop, step = index.indices(dst.shape[3])
    first = dst_first_byte + start * dst.strides[3]
    same_shape = step == 1 and src.shape == (*dst.shape[:3], stop - start, dst.shape[4])
    return same_shape and src.__array_interface__["data"][0] == first


def _runs(positions: Array, starts: Array, ends: Array) -> list[bool]:
    """Per chunk, whether its positions are consecutive and increasing (a slice of slots)."""
    breaks = np.flatnonzero(np.diff(positions) != 1)  # i: positions[i + 1] != positions[i] + 1
    # A chunk [a, b) is a run if no break lies in [a, b - 1).
    first_break = np.searchsorted(breaks, starts)
    return [bool(k >= len(breaks) or breaks[k] >= b - 1) for k, b in zip(first_break, ends, strict=True)]


def run_copies(copies: Sequence[Copy]) -> None:
    """`dst[:, :, :, index] = src` for each copy; in two threads when they are large.

    The copies must write disjoint parts of their destinations.
    """
    in_two_threads(copies, [src.nbytes for _, _, src in copies], _copy_all)


def copy_pairs(pairs: Sequence[tuple[Array, Array]]) -> None:
    """`dst[...] = src` for each (dst, src); in two threads when they are large (as `run_copies`).

    The pairs must write disjoint arrays.
    """
    in_two_threads(pairs, [src.nbytes for _, src in pairs], _copy_pairs)


def in_two_threads(items: Sequence[T], sizes: Sequence[int], work: Callable[[Sequence[T]], None]) -> None:
    """`work(items)`, split in two halves by `sizes` (bytes) run on this thread and the pool's
    when there is enough to copy; returns when both halves are done (re-raises their error)."""
    total = sum(sizes)
    if total < PARALLEL_MIN_BYTES or len(items) < 2 or not parallel_copies():
        work(items)
        return
    half, acc = len(items), 0
    for i, size in enumerate(sizes):
        acc += size
        if 2 * acc >= total:
            half = i + 1
            break
    future = _executor().submit(work, items[half:])
    try:
        work(items[:half])
    finally:
        future.result()  # never returns with a copy still running; re-raises its error


def _copy_all(copies: Sequence[Copy]) -> None:
    for dst, index, src in copies:
        dst[:, :, :, index] = src


def _copy_pairs(pairs: Sequence[tuple[Array, Array]]) -> None:
    for dst, src in pairs:
        dst[...] = src


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _pool_lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvsieve-copy")
        return _pool


def _forget_pool_in_child() -> None:
    """A forked child (an engine's worker process) has no copy of the pool's thread: an
    inherited executor would queue copies that nothing runs. The child makes its own."""
    global _pool, _pool_lock
    _pool, _pool_lock = None, threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_forget_pool_in_child)
