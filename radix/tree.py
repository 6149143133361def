"""Block-aligned radix tree over token content.

Every edge is exactly one block of `block_tokens` tokens, so matching and splitting
happen only at block boundaries and a split never cuts a chunk. Compressing chains
of single-child nodes would save nothing here: every block carries its own
metadata (key, bytes, pins, recency) anyway. Children are keyed by the block's raw
token bytes, so a match is exact and costs O(number of blocks) dict probes,
independent of how many prefixes are stored.

No gRPC, torch or model code is imported here; the tree knows nothing of tiers.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections.abc import Hashable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np

RootId = Hashable  # (namespace digest, model fingerprint) in kvstore
# Blocks whose edge bytes one numpy call produces in `match`: one call per block cost
# 7x more than the dict probes (bench/micro/test_micro_radix.py); one call for the
# whole prompt would copy a long prompt that misses at its first block.
_EDGE_WINDOW_BLOCKS = 16


@dataclass(eq=False)
class Node:
    """One block in the tree. Fields are read-only outside the tree.

    Attributes:
        key: caller's identity for the block (kvstore's block key).
        parent: the previous block, or None for a child of a root.
        depth: index of the block in its prefix.
        nbytes: bytes the block occupies (used by `evict`).
        payload: caller's data (kvstore keeps the block metadata here).
        pins: active pins; a pinned node is never evicted.
        access_count: matches that reached this block.
        last_access: logical clock of the last match or insert (larger = more recent).
    """

    key: bytes
    parent: Node | None
    root: RootId
    depth: int
    nbytes: int
    payload: Any = None
    pins: int = 0
    access_count: int = 0
    last_access: int = 0
    children: dict[bytes, Node] = field(default_factory=dict)
    edge: bytes = b""


@dataclass(eq=False)
class Pin:
    """One pin taken by `RadixTree.pin`: the very nodes it pinned, released once by `unpin`."""

    nodes: tuple[Node, ...]
    released: bool = False

    @property
    def keys(self) -> tuple[bytes, ...]:
        """The pinned blocks' keys."""
        return tuple(node.key for node in self.nodes)


class MatchResult(NamedTuple):
    """Result of `RadixTree.match`: the matched blocks in prefix order."""

    num_tokens: int
    nodes: list[Node]


