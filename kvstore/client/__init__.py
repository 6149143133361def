"""The sidecar's `PrefixStore`: `KVClient` talks to `kvsieve serve` over gRPC (and shared memory).

`from kvstore.client import KVClient` is the public name; the class lives in
`kvstore.client.kvclient`. This facade is the one place it is re-exported.
"""

from kvstore.client.kvclient import KVClient

__all__ = ["KVClient"]
