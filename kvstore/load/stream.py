"""The embedded store's load stream: chunks of blocks as the tiers deliver them, and
`gather_chunks`, which copies a stream's chunks into one array."""

from __future__ import annotations

import collections
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

import numpy as np

from kvstore.load.assemble import Destination, place_chunks
from kvstore.load.place import Placed
from kvstore.load.read_packed import PackView
from kvstore.model import ModelSpec
from kvstore.values import Array, LoadedChunk

Delivered = TypeVar("Delivered", PackView, Placed)  # a whole block: its positions and bytes read


class BlockStream(Iterator[list[LoadedChunk] | None]):
    """`BlockReader.read_blocks`: each block's chunks, or None for a lost block (which ends it).

    `destination`: set by the consumer before it reads on, the array the rest of the stream will
    be gathered into (`LocalLoadStream.gather`); a layered block joins its layers there.
    """

    def __init__(self) -> None:
        self.blocks: Iterator[list[LoadedChunk] | None] = iter(())
        self.destination: Destination | None = None
        #: Where every planned block is a whole pack: the blocks as `PackView`s instead (a block
        #: lost: None, which ends them), read in place of `blocks` (`LocalLoadStream.pack_views`).
        self.views: Callable[[], Iterator[PackView | None]] | None = None
        #: Where every planned block is a whole pack: the blocks copied into a caller's array at the
        #: slots of their positions instead (kvstore/load/place.py), read in place of `blocks`.
        self.place: Callable[[Array], Iterator[Placed | None]] | None = None

    def __next__(self) -> list[LoadedChunk] | None:
        return next(self.blocks)


