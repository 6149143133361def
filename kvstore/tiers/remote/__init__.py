"""The shared remote tier: Redis/Valkey (one server or a cluster), its breaker, the write-behind queue.

`link.open_link` is the one entry point a store uses; only it imports redis.
"""
