"""Conversions between protobuf messages and domain types.

The one place that knows both worlds: the servicer and the client call these and
nothing else touches message fields by hand. Errors map to status codes in
kvstore/rpc/status.py.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from kvstore._generated.kvsieve.v1 import kvsieve_pb2 as pb
from kvstore.budget import AUTO, AutoBudget, Budget
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec
from kvstore.stats import StoreStats, TierUsage

Array = np.ndarray[Any, Any]


def model_to_pb(model: ModelSpec) -> pb.ModelSpec:
    """ModelSpec -> message."""
    return pb.ModelSpec(
        name=model.name, num_layers=model.num_layers, num_kv_heads=model.num_kv_heads,
        head_dim=model.head_dim, dtype=model.dtype, rope=model.rope,
        weights_digest=model.weights_digest, tokenizer_digest=model.tokenizer_digest,
    )  # fmt: skip


def model_from_pb(msg: pb.ModelSpec) -> ModelSpec:
    """Message -> ModelSpec; InvalidInputError names a bad field.

    Specs are cached by their bytes: a client names the same model in every call,
    and a cached spec keeps its computed fingerprint."""
    return _model_from_bytes(msg.SerializeToString(deterministic=True))


@functools.lru_cache(maxsize=256)
def _model_from_bytes(data: bytes) -> ModelSpec:
    msg = pb.ModelSpec.FromString(data)
    if not msg.name:
        raise InvalidInputError("ctx.model is required (model.name is empty)")
    return ModelSpec(
        msg.name, msg.num_layers, msg.num_kv_heads, msg.head_dim, msg.dtype or "float16",
        msg.rope, msg.weights_digest, msg.tokenizer_digest,
    )  # fmt: skip


def ctx_to_pb(model: ModelSpec, namespace: str) -> pb.RequestContext:
    """Request context message."""
    return pb.RequestContext(namespace=namespace, model=model_to_pb(model))


def ctx_from_pb(msg: pb.RequestContext) -> tuple[ModelSpec, str]:
    """(model, namespace) of a request; the empty namespace is "default"."""
    return model_from_pb(msg.model), msg.namespace or "default"


def tokens_from_pb(tokens: Any) -> Array:
    """Repeated uint32 -> uint32 array (protobuf already guarantees the range)."""
    return np.fromiter(tokens, dtype=np.uint32, count=len(tokens))


def kv_bytes(kv: Array) -> bytes:
    """Layer-major little-endian bytes of a KV array."""
    return np.ascontiguousarray(kv).tobytes()


def kv_from_bytes(data: bytes | memoryview, model: ModelSpec, num_tokens: int, field: str) -> Array:
    """Bytes of `num_tokens` tokens -> KV array; InvalidInputError on a size mismatch."""
    expected = num_tokens * model.token_bytes
    if len(data) != expected:
        raise InvalidInputError(f"{field}: {len(data)} bytes for {num_tokens} tokens, expected {expected}")
    return np.frombuffer(data, dtype=model.np_dtype).reshape(model.kv_shape(num_tokens))


def stats_to_pb(stats: StoreStats) -> pb.StatsResponse:
    """StoreStats -> message."""
    tiers = [
        pb.TierUsage(name=name, used_bytes=u.used_bytes, capacity_bytes=u.capacity_bytes or 0,
                     num_blocks=u.num_blocks, num_chunks=u.num_chunks)
        for name, u in stats.tiers.items()
    ]  # fmt: skip
    return pb.StatsResponse(
        counters=stats.counters, tiers=tiers, num_blocks=stats.num_blocks,
        active_leases=stats.active_leases, read_amplification=stats.read_amplification,
    )  # fmt: skip


def stats_from_pb(msg: pb.StatsResponse) -> StoreStats:
    """Message -> StoreStats."""
    tiers = {
        t.name: TierUsage(t.used_bytes, t.capacity_bytes or None, t.num_blocks, t.num_chunks)
        for t in msg.tiers
    }
    return StoreStats(
        dict(msg.counters), tiers, msg.num_blocks, msg.active_leases, list(msg.read_amplification)
    )


# -- load budgets ------------------------------------------------------------------


def budget_to_fields(budget: float | int | AutoBudget) -> dict[str, Any]:
    """A resolved budget as LoadRequest fields (the client's side of the Load RPC)."""
    if isinstance(budget, AutoBudget):
        return {
            "budget_mode": AUTO,
            "coverage": budget.coverage,
            "min_fraction": budget.min_fraction,
            "max_fraction": budget.max_fraction,
        }
    if isinstance(budget, int):
        return {"budget_tokens": budget}
    return {"budget": budget}


def budget_from_fields(request: Any) -> Budget:
    """The budget a LoadRequest names (0 = default), for `resolve_budget` to check.

    The wire carries float32: each value is read back as its shortest decimal form,
    so 0.1 on the wire is 0.1 here and selects exactly what the embedded store would.
    """
    mode = request.budget_mode
    if not mode:
        return _from_f32(request.budget) or 1.0
    if mode != AUTO:
        raise InvalidInputError(f"budget_mode must be '' or 'auto', got unknown word {mode!r}")
    default = AutoBudget()
    return AutoBudget(
        _from_f32(request.coverage) or default.coverage,
        _from_f32(request.min_fraction) or default.min_fraction,
        _from_f32(request.max_fraction) or default.max_fraction,
    )


def _from_f32(value: float) -> float:
    return float(str(np.float32(value)))