class LocalLoadStream:
    """The embedded store's `kvstore.api.LoadStream`: chunks of blocks read one at a time.

    Args:
        matched_tokens: prefix length the lookup promised.
        selected_tokens: tokens the budget selected.
        token_bytes: KV bytes of one token (for read amplification).
        block_tokens: tokens per block (a lost block ends the stream at its start).
        blocks: each block's verified chunks in order; None for a lost block, which ends it.
        on_finish: called once when the stream is exhausted (the store's counters).
        prefix_bytes: encoded bytes of all the matched blocks (for `read_fraction`).
        estimated_coverage: share of the estimated attention mass the plan selected.
        first_token: where the first planned block starts (the blocks before it were skipped).
    """

    def __init__(
        self,
        matched_tokens: int,
        selected_tokens: int,
        token_bytes: int,
        block_tokens: int,
        blocks: Iterator[list[LoadedChunk] | None],  # a BlockStream lets `gather` lend its array
        on_finish: Callable[[LocalLoadStream], None] = lambda stream: None,
        prefix_bytes: int = 0,
        estimated_coverage: float = 1.0,
        first_token: int = 0,
    ) -> None:
        self.matched_tokens = matched_tokens
        self.num_tokens = matched_tokens
        self.selected_tokens = selected_tokens
        self.delivered_tokens = 0
        self.bytes_read = 0
        self.prefix_bytes = prefix_bytes
        self.estimated_coverage = estimated_coverage
        self._token_bytes = token_bytes
        self._block_tokens = block_tokens
        self._first_token = first_token
        self._blocks = blocks
        self._blocks_read = 0
        self._pending: collections.deque[LoadedChunk] = collections.deque()
        self._on_finish: Callable[[LocalLoadStream], None] | None = on_finish

    @property
    def read_amplification(self) -> float:
        """Bytes read / bytes of the selected tokens (1.0 when nothing was selected)."""
        wanted = self.selected_tokens * self._token_bytes
        return self.bytes_read / wanted if wanted else 1.0

    @property
    def delivered_fraction(self) -> float:
        """Tokens delivered / tokens of the matched prefix (0.0 when nothing matched)."""
        return self.delivered_tokens / self.matched_tokens if self.matched_tokens else 0.0

    @property
    def read_fraction(self) -> float:
        """Bytes read / encoded bytes of the matched prefix (0.0 when nothing matched)."""
        return self.bytes_read / self.prefix_bytes if self.prefix_bytes else 0.0

    def __iter__(self) -> Iterator[LoadedChunk]:
        return self

    def __next__(self) -> LoadedChunk:
        while not self._pending:
            if self._on_finish is None:  # finished or closed
                raise StopIteration
            try:
                block = next(self._blocks)
            except StopIteration:
                self._finish(lost_block=False)
                raise
            if block is None:
                self._finish(lost_block=True)
                raise StopIteration
            self._blocks_read += 1
            self._pending.extend(block)
        chunk = self._pending.popleft()
        self.bytes_read += chunk.nbytes
        self.delivered_tokens += len(chunk.positions)
        return chunk

    def gather(self, model: ModelSpec) -> tuple[Array, Array]:
        """Read the rest of the stream into (positions (n,), kv (layers, 2, heads, n, dim)).

        The array is made before the rest is read and lent to the reader (a `Destination`), so that
        blocks whose chunks are joined while read (the layered layout's) are joined in it and
        copied once; it is sized for the selected tokens not yet delivered (fewer if a block is lost).
        """
        if self._pending or not isinstance(self._blocks, BlockStream) or self._on_finish is None:
            return gather_chunks(list(self), model)
        rest = self.selected_tokens - self.delivered_tokens
        destination = Destination(np.empty(model.kv_shape(max(rest, 0)), model.np_dtype))
        self._blocks.destination = destination
        try:
            listed = list(self)
        finally:
            self._blocks.destination = None
        num_tokens = sum(len(c.positions) for c in listed)
        if num_tokens > destination.out.shape[3]:  # more than planned (never expected): no lending
            return gather_chunks(listed, model)
        kv = destination.out[:, :, :, :num_tokens]
        placed = place_chunks(listed, kv, at_positions=False)  # what is in place is not copied
        if num_tokens < destination.out.shape[3]:  # a lost block ended the stream early
            kv = np.ascontiguousarray(kv)
        return placed.positions, kv

    def pack_views(self) -> Iterator[PackView] | None:
        """The rest of the stream as `PackView`s, block by block as they are read, where every
        planned block is a whole pack and nothing was read yet; else None (use `gather`). Views of
        the memory tier's own bytes: a copy to a device from them is the only copy. A lost block
        ends them (`num_tokens` then says where), as it ends the chunks."""
        if self._pending or self._blocks_read or not isinstance(self._blocks, BlockStream):
            return None
        if self._blocks.views is None or self._on_finish is None:
            return None
        return self._views(self._blocks.views())

    def place_into(self, out: Array) -> Iterator[Placed] | None:
        """The rest of the stream copied straight into `out` (layers, 2, kv_heads, slots, head_dim),
        each token at the slot of its position, block by block (each yielded once it is there and
        verified), where every planned block is a whole pack, all fit `out` and nothing was read
        yet; else None (read the chunks). Each block's bytes are copied once, from memory's pack or
        from the page cache (kvstore/load/place.py). A lost block ends it, as it ends the chunks;
        slots past the blocks yielded may hold anything."""
        if self._pending or self._blocks_read or not isinstance(self._blocks, BlockStream):
            return None
        place = self._blocks.place
        if place is None or self._on_finish is None or self.matched_tokens > out.shape[3]:
            return None
        return self._views(place(out))

    def _views(self, views: Iterator[Delivered | None]) -> Iterator[Delivered]:
        for view in views:
            if self._on_finish is None:  # closed meanwhile
                return
            if view is None:
                self._finish(lost_block=True)
                return
            self._blocks_read += 1
            self.bytes_read += view.nbytes
            self.delivered_tokens += len(view.positions)
            yield view
        self._finish(lost_block=False)

    def close(self) -> None:
        """Stop reading; the chunks already read stay valid. Idempotent."""
        self._blocks = iter(())
        self._pending.clear()
        self._on_finish = None

    def __enter__(self) -> LocalLoadStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _finish(self, lost_block: bool) -> None:
        if lost_block:  # the prefix delivered ends where the lost block starts
            self.num_tokens = self._first_token + self._blocks_read * self._block_tokens
        on_finish, self._on_finish = self._on_finish, None
        if on_finish is not None:
            on_finish(self)


def gather_chunks(chunks: Iterable[LoadedChunk], model: ModelSpec) -> tuple[Array, Array]:
    """The chunks in stream order as (positions (n,), kv (layers, 2, heads, n, dim)): one new
    array, filled by two threads when it is large (kvstore/load/assemble.py)."""
    listed = list(chunks)
    kv = np.empty(model.kv_shape(sum(len(c.positions) for c in listed)), model.np_dtype)
    placed = place_chunks(listed, kv, at_positions=False)
    return placed.positions, kv
