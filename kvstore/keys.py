"""Block keys: a stable hash chain over token ids, model fingerprint and namespace.

Specified with test vectors in docs/keys.md. blake2b is used rather than a faster
non-cryptographic hash because keys are shared between tenants in the remote tier:
a tenant must not be able to craft a collision with another tenant's prefix.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from kvstore.errors import InvalidInputError

KEY_BYTES = 16
ROOT_KEY = bytes(KEY_BYTES)
#: Where a prefix's blocks hang in the index: (namespace digest, model fingerprint).
Root = tuple[bytes, bytes]
_MAX_TOKEN_ID = 2**32 - 1
_NAMESPACE_MAX_CHARS = 256


class ChunkKey(NamedTuple):
    """The parts of a chunk's storage key (see `chunk_key`)."""

    block_key: bytes
    layout_version: int
    chunk_index: int


def chunk_key(block_key: bytes, layout_version: int, chunk_index: int) -> bytes:
    """Storage key of one chunk: block key, layout version (u32), chunk index (u16), big-endian,
    so that a block's chunks sort together and by layout."""
    return block_key + layout_version.to_bytes(4, "big") + chunk_index.to_bytes(2, "big")


def parse_chunk_key(key: bytes) -> ChunkKey:
    """Inverse of `chunk_key`."""
    return ChunkKey(
        key[:KEY_BYTES],
        int.from_bytes(key[KEY_BYTES : KEY_BYTES + 4], "big"),
        int.from_bytes(key[KEY_BYTES + 4 : KEY_BYTES + 6], "big"),
    )


def namespace_digest(namespace: str) -> bytes:
    """16-byte digest of a namespace name (UTF-8)."""
    validate_namespace(namespace)
    return hashlib.blake2b(namespace.encode(), digest_size=KEY_BYTES, person=b"kvsieve-ns").digest()


def validate_namespace(namespace: str) -> None:
    """Raise `InvalidInputError` unless `namespace` is a non-empty string of <= 256 chars."""
    if not isinstance(namespace, str) or not 0 < len(namespace) <= _NAMESPACE_MAX_CHARS:
        raise InvalidInputError(
            f"namespace must be a non-empty string of at most {_NAMESPACE_MAX_CHARS} characters,"
            f" got {namespace!r}"
        )


def as_token_array(tokens: Sequence[int] | np.ndarray[Any, Any]) -> np.ndarray[Any, Any]:
    """Validate token ids and return them as a 1-D uint32 array.

    Raises:
        InvalidInputError: not a 1-D sequence of integers in [0, 2**32 - 1].
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise InvalidInputError(f"tokens must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return np.zeros(0, dtype=np.uint32)
    if arr.dtype.kind not in "iu":
        raise InvalidInputError(f"tokens must be integers, got dtype {arr.dtype}")
    if int(arr.min()) < 0 or int(arr.max()) > _MAX_TOKEN_ID:
        raise InvalidInputError(f"tokens must be integers in [0, {_MAX_TOKEN_ID}]")
    return arr.astype(np.uint32, copy=False)


def block_key(parent: bytes, block_tokens: np.ndarray[Any, Any], fingerprint: bytes, ns: bytes) -> bytes:
    """Key of one block: blake2b-128(parent || fingerprint || namespace digest || tokens u32le)."""
    h = hashlib.blake2b(digest_size=KEY_BYTES, person=b"kvsieve-block")
    h.update(parent)
    h.update(fingerprint)
    h.update(ns)
    h.update(block_tokens.astype("<u4", copy=False).tobytes())
    return h.digest()


def block_keys(tokens: np.ndarray[Any, Any], block_tokens: int, fingerprint: bytes, ns: bytes) -> list[bytes]:
    """Keys of every full block of `tokens`, in order (a trailing partial block has none)."""
    keys: list[bytes] = []
    parent = ROOT_KEY
    for start in range(0, len(tokens) - block_tokens + 1, block_tokens):
        parent = block_key(parent, tokens[start : start + block_tokens], fingerprint, ns)
        keys.append(parent)
    return keys
