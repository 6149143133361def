"""What the sidecar needs of the store it serves: `PrefixStore` and a few narrow questions.

The servicer, the tenant figures and the metrics talk to this protocol, never to the
insides of `TieredStore` (its tree, index or tiers), so the store can change how it
keeps its books without the server noticing. `TieredStore` implements it.
"""

from __future__ import annotations

from collections.abc import Iterator, Set
from typing import Protocol, runtime_checkable

from importance.lowbit import LowBitKeys
from kvstore.api import LayeredLoad, PrefixStore, Tokens
from kvstore.load.place import Placed
from kvstore.model import ModelSpec
from kvstore.values import DEFAULT_NAMESPACE, Array


class LowBitLayers(LayeredLoad, Protocol):
    """A `LayeredLoad` that can also hand out its summaries undecoded (what the wire carries)."""

    def lowbit_summary(self, layer: int) -> LowBitKeys:
        """Layer `layer`'s summary over the matched prefix, as stored (codes, fp16 offset/step)."""
        ...

    @property
    def pinned_keys(self) -> tuple[bytes, ...]:
        """Keys of the blocks the load keeps pinned until it is closed (empty once closed)."""
        ...


@runtime_checkable
class PlacingStream(Protocol):
    """A load stream that can copy whole blocks straight into an arena (the embedded store's)."""

    def place_into(self, out: Array) -> Iterator[Placed] | None:
        """The rest of the stream copied into `out` (layers, 2, kv_heads, slots, head_dim), each token
        at the slot of its position, one `Placed` per block once it is there and verified; None
        where this load cannot (then read its chunks). See kvstore/load/stream.py."""
        ...


class SidecarStore(PrefixStore, Protocol):
    """A `PrefixStore` that can also answer the server's bookkeeping questions. Thread-safe."""

    def open_layers(
        self, tokens: Tokens, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE
    ) -> LowBitLayers:
        """As `PrefixStore.open_layers`, with summaries the wire can carry undecoded."""
        ...

    def lookup_many(self, token_lists: Array, *, model: ModelSpec, namespace: str = DEFAULT_NAMESPACE) -> int:
        """How many rows of `token_lists` (k, n), from the first, are cached whole, each from the
        root on its own (LookupMany): one index walk for all of them. Reads no data."""
        ...

    @property
    def local_only(self) -> bool:
        """Whether a lookup never leaves the process (no remote tier): cheap enough inline."""
        ...

    def lease_keys(self, lease_id: str) -> tuple[bytes, ...]:
        """The block keys a live lease pins (empty if unknown). Reads only."""
        ...

    def block_bytes(self, key: bytes) -> int:
        """Encoded bytes of a listed block (0 if it is not listed). Reads only."""
        ...

    def namespace_usage(self, namespace_digests: Set[bytes]) -> tuple[int, int]:
        """(blocks, bytes) listed under the namespaces with these digests. O(blocks held)."""
        ...

    def pinnable_bytes(self) -> int | None:
        """The budget pins could exhaust: the disk budget, or memory's in a memory-only store;
        None when it is unbounded (a disk tier without a budget, or only a remote tier)."""
        ...
