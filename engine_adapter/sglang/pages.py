"""How one SGLang page becomes one kvsieve block, and how it is checked on the way back.

kvsieve's store is keyed by token content (a radix tree of `block_tokens`-token
blocks); SGLang names a page by an opaque hash string and may ask for any page
alone (`get`, `exists`), without the pages before it. So each page is stored as
its own root-level block:

- **Tokens.** `PageFormat.tokens(key)` derives `tokens_per_page` synthetic token ids
  from the key (its 128-bit blake2b digest, extended): the block key that kvsieve
  computes from them is then a function of SGLang's key, of the namespace and of
  the spec below.
- **Spec.** `PageFormat.spec` is a synthetic `ModelSpec` whose name and rope string
  carry the deployment's identity (model, KV dtype, page size, TP and PP rank and
  size, MLA flag, page geometry) and whose geometry is a float16 "carrier" just
  big enough for the page bytes plus a trailer. kvsieve includes the spec's
  fingerprint in every block key, so two deployments never read each other's pages.
- **Bytes.** The page's bytes, in a canonical order that does not depend on the
  host pool's layout (`hostpool.py`), then zero padding, then a 48-byte trailer at
  the carrier's end: magic, version, page bytes, blake2b of the SGLang key and
  xxh3-128 of the page bytes. kvsieve checksums each stored chunk itself; the
  trailer adds an end-to-end check (through shared memory and gRPC) that the bytes
  are this key's page and complete. A page whose trailer does not match is a miss.

The carrier is float16 only as a container: kvsieve never does arithmetic on KV
without scores, so any bit pattern (NaN included) comes back as it went.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Any

import numpy as np
import xxhash

from kvstore.model import ModelSpec

Array = np.ndarray[Any, Any]

_MAGIC = b"KVSGPAGE"
_VERSION = 1
# magic, version, reserved, page bytes, blake2b-128 of the key, xxh3-128 of the page
_TRAILER = struct.Struct("<8sIIQ16s16s")
TRAILER_BYTES = _TRAILER.size
_CARRIER_ITEM = 2  # float16
_MAX_HEAD_DIM = 65535  # ModelSpec's bound on head_dim


@dataclass(frozen=True)
class PageIdentity:
    """What must match for two SGLang processes to share a page.

    Attributes:
        model: SGLang's model name (served model or path).
        kv_dtype: the host pool's dtype, e.g. "bfloat16".
        page_size: tokens per SGLang page.
        tp_rank, tp_size, pp_rank, pp_size: the process's shard of the model.
        is_mla: MLA latent KV (one buffer) instead of separate K and V.
        geometry: the page's canonical shape, e.g. "2x64x30x3x64" (see hostpool.py), or
            "raw" for tensors handed to `set`/`get` without a host pool.
    """

    model: str
    kv_dtype: str
    page_size: int
    tp_rank: int
    tp_size: int
    pp_rank: int
    pp_size: int
    is_mla: bool
    geometry: str

    def describe(self) -> str:
        """One canonical line naming every field (what the spec's fingerprint covers)."""
        return (
            f"kv_dtype={self.kv_dtype};page_size={self.page_size};tp={self.tp_rank}/{self.tp_size};"
            f"pp={self.pp_rank}/{self.pp_size};mla={int(self.is_mla)};geometry={self.geometry};format=v{_VERSION}"
        )


@dataclass(frozen=True)
class PageFormat:
    """The carrier of pages of `page_bytes` bytes, in blocks of `tokens_per_page` tokens.

    Args:
        identity: whose pages these are.
        page_bytes: bytes of one page (canonical order).
        tokens_per_page: synthetic tokens per page; a multiple of the sidecar's
            block_tokens (256 by default), or the sidecar stores nothing.
    """

    identity: PageIdentity
    page_bytes: int
    tokens_per_page: int = 256

    def __post_init__(self) -> None:
        if self.page_bytes <= 0:
            raise ValueError(f"page_bytes must be positive, got {self.page_bytes}")
        if self.tokens_per_page < 4:  # the first 4 tokens carry the key's 128-bit digest
            raise ValueError(f"tokens_per_page must be at least 4, got {self.tokens_per_page}")

    @cached_property
    def spec(self) -> ModelSpec:
        """The synthetic model whose KV of `tokens_per_page` tokens holds one page and its trailer."""
        # Elements per token per K or V half, in float16 units, split over "layers" so that
        # no dimension exceeds ModelSpec's bound.
        needed = self.page_bytes + TRAILER_BYTES
        per_token = -(-needed // (self.tokens_per_page * 2 * _CARRIER_ITEM))
        layers = -(-per_token // _MAX_HEAD_DIM)
        head_dim = -(-per_token // layers)
        return ModelSpec(
            name=f"sglang-page:{self.identity.model}",
            num_layers=layers,
            num_kv_heads=1,
            head_dim=head_dim,
            dtype="float16",
            rope=self.identity.describe(),
        )

    @property
    def carrier_bytes(self) -> int:
        """Bytes of one page's carrier (page, padding, trailer)."""
        return self.spec.token_bytes * self.tokens_per_page

    def new_carrier(self) -> Array:
        """A zeroed carrier of the spec's KV shape (float16)."""
        return np.zeros(self.spec.kv_shape(self.tokens_per_page), np.float16)

    def seal(self, key: str, carrier: Array) -> None:
        """Write the trailer of `key` over the carrier whose first `page_bytes` hold the page. Mutates."""
        raw = carrier.reshape(-1).view(np.uint8)
        raw[-TRAILER_BYTES:] = np.frombuffer(self._trailer(key, raw[: self.page_bytes]), np.uint8)

    def check(self, key: str, carrier: Array) -> bool:
        """Whether `carrier` holds `key`'s page, complete and intact (reads only)."""
        raw = np.ascontiguousarray(carrier).reshape(-1).view(np.uint8)
        if raw.nbytes != self.carrier_bytes:
            return False
        return bytes(raw[-TRAILER_BYTES:]) == self._trailer(key, raw[: self.page_bytes])

    def page_view(self, carrier: Array) -> Array:
        """The page's bytes inside a carrier (a uint8 view, no copy)."""
        return carrier.reshape(-1).view(np.uint8)[: self.page_bytes]

    def tokens(self, key: str) -> Array:
        """The synthetic token ids that stand for `key` (uint32, `tokens_per_page` of them)."""
        return self.tokens_of([key])[0]

    def tokens_of(self, keys: Sequence[str]) -> Array:
        """`tokens` of each key, as one (len(keys), tokens_per_page) uint32 array.

        The first four tokens are the key's 128-bit blake2b digest itself, so two keys
        with different digests never share a token list; the rest extend it (splitmix64),
        vectorised over all keys: a batch of 128 keys costs about 0.1 ms, not one hash each.
        """
        digests = b"".join(
            hashlib.blake2b(k.encode(), digest_size=16, person=b"kvsieve-page").digest() for k in keys
        )
        seeds = np.frombuffer(digests, "<u8").reshape(len(keys), 2)
        pairs = -(-self.tokens_per_page // 2)
        counter = np.arange(pairs, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
        z = (seeds[:, :1] ^ (seeds[:, 1:] * np.uint64(0xD1B54A32D192ED03))) + counter
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        z ^= z >> np.uint64(31)
        z[:, :2] = seeds
        return z.astype("<u8").view("<u4").reshape(len(keys), -1)[:, : self.tokens_per_page].astype(np.uint32)

    def _trailer(self, key: str, page: Array) -> bytes:
        key_digest = hashlib.blake2b(key.encode(), digest_size=16).digest()
        return _TRAILER.pack(
            _MAGIC, _VERSION, 0, self.page_bytes, key_digest, xxhash.xxh3_128_digest(page.data)
        )
