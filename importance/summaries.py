"""Per-chunk key summaries and query-aware chunk selection under a byte budget.

A block's KV is read in chunks of `chunk_tokens` tokens. When a request brings new
tokens, their queries (post-RoPE, at their true positions) can score each chunk
against a small summary of its keys, read before the chunks themselves, and only
the chunks that the queries would attend to most are read. Budgets are in bytes:
a summary's own bytes count against the budget.

Summaries (all per KV head, keys only, sizes relative to the chunk's K+V in fp16):

| summary | stored per chunk | estimate of a chunk's logit |
| --- | --- | --- |
| `minmax` (Quest) | per-channel min and max key | upper bound of q.k, + log(size) |
| `mean` | mean key | q.mean, + log(size) |
| `lowbitN` | every key, N-bit per channel (scale/offset per block) | logsumexp of q.k_hat |
| `exact` | every key (reference: half the bytes) | logsumexp of q.k |
| `probeN` | `lowbitN` of one KV head a layer (widest keys) | logsumexp of q.k_hat, its queries only |

No torch here: the engine (or a benchmark) hands queries and keys over as arrays.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from importance.lowbit import dequantize, quantize

Array = np.ndarray[Any, Any]
#: Bytes of one stored element (fp16 KV and fp16 summary fields).
ELEMENT_BYTES = 2


@dataclass(frozen=True)
class FixedBudget:
    """Deliver at most `fraction` of the prefix's KV bytes (summaries included)."""

    fraction: float


@dataclass(frozen=True)
class AutoBudget:
    """The fewest chunks whose estimated attention mass reaches `coverage`, within fractions."""

    coverage: float = 0.9
    min_fraction: float = 0.1
    max_fraction: float = 0.5


Budget = FixedBudget | AutoBudget


def fixed_budget(fraction: float) -> FixedBudget:
    """A checked fixed budget. Raises ValueError naming the value outside (0, 1]."""
    _check_fraction("budget", fraction)
    return FixedBudget(float(fraction))


def auto_budget(coverage: float = 0.9, min_fraction: float = 0.1, max_fraction: float = 0.5) -> AutoBudget:
    """A checked auto budget. Raises ValueError naming any value outside (0, 1] or min > max."""
    _check_fraction("coverage", coverage)
    _check_fraction("min_fraction", min_fraction)
    _check_fraction("max_fraction", max_fraction)
    if min_fraction > max_fraction:
        raise ValueError(f"min_fraction {min_fraction} is above max_fraction {max_fraction}")
    return AutoBudget(float(coverage), float(min_fraction), float(max_fraction))


def parse_budget(value: str | float) -> Budget:
    """A budget from user input: a fraction in (0, 1], `auto`, or `auto:COVERAGE`."""
    if isinstance(value, str):
        word = value.strip().lower()
        if word == "auto":
            return auto_budget()
        if word.startswith("auto:"):
            return auto_budget(coverage=_number("coverage", word[5:]))
        return fixed_budget(_number("budget", word))
    return fixed_budget(value)


def _number(field: str, text: str) -> float:
    try:
        return float(text)
    except ValueError:
        raise ValueError(f"{field} must be a number in (0, 1] or 'auto', got {text!r}") from None


def _check_fraction(field: str, value: float) -> None:
    if not isinstance(value, int | float) or not 0.0 < float(value) <= 1.0 or math.isnan(value):
        raise ValueError(f"{field} must be in (0, 1], got {value!r}")


