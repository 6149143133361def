"""Model description and fingerprint: KV is valid for one model only.

This module is deliberately free of torch: the store validates shapes and dtypes
against a `ModelSpec`, and the engine adapter builds one from a real model.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass
from functools import cached_property
from typing import Any

import numpy as np

from kvstore.errors import InvalidInputError

#: dtype names accepted for KV, with their ids in the chunk header.
DTYPE_IDS: dict[str, int] = {"float16": 1, "bfloat16": 2, "float32": 3}


def numpy_dtype(name: str) -> np.dtype[Any]:
    """The numpy dtype of a KV dtype name (bfloat16 comes from ml_dtypes)."""
    if name == "bfloat16":
        import ml_dtypes

        return np.dtype(ml_dtypes.bfloat16)
    if name not in DTYPE_IDS:
        raise InvalidInputError(f"dtype must be one of {sorted(DTYPE_IDS)}, got {name!r}")
    return np.dtype(name)


@dataclass(frozen=True)
class ModelSpec:
    """What makes KV of one model differ from another's.

    Attributes:
        name: human-readable model name, e.g. "SmolLM2-135M-Instruct".
        num_layers: transformer layers holding KV.
        num_kv_heads: key/value heads per layer (after GQA grouping).
        head_dim: size of one head.
        dtype: "float16", "bfloat16" or "float32": the dtype KV is stored in.
        rope: rope settings as a canonical string, e.g. "theta=100000".
        weights_digest: hex digest of the weights (blank only in synthetic tests).
        tokenizer_digest: hex digest of the tokenizer vocabulary and merges.
    """

    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "float16"
    rope: str = ""
    weights_digest: str = ""
    tokenizer_digest: str = ""

    def __post_init__(self) -> None:
        for field in ("num_layers", "num_kv_heads", "head_dim"):
            value = getattr(self, field)
            if not isinstance(value, int) or not 1 <= value <= 65535:
                raise InvalidInputError(f"ModelSpec.{field} must be an int in [1, 65535], got {value!r}")
        if self.dtype not in DTYPE_IDS:
            raise InvalidInputError(f"ModelSpec.dtype must be one of {sorted(DTYPE_IDS)}, got {self.dtype!r}")
        if not self.name:
            raise InvalidInputError("ModelSpec.name must not be empty")

    @property
    def itemsize(self) -> int:
        """Bytes per KV element."""
        return 4 if self.dtype == "float32" else 2

    @property
    def token_bytes(self) -> int:
        """Bytes of K and V of one token over all layers (SmolLM2-135M fp16: 23,040)."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.itemsize

    @property
    def np_dtype(self) -> np.dtype[Any]:
        """numpy dtype of this model's KV."""
        return numpy_dtype(self.dtype)

    @cached_property
    def fingerprint(self) -> bytes:
        """16-byte blake2b digest of the canonical JSON of every field (see docs/keys.md)."""
        canonical = json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))
        return hashlib.blake2b(canonical.encode(), digest_size=16, person=b"kvsieve-model").digest()

    def kv_shape(self, num_tokens: int) -> tuple[int, int, int, int, int]:
        """Shape of KV for `num_tokens` tokens: (layers, 2 for K/V, kv heads, tokens, head dim)."""
        return (self.num_layers, 2, self.num_kv_heads, num_tokens, self.head_dim)

    def to_json(self) -> str:
        """Canonical JSON of the spec (what travels in requests and in block metadata)."""
        return json.dumps(asdict(self), sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> ModelSpec:
        """Inverse of `to_json`; raises `InvalidInputError` on unknown or missing fields."""
        try:
            return cls(**json.loads(text))
        except (TypeError, json.JSONDecodeError) as exc:
            raise InvalidInputError(f"model spec is not valid JSON of ModelSpec: {exc}") from exc
