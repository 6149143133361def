"""A block's chosen chunks of one layer read through the tiers: what a gathered read cannot serve.

A layer-by-layer load reads most blocks in one gathered read per layer (kvstore/load/layer_gather.py).
A block whose pack neither memory holds nor the disk's data file lays out raw (compressed records,
the remote tier, layout v2) is read here, fastest tier first: its layer record whole when every
chunk is wanted (then promoted to memory), else its header (verified, kept for the load's lifetime)
and the chosen chunks' byte ranges, in one read while records are uncompressed (`read_raw_runs`).
"""

from __future__ import annotations

from collections.abc import Callable

from kvstore.errors import ChecksumError, NotFoundError
from kvstore.format.block_meta import BlockMeta
from kvstore.format.chunk import GeometryError
from kvstore.format.layer_record import decode_layer_record
from kvstore.format.layered_block import layer_geometry
from kvstore.load.fetch import RecordFetcher
from kvstore.load.read_layered import RangedHeader, read_chunk_runs, read_header, read_raw_runs, reads_whole
from kvstore.model import ModelSpec
from kvstore.values import Array


class RangedLayerReads:
    """Per-block reads of a load's layer records; see module docstring. Not thread-safe: the
    loading thread alone reads chunks.

    Args:
        fetcher: the store's record fetcher.
        model: the model (geometry every header must have).
        lose: forgets a block whose record failed (`meta`, the counter to add).
        count_read: adds bytes to the load's `bytes_read`.
    """

    def __init__(
        self, fetcher: RecordFetcher, model: ModelSpec, lose: Callable[[BlockMeta, str], None],
        count_read: Callable[[int], None],
    ) -> None:  # fmt: skip
        self._fetcher, self._model, self._lose, self._count_read = fetcher, model, lose, count_read
        self._headers: dict[tuple[int, int], RangedHeader] = {}  # (block, layer): verified
        # header and chunks in one read (`read_raw_runs`) until a record turns out compressed
        self._raw_records = True

    def read(self, meta: BlockMeta, block_index: int, layer: int, mine: list[int], into: Array) -> None:
        """Sorted local chunks `mine` of one block's layer record, copied into `into`
        (len(mine), 2, kv_heads, chunk_tokens, head_dim).

        Raises:
            ChecksumError, GeometryError: the record failed its checks (the block is forgotten).
            NotFoundError: no tier holds the record (the block is forgotten).
        """
        try:
            chunks = self._layer_chunks(meta, block_index, layer, mine)
        except GeometryError as exc:
            self._lose(meta, "geometry_mismatches")
            raise GeometryError(f"block {meta.key.hex()}: {exc}") from exc
        except ChecksumError as exc:
            self._lose(meta, "checksum_failures")
            raise ChecksumError(f"block {meta.key.hex()}: {exc}") from exc
        if chunks is None:
            self._lose(meta, "chunk_misses")
            raise NotFoundError(f"block {meta.key.hex()}: the record of layer {layer} is in no tier")
        slot = 0
        for run in chunks:  # (n, 2, heads, c, dim) each, in order
            into[slot : slot + len(run)] = run
            slot += len(run)

    def _layer_chunks(
        self, meta: BlockMeta, block_index: int, layer: int, mine: list[int]
    ) -> list[Array] | None:
        """Chunks `mine` as runs of (n, 2, kv_heads, c, head_dim) arrays, in order; None: in no tier."""
        index, fetcher = meta.record_index(layer, 0), self._fetcher
        if reads_whole(len(mine), meta.chunks_per_layer):
            found = fetcher.whole_records(meta, [index], self._model)
            if found is None:
                return None
            geometry = layer_geometry(meta, layer, self._model)
            header, chunks = decode_layer_record(
                found[0].data, meta.chunk_id(index), found[0].trusted, geometry=geometry
            )
            fetcher.promote(meta, index, found[0], header, chunks)
            self._count_read(len(found[0].data))
            return [chunks[mine]]
        if self._raw_records and (block_index, layer) not in self._headers:  # header and chunks at once
            raw = read_raw_runs(fetcher, meta, index, mine, self._model)
            if raw is not None:
                self._headers[(block_index, layer)] = raw.head
                self._count_read(raw.nbytes)
                if raw.runs is not None:
                    return raw.runs
                self._raw_records = False  # compressed: this load reads by the header from now on
        for _attempt in range(2):  # a cached header's tier may have dropped the record since
            head = self._headers.get((block_index, layer))
            if head is None:
                head = read_header(fetcher, meta, index, self._model)
                if head is None:
                    return None
                self._headers[(block_index, layer)] = head
                self._count_read(head.header.size)
            got = read_chunk_runs(fetcher, meta, index, head, mine)
            if got is None:
                self._headers.pop((block_index, layer), None)
                continue
            runs, nbytes = got
            self._count_read(nbytes)
            return [run for _, run in runs]
        return None