@dataclass(frozen=True)
class ChunkLayout:
    """Which tokens share a chunk: slot s of the stored order holds token `order[s]`.

    Chunk c holds slots [c * chunk_tokens, (c + 1) * chunk_tokens).
    """

    order: Array
    chunk_tokens: int

    @classmethod
    def natural(cls, num_tokens: int, chunk_tokens: int) -> ChunkLayout:
        """Chunks of consecutive tokens (prompt order)."""
        return cls(np.arange(num_tokens, dtype=np.int64), chunk_tokens)

    @classmethod
    def by_importance(cls, scores: Array, chunk_tokens: int, block_tokens: int) -> ChunkLayout:
        """The store's layout: inside each block, tokens by descending score (ties in prompt order)."""
        scores = np.asarray(scores, dtype=np.float64)
        parts = []
        for start in range(0, len(scores), block_tokens):
            block = scores[start : start + block_tokens]
            parts.append(start + np.argsort(-block, kind="stable"))
        return cls(np.concatenate(parts).astype(np.int64), chunk_tokens)

    @property
    def num_tokens(self) -> int:
        return len(self.order)

    @property
    def num_chunks(self) -> int:
        return -(-self.num_tokens // self.chunk_tokens)

    @property
    def starts(self) -> Array:
        """First slot of each chunk."""
        return np.arange(0, self.num_tokens, self.chunk_tokens)

    @property
    def sizes(self) -> Array:
        """Tokens in each chunk (the last one may be partial)."""
        return np.diff(np.append(self.starts, self.num_tokens))

    def chunk_of_token(self) -> Array:
        """For each token (prompt order), the chunk holding it."""
        out = np.empty(self.num_tokens, dtype=np.int64)
        out[self.order] = np.arange(self.num_tokens) // self.chunk_tokens
        return out

    def token_mask(self, chosen: Array) -> Array:
        """Boolean (..., num_tokens) mask of the tokens in the chosen chunks (..., num_chunks)."""
        return np.asarray(chosen)[..., self.chunk_of_token()]


@dataclass(frozen=True)
class KeySummary:
    """One summary of a layer's prefix keys, per KV head.

    Attributes:
        kind: `minmax`, `mean`, `lowbitN`, `exact`, or `approx` (keys decoded from a summary).
        layout: the chunks summarised.
        fields: kind-specific arrays, each (kv_heads, head_dim, chunks or slots).
        bytes_fraction: summary bytes / the chunks' K+V bytes (fp16).
    """

    kind: str
    layout: ChunkLayout
    fields: dict[str, Array]
    bytes_fraction: float

    def chunk_logits(self, queries: Array, scale: float) -> Array:
        """Estimated log of each chunk's unnormalised attention, (query_heads, queries, chunks).

        Args:
            queries: (query_heads, queries, head_dim), post-RoPE; query head h reads
                KV head h // (query_heads // kv_heads) (grouped-query attention).
            scale: the attention's softmax scale (head_dim ** -0.5).
        """
        q = np.asarray(queries, dtype=np.float32) * np.float32(scale)
        per_kv = _per_kv_head(q, len(next(iter(self.fields.values()))))
        log_size = np.log(self.layout.sizes.astype(np.float32))
        if self.kind == "minmax":
            # max(q*low, q*high) per channel = q+ * high + q- * low: two matrix products
            high, low = self.fields["max_t"][:, None], self.fields["min_t"][:, None]
            bound = np.maximum(per_kv, 0) @ high + np.minimum(per_kv, 0) @ low
            return _merge_heads(bound + log_size)
        if self.kind == "mean":
            return _merge_heads(per_kv @ self.fields["mean_t"][:, None] + log_size)
        if "probe" in self.fields:  # one KV head summarised: only its group of query heads scores
            head, kv_heads = (int(x) for x in self.fields["probe"])
            per_kv = _per_kv_head(q, kv_heads)[head : head + 1]
        token = per_kv @ self.fields["keys_t"][:, None]  # (kv, group, m, slots in stored order)
        return _merge_heads(_logsumexp_chunks(token, self.layout))


def _per_kv_head(q: Array, kv_heads: int) -> Array:
    """(query_heads, m, d) -> (kv_heads, group, m, d)."""
    heads, m, d = q.shape
    if heads % kv_heads:
        raise ValueError(f"query heads ({heads}) must be a multiple of kv heads ({kv_heads})")
    return q.reshape(kv_heads, heads // kv_heads, m, d)


def _merge_heads(x: Array) -> Array:
    return x.reshape(-1, *x.shape[2:])


def _logsumexp_chunks(token: Array, layout: ChunkLayout) -> Array:
    peak = token.max(axis=-1, keepdims=True)
    summed = np.add.reduceat(np.exp(token - peak), layout.starts, axis=-1)
    return np.log(summed) + peak


def summarize(kind: str, keys: Array, layout: ChunkLayout, group_tokens: int = 256) -> KeySummary:
    """Summarise a layer's prefix keys (kv_heads, tokens, head_dim), tokens in prompt order.

    `group_tokens` is the span sharing one per-channel scale/offset for `lowbitN` (a block).
    """
    stored = np.asarray(keys, dtype=np.float32)[:, layout.order]
    _, n, d = stored.shape
    full_bytes = 2 * n * d * ELEMENT_BYTES  # K and V of every token, per head
    starts = layout.starts
    if kind == "minmax":
        low, high = np.minimum.reduceat(stored, starts, axis=1), np.maximum.reduceat(stored, starts, axis=1)
        fields = {"min_t": _transposed(low), "max_t": _transposed(high)}
        return KeySummary(kind, layout, fields, 2 * len(starts) * d * ELEMENT_BYTES / full_bytes)
    if kind == "mean":
        mean = np.add.reduceat(stored, starts, axis=1) / layout.sizes[None, :, None]
        return KeySummary(
            kind, layout, {"mean_t": _transposed(mean)}, len(starts) * d * ELEMENT_BYTES / full_bytes
        )
    if kind == "exact":
        return KeySummary(kind, layout, {"keys_t": _transposed(stored)}, n * d * ELEMENT_BYTES / full_bytes)
    if kind.startswith("probe") and kind[5:].isdigit() and 1 <= int(kind[5:]) <= 8:
        head = probe_head(stored)
        one = summarize(f"lowbit{kind[5:]}", keys[head : head + 1], layout, group_tokens)
        fields = one.fields | {"probe": np.array([head, stored.shape[0]])}
        return KeySummary(kind, layout, fields, one.bytes_fraction / stored.shape[0])
    if kind.startswith("lowbit") and kind[6:].isdigit() and 1 <= int(kind[6:]) <= 8:
        bits = int(kind[6:])
        groups = -(-n // group_tokens)
        summary_bytes = n * d * bits / 8 + groups * 2 * d * ELEMENT_BYTES
        fields = {"keys_t": _transposed(quantize_keys(stored, bits, group_tokens))}
        return KeySummary(kind, layout, fields, summary_bytes / full_bytes)
    raise ValueError(f"unknown summary kind {kind!r} (minmax, mean, exact, lowbit1..lowbit8, probe1..probe8)")


def probe_head(keys: Array) -> int:
    """The KV head whose keys spread the most (summed per-channel variance over tokens).

    Wider keys give sharper logits: that head's attention moves most with the query, so it
    stands in for the layer when only one head is summarised.
    """
    k = np.asarray(keys, dtype=np.float32)
    return int(np.argmax(k.var(axis=1).sum(axis=-1)))


def key_summary_of(approx_keys: Array, layout: ChunkLayout, bytes_fraction: float) -> KeySummary:
    """A summary from keys already decoded from one (e.g. a store's `lowbit2` records).

    `approx_keys` are (kv_heads, tokens, head_dim) in prompt order; chunks are scored
    like `lowbitN` (logsumexp of q.k_hat over each chunk's tokens).
    """
    stored = np.asarray(approx_keys, dtype=np.float32)[:, layout.order]
    return KeySummary("approx", layout, {"keys_t": _transposed(stored)}, float(bytes_fraction))


def _transposed(per_head: Array) -> Array:
    """(heads, items, dim) -> contiguous (heads, dim, items): the right operand of q @ k^T."""
    return np.ascontiguousarray(per_head.transpose(0, 2, 1), dtype=np.float32)


def quantize_keys(keys: Array, bits: int, group_tokens: int) -> Array:
    """Keys after per-channel uniform quantisation to `bits` (see `importance.lowbit`).

    Returns the dequantised keys: exactly what the store's summaries decode to.
    """
    return dequantize(quantize(keys, bits, group_tokens))


def chunk_mass(logits: Array, kv_heads: int, per_kv_head: bool) -> Array:
    """Estimated share of the prefix's attention held by each chunk.

    Softmax over chunks for each (query head, query), averaged over queries, then
    over the query heads of each KV head (per_kv_head) or of the layer. Returns
    (kv_heads or 1, chunks), rows summing to 1.
    """
    peak = logits.max(axis=-1, keepdims=True)
    p = np.exp(logits - peak)
    p /= p.sum(axis=-1, keepdims=True)
    per_head = p.mean(axis=1)  # (query_heads, chunks)
    if per_kv_head:
        return per_head.reshape(kv_heads, -1, per_head.shape[-1]).mean(axis=1)
    return per_head.mean(axis=0, keepdims=True)


def static_chunk_mass(scores: Array, layout: ChunkLayout) -> Array:
    """Each chunk's share of a static score (e.g. prefill importance), (chunks,)."""
    stored = np.clip(np.asarray(scores, dtype=np.float64), 0.0, None)[layout.order]
    summed = np.add.reduceat(stored, layout.starts)
    total = summed.sum()
    return summed / total if total > 0 else np.full(len(summed), 1.0 / len(summed))