class RadixTree:
    """See module docstring. All methods are thread-safe."""

    def __init__(self, block_tokens: int = 256) -> None:
        if block_tokens < 1:
            raise ValueError(f"block_tokens must be >= 1, got {block_tokens}")
        self.block_tokens = block_tokens
        self._roots: dict[RootId, dict[bytes, Node]] = {}
        self._by_key: dict[bytes, Node] = {}
        # Childless nodes, kept up to date so that `evict` scans leaves, not the whole
        # tree (at 100k blocks in prompts of 10 that is a tenth of the nodes).
        self._leaf_nodes: dict[bytes, Node] = {}
        self._clock = itertools.count(1)
        self._lock = threading.RLock()
        self._bytes = 0

    def match(self, root: RootId, tokens: np.ndarray[Any, Any], touch: bool = True) -> MatchResult:
        """Longest block-aligned cached prefix of `tokens` (uint32 array).

        Mutates access counts and recency of the matched blocks when `touch`.
        """
        nodes: list[Node] = []
        with self._lock:
            children = self._roots.get(root, {})
            for edge in _edges(tokens, self.block_tokens):
                node = children.get(edge)
                if node is None:
                    break
                nodes.append(node)
                children = node.children
            if touch:
                now = next(self._clock)
                for node in nodes:
                    node.access_count += 1
                    node.last_access = now
        return MatchResult(len(nodes) * self.block_tokens, nodes)

    def leading_whole(self, root: RootId, lists: np.ndarray[Any, Any], touch: bool = True) -> int:
        """How many rows of `lists` (k, n), from the first, are held whole, each matched from
        `root` on its own: one lock and one walk for all of them (a batch of pages asked one
        `match` at a time paid a lock, a conversion and a result per page). A row whose length
        is not a multiple of `block_tokens` is never whole. Refreshes the recency of the
        blocks of the rows held whole when `touch`."""
        k, n = lists.shape
        b = self.block_tokens
        if k == 0 or n % b:
            return 0
        width = 4 * b
        data = _edge(lists)  # every row's edges in one conversion
        held: list[Node] = []
        with self._lock:
            top = self._roots.get(root, {})
            for row in range(k):
                children, start = top, row * 4 * n
                for edge_start in range(start, start + 4 * n, width):
                    node = children.get(data[edge_start : edge_start + width])
                    if node is None:
                        break
                    held.append(node)
                    children = node.children
                else:
                    continue
                del held[len(held) - (edge_start - start) // width :]  # the row's partial match
                k = row
                break
            if touch:
                now = next(self._clock)
                for node in held:
                    node.access_count += 1
                    node.last_access = now
        return k

    def insert(
        self,
        root: RootId,
        parent_key: bytes | None,
        block: np.ndarray[Any, Any],
        key: bytes,
        nbytes: int,
        payload: Any = None,
    ) -> Node:
        """Add one block under `parent_key` (None: first block). Mutates.

        Returns the existing node if the block is already there (payload replaced).
        Raises KeyError if the parent is unknown, ValueError if `block` is not one block.
        """
        if len(block) != self.block_tokens:
            raise ValueError(f"a block has {self.block_tokens} tokens, got {len(block)}")
        edge = _edge(block)
        with self._lock:
            parent = self._by_key[parent_key] if parent_key is not None else None
            siblings = parent.children if parent else self._roots.setdefault(root, {})
            node = siblings.get(edge)
            if node is None:
                depth = parent.depth + 1 if parent else 0
                node = Node(key, parent, root, depth, nbytes, payload, edge=edge)
                siblings[edge] = node
                self._by_key[key] = node
                self._leaf_nodes[key] = node
                if parent is not None:
                    self._leaf_nodes.pop(parent.key, None)
                self._bytes += nbytes
            else:
                self._bytes += nbytes - node.nbytes
                node.nbytes, node.payload = nbytes, payload
            node.last_access = next(self._clock)
            return node

    def get(self, key: bytes) -> Node | None:
        """The node of a block key, or None."""
        with self._lock:
            return self._by_key.get(key)

    def pin(self, nodes: Sequence[Node]) -> Pin:
        """Pin exactly these nodes so that `evict` never removes them. Mutates.

        Returns the handle `unpin` takes. A pin belongs to the node objects, not to their
        keys: a block removed and inserted again is a new node, which an older pin never
        touches. KeyError (and nothing pinned) if a node is no longer in the tree.
        """
        with self._lock:
            for node in nodes:
                if self._by_key.get(node.key) is not node:
                    raise KeyError(node.key)
            for node in nodes:
                node.pins += 1
            return Pin(tuple(nodes))

    def unpin(self, pin: Pin) -> None:
        """Release `pin`: one pin of each of its nodes, once (a second call does nothing).
        Mutates. Nodes removed since keep their count; no other node is touched."""
        with self._lock:
            if pin.released:
                return
            pin.released = True
            for node in pin.nodes:
                node.pins -= 1

    def is_pinned(self, key: bytes) -> bool:
        """Whether the block is pinned."""
        node = self._by_key.get(key)
        return node is not None and node.pins > 0

    def evict(self, num_bytes: int) -> list[Node]:
        """Remove least recently used unpinned leaves until `num_bytes` are freed. Mutates.

        A parent becomes a candidate once its last child is gone. Returns the removed
        nodes in eviction order (possibly freeing less than asked if all else is pinned).
        """
        removed: list[Node] = []
        freed = 0
        with self._lock:
            heap = [(n.last_access, n.depth, i, n) for i, n in enumerate(self._leaves())]
            heapq.heapify(heap)
            tiebreak = itertools.count(len(heap))
            while heap and freed < num_bytes:
                _, _, _, node = heapq.heappop(heap)
                self._detach(node)
                removed.append(node)
                freed += node.nbytes
                parent = node.parent
                if parent is not None and not parent.children and parent.pins == 0:
                    heapq.heappush(heap, (parent.last_access, parent.depth, next(tiebreak), parent))
        return removed

    def remove(self, key: bytes) -> list[Node]:
        """Remove a block and every block below it (e.g. corrupt data). Mutates."""
        with self._lock:
            node = self._by_key.get(key)
            if node is None:
                return []
            subtree = list(_walk(node))
            for n in reversed(subtree):
                self._detach(n)
            return subtree

    def nodes(self) -> Iterator[Node]:
        """Every node (a snapshot)."""
        with self._lock:
            return iter(list(self._by_key.values()))

    @property
    def num_blocks(self) -> int:
        """Blocks in the tree."""
        return len(self._by_key)

    @property
    def total_bytes(self) -> int:
        """Sum of `nbytes` over all blocks."""
        return self._bytes

    def _leaves(self) -> Iterator[Node]:
        return (n for n in self._leaf_nodes.values() if n.pins == 0)

    def _detach(self, node: Node) -> None:
        siblings = node.parent.children if node.parent else self._roots.get(node.root, {})
        siblings.pop(node.edge, None)
        if node.parent is None and not siblings:
            self._roots.pop(node.root, None)
        elif node.parent is not None and not siblings and node.parent.key in self._by_key:
            self._leaf_nodes[node.parent.key] = node.parent
        self._by_key.pop(node.key, None)
        self._leaf_nodes.pop(node.key, None)
        self._bytes -= node.nbytes


def _edge(block: np.ndarray[Any, Any]) -> bytes:
    return np.asarray(block, dtype="<u4").tobytes()


def _edges(tokens: np.ndarray[Any, Any], block_tokens: int) -> Iterator[bytes]:
    """Edge bytes of each full block of `tokens`, converted a window of blocks at a time."""
    full = len(tokens) - len(tokens) % block_tokens
    width, window = 4 * block_tokens, _EDGE_WINDOW_BLOCKS * block_tokens
    for lo in range(0, full, window):
        data = _edge(tokens[lo : min(full, lo + window)])
        for start in range(0, len(data), width):
            yield data[start : start + width]


def _walk(node: Node) -> Iterator[Node]:
    yield node
    for child in list(node.children.values()):
        yield from _walk(child)
