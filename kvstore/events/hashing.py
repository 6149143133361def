"""Router block hashes: the store's blocks cut into the router's smaller blocks, chained.

Routers index KV in blocks of their engine's size (16 tokens for vLLM by default), while a
kvsieve block holds `block_tokens` (256 by default). One stored block is therefore published as
`block_tokens / router_tokens` router blocks, each with a 64-bit hash that names the whole
prefix up to its end (routers match prefixes by following `parent_block_hash`):

- the last router block of a stored block is named by the stored block's key (its first 8
  bytes, big-endian): the key already chains the parent's key, the tokens, the model
  fingerprint and the namespace (kvstore/keys.py), so a child's first `parent_block_hash` is
  its parent's key, with no lookup;
- the others chain from the parent's name (or, at depth 0, from a hash of the namespace and
  model): `h[j] = xxh3_64(tokens[j*r:(j+1)*r] as uint32 little-endian, seed=h[j-1])`.

So two namespaces, or two models, never share a router hash even for equal tokens, while two
stored blocks that share a parent and their first tokens share those router blocks (as a
router's own hashes would): the publisher counts holders and removes a router block only when
its last holder leaves (kvstore/events/view.py). The hashes
are kvsieve's own (a router matches on the token ids it is sent, not on these numbers); they
are stable across restarts and processes, which is what a router needs to apply removals.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import xxhash

from kvstore.format.block_meta import BlockMeta
from kvstore.keys import namespace_digest
from kvstore.values import DEFAULT_NAMESPACE

# Dynamo reads a cache salt from the first block's extra keys when it carries this prefix (the
# form Dynamo's frontend passes to vLLM as `cache_salt`, which vLLM then publishes as is).
SALT_PREFIX = "dynamo-cache-salt:"
DEFAULT_NAMESPACE_DIGEST = namespace_digest(DEFAULT_NAMESPACE)
_U32_LE = np.dtype("<u4")
_ROOT_HASHES: dict[bytes, int] = {}  # namespace digest + model fingerprint -> root_hash
_SLICES: dict[tuple[int, int], list[slice]] = {}  # (block bytes, router block bytes) -> ranges


def key_hash(key: bytes) -> int:
    """The router hash that ends a stored block with this key (its first 8 bytes)."""
    return int.from_bytes(key[:8], "big")


def router_hashes(meta: BlockMeta, router_tokens: int) -> list[int]:
    """The hashes of the `len(meta.tokens) // router_tokens` router blocks of one stored block."""
    # This runs for every stored block on the publisher's thread, holding the GIL the storing
    # threads want: kvsieve's tokens are uint32 already (kvstore/keys.py), so one copy of 1 KB,
    # then slices of bytes, is the cheapest way found to feed xxh3 from Python.
    tokens = meta.tokens
    data = (tokens if tokens.dtype == _U32_LE else np.ascontiguousarray(tokens, dtype="<u4")).tobytes()
    step = 4 * router_tokens  # bytes of one router block
    previous = parent_hash(meta)
    if previous is None:
        previous = root_hash(meta.namespace, meta.fingerprint)
    digest = xxhash.xxh3_64_intdigest
    # one comprehension over slices made once: the fewest bytecodes per router block
    hashes = [previous := digest(data[part], previous) for part in _router_slices(len(data), step)]
    hashes.append(int.from_bytes(meta.key[:8], "big"))
    return hashes


def _router_slices(nbytes: int, step: int) -> list[slice]:
    """The byte ranges of a stored block's router blocks, all but the last (named by the key)."""
    slices = _SLICES.get((nbytes, step))
    if slices is None:
        slices = [slice(start, start + step) for start in range(0, nbytes - step, step)]
        _SLICES[(nbytes, step)] = slices
    return slices


def root_hash(namespace: bytes, fingerprint: bytes) -> int:
    """The seed of a prefix's first router block: a hash of its namespace and model (kept: a
    store holds few of them)."""
    ident = namespace + fingerprint
    seed = _ROOT_HASHES.get(ident)
    if seed is None:
        if len(_ROOT_HASHES) >= 1024:  # bounded: a store with very many namespaces recomputes
            _ROOT_HASHES.clear()
        seed = _ROOT_HASHES[ident] = xxhash.xxh3_64_intdigest(ident)
    return seed


def parent_hash(meta: BlockMeta) -> int | None:
    """The router hash of the block before this one (None at the start of a prefix)."""
    return None if meta.depth == 0 else key_hash(meta.parent)


def router_salt(namespace_digest_bytes: bytes) -> str | None:
    """The cache salt a router must be given to see a namespace's blocks (None: the default
    namespace, seen without a salt). It is the namespace's digest in hex, never its name."""
    if namespace_digest_bytes == DEFAULT_NAMESPACE_DIGEST:
        return None
    return namespace_digest_bytes.hex()


def namespace_salt(namespace: str) -> str | None:
    """`router_salt` of a namespace by name: what a router passes as `cache_salt`."""
    return router_salt(namespace_digest(namespace))


def extra_keys(meta: BlockMeta, count: int) -> list[tuple[Any, ...] | None] | None:
    """The extra keys of a stored block's router blocks: the namespace's salt on the first one.

    vLLM puts a request's cache salt on the first block of the request only; kvsieve publishes
    one event per stored block and repeats the salt on each event's first block, because Dynamo
    1.6 reads an event's salt from its own first block (later releases also take it from the
    parent, which the repeated salt agrees with)."""
    salt = router_salt(meta.namespace)
    if salt is None:
        return None
    return [(SALT_PREFIX + salt,), *([None] * (count - 1))]
