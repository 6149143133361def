"""The embedded `PrefixStore`: `TieredStore` over memory, disk and remote tiers, and its writer.

`from kvstore.store import TieredStore` is the public name; the class lives in
`kvstore.store.tiered`. This facade is the one place it is re-exported.
"""

from kvstore.store.tiered import TieredStore

__all__ = ["TieredStore"]
