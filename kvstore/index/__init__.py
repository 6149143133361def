"""Bookkeeping apart from the bytes: the radix index of held blocks, leases, eviction policies."""
