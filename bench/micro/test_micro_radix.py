"""Radix index: match, insert and evict in trees of 100, 10k and 100k blocks.

Each tree holds prompts of 10 blocks of 256 tokens; it is built once per size
(module scope). Insert and evict keep the tree at its size: the setup of each round
(not timed) undoes the previous round.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

import numpy as np
import pytest

from radix import RadixTree

BLOCK_TOKENS = 256
CHAIN_BLOCKS = 10
BLOCK_BYTES = 256 * 23_040
ROOT = "micro"
_BASE = np.random.default_rng(0).integers(0, 49_152, BLOCK_TOKENS).astype(np.uint32)


class Built(NamedTuple):
    """A tree of `num_blocks` blocks in chains of CHAIN_BLOCKS."""

    tree: RadixTree
    num_blocks: int

    @property
    def num_chains(self) -> int:
        """Prompts in the tree."""
        return self.num_blocks // CHAIN_BLOCKS


def block(chain: int, depth: int) -> np.ndarray[Any, Any]:
    """Tokens of block `depth` of prompt `chain`: distinct for every (chain, depth)."""
    tokens = _BASE.copy()
    tokens[0], tokens[1] = chain, depth
    return tokens


def key(chain: int, depth: int) -> bytes:
    """A unique 16-byte block key (the tree does not care how keys are made)."""
    return struct.pack("<QQ", chain, depth)


def prompt(chain: int) -> np.ndarray[Any, Any]:
    """All tokens of prompt `chain`."""
    return np.concatenate([block(chain, d) for d in range(CHAIN_BLOCKS)])


@pytest.fixture(scope="module", params=[100, 10_000, 100_000], ids=["100", "10k", "100k"])
def built(request: pytest.FixtureRequest) -> Built:
    tree = RadixTree(BLOCK_TOKENS)
    for chain in range(request.param // CHAIN_BLOCKS):
        for depth in range(CHAIN_BLOCKS):
            parent = key(chain, depth - 1) if depth else None
            tree.insert(ROOT, parent, block(chain, depth), key(chain, depth), BLOCK_BYTES)
    assert tree.num_blocks == request.param
    return Built(tree, request.param)


def test_match(benchmark: Any, built: Built) -> None:
    tokens = prompt(built.num_chains // 2)
    result = benchmark(built.tree.match, ROOT, tokens)
    assert result.num_tokens == CHAIN_BLOCKS * BLOCK_TOKENS


def test_insert(benchmark: Any, built: Built) -> None:
    """One new leaf block at the end of a prompt (removed again before the next round)."""
    chain = built.num_chains // 2
    parent, new = key(chain, CHAIN_BLOCKS - 1), key(chain, CHAIN_BLOCKS)
    tokens = block(chain, CHAIN_BLOCKS)

    def insert() -> None:
        built.tree.insert(ROOT, parent, tokens, new, BLOCK_BYTES)

    def remove() -> None:  # returns nothing: pedantic would take a result for arguments
        built.tree.remove(new)

    benchmark.pedantic(insert, setup=remove, rounds=2000, warmup_rounds=10)
    assert built.tree.get(new) is not None
    built.tree.remove(new)
    assert built.tree.num_blocks == built.num_blocks


def test_evict(benchmark: Any, built: Built) -> None:
    """Evict the least recently used block (put back before the next round)."""
    tree = built.tree
    evicted: list[Any] = []

    def put_back() -> None:
        while evicted:
            node = evicted.pop()
            parent = node.parent.key if node.parent is not None else None
            tree.insert(ROOT, parent, np.frombuffer(node.edge, dtype="<u4"), node.key, node.nbytes)

    def evict() -> None:
        evicted.extend(tree.evict(BLOCK_BYTES))

    rounds = {100: 2000, 10_000: 200, 100_000: 20}[built.num_blocks]
    benchmark.pedantic(evict, setup=put_back, rounds=rounds, warmup_rounds=1)
    assert len(evicted) == 1
    put_back()
    assert tree.num_blocks == built.num_blocks
