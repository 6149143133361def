"""The local durable tier: LMDB, its data file checks, ranged reads, map resizes, the data dir lock."""
