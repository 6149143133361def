"""kvsieve's tiered KV store.

`import kvstore` stays light: lmdb, redis, grpc and torch are imported only by the
modules that need them, when they are first used.
"""

from kvstore.config import StoreConfig
from kvstore.errors import (
    ChecksumError,
    InvalidInputError,
    KVSieveError,
    NotFoundError,
    StoreFullError,
)
from kvstore.model import ModelSpec

__all__ = [
    "ChecksumError",
    "InvalidInputError",
    "KVSieveError",
    "ModelSpec",
    "NotFoundError",
    "StoreConfig",
    "StoreFullError",
]
