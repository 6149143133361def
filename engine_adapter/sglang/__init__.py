"""kvsieve as SGLang's HiCache storage backend (the L3 tier of SGLang's hierarchical cache).

SGLang loads `engine_adapter.sglang.backend.KvsieveStorage` by
`--hicache-storage-backend dynamic` (docs/sglang.md). This package imports nothing
heavy itself: `backend` imports SGLang and torch, the rest only kvsieve's client.
"""
