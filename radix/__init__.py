"""Block-aligned radix tree indexing prefix KV by token content."""

from radix.tree import MatchResult, Node, RadixTree, RootId

__all__ = ["MatchResult", "Node", "RadixTree", "RootId"]
