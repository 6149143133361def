"""The selection methods compared by `kvsieve bench quality`, as choosers for bench.quality.masking.

Every method turns a budget into a keep mask per layer (and per KV head where it
selects per head). Bytes are counted per layer and head: a method delivers
(kept tokens + summary bytes) / the prefix's KV bytes.

- `static`: today's store: the top tokens by prefill importance, one set for all
  layers (the importance layout makes them whole chunks).
- `static_c8` / `static_c8_edges`: the layered store's fallback: 8-token chunks in
  prompt order ranked by their tokens' mean prefill importance, one set for all
  layers (`_edges`: the first and last 16 tokens always).
- `sink_recent`: the first 4 tokens and the most recent ones.
- `snapkv`: per KV head, the tokens the observed queries attend to most, pooled
  over 7 neighbours (needs every key: its scoring bytes are not counted).
- `qa_<summary>`: query-aware chunks from a key summary (importance/summaries.py).
- `oracle`: the same chunk choice from the true attention (needs every key: an
  upper bound of a fixed choice, its scoring bytes not counted).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from bench.quality.masking import Chooser
from importance.query_select import choose_layer_chunks
from importance.selection import choose_chunks, edge_chunks, mix_static, reads_summary
from importance.summaries import (
    Budget,
    ChunkLayout,
    FixedBudget,
    KeySummary,
    chunk_mass,
    static_chunk_mass,
    summarize,
)

Array = np.ndarray[Any, Any]
SINK_TOKENS = 4
SNAPKV_POOL = 7
#: The layered layout's chunk size, and the chunks at each edge `static_c8_edges` forces (16 tokens).
STATIC_CHUNK_TOKENS = 8
STATIC_EDGE_CHUNKS = 2


@dataclass(frozen=True)
class QAConfig:
    """How query-aware selection is done (the variants measured in docs/importance.md).

    Attributes:
        chunk_tokens: tokens per selectable chunk.
        per_kv_head: choose per KV head (else one choice per layer).
        sink_chunks / recent_chunks: chunks always kept at the start / end of the prefix.
        static_weight: share of the static importance mass mixed into the query mass.
        layout: `natural` (consecutive tokens) or `importance` (the store's order per block).
    """

    chunk_tokens: int = 16
    per_kv_head: bool = True
    sink_chunks: int = 1
    recent_chunks: int = 1
    static_weight: float = 0.0
    layout: str = "natural"


@dataclass
class PrefixState:
    """What the methods may use about one prefix: per-layer keys, static scores, summaries."""

    keys: list[Array]  # per layer (kv_heads, tokens, head_dim), post-RoPE, prompt order
    static_scores: Array
    scale: float
    block_tokens: int = 256
    _summaries: dict[tuple[str, int, str], list[KeySummary]] = field(default_factory=dict)

    @property
    def num_tokens(self) -> int:
        return int(self.keys[0].shape[1])

    def layout(self, config: QAConfig) -> ChunkLayout:
        if config.layout == "importance":
            return ChunkLayout.by_importance(self.static_scores, config.chunk_tokens, self.block_tokens)
        return ChunkLayout.natural(self.num_tokens, config.chunk_tokens)

    def summaries(self, kind: str, config: QAConfig) -> list[KeySummary]:
        """The per-layer summaries of `kind` over `config`'s chunks, built once."""
        key = (kind, config.chunk_tokens, config.layout)
        if key not in self._summaries:
            layout = self.layout(config)
            self._summaries[key] = [summarize(kind, k, layout, self.block_tokens) for k in self.keys]
        return self._summaries[key]


def summary_fraction(state: PrefixState, kind: str, config: QAConfig) -> float:
    """Bytes of one layer's summary as a fraction of its K+V bytes."""
    return float(state.summaries(kind, config)[0].bytes_fraction)


def summary_charge(method: str, state: PrefixState, budget: Budget, config: QAConfig) -> float:
    """The fraction of the bytes `method` spends on its summary at `budget` (0: it reads none).

    A `qa_*` method reads no summary at budget 1.0 (it reads everything) nor when the
    summary alone would exceed a fixed budget: then it takes the static order instead.
    """
    if not method.startswith("qa_") or not reads_summary(budget):
        return 0.0
    fraction = summary_fraction(state, method[3:], config)
    if isinstance(budget, FixedBudget) and fraction >= budget.fraction:
        return 0.0
    return fraction


def chooser(method: str, state: PrefixState, budget: Budget, config: QAConfig) -> Chooser:
    """The chooser of `method` at `budget` (`config` shapes `qa_*` and `oracle`)."""
    n = state.num_tokens
    if method in ("static", "static_c8", "static_c8_edges", "sink_recent", "snapkv"):
        if not isinstance(budget, FixedBudget):
            raise ValueError(f"method {method} needs a fixed budget, got {budget!r}")
        k = min(n, int(np.ceil(budget.fraction * n - 1e-9)))
    if method == "static":
        keep = np.zeros((1, n), dtype=bool)
        keep[0, np.argsort(-state.static_scores, kind="stable")[:k]] = True
        return lambda layer, queries: keep
    if method in ("static_c8", "static_c8_edges"):
        keep = static_chunks(state.static_scores, budget, edges=method == "static_c8_edges")
        return lambda layer, queries: keep
    if method == "sink_recent":
        keep = np.zeros((1, n), dtype=bool)
        keep[0, : min(SINK_TOKENS, k)] = True
        keep[0, n - max(0, k - SINK_TOKENS) :] = True
        return lambda layer, queries: keep
    if method == "snapkv":
        return lambda layer, queries: _snapkv(state, layer, queries, k)
    if method == "oracle":
        return lambda layer, queries: _query_aware(
            state, "exact", layer, queries, budget, config, charge=False
        )
    if method.startswith("qa_") and not summary_charge(method, state, budget, config):
        return chooser("static" if reads_summary(budget) else "sink_recent", state, budget, config)
    if method.startswith("qa_"):
        kind = method[3:]
        return lambda layer, queries: _query_aware(state, kind, layer, queries, budget, config, charge=True)
    raise ValueError(f"unknown method {method!r}")


def static_chunks(scores: Array, budget: Budget, edges: bool) -> Array:
    """Keep mask (1, tokens) of the prompt-order 8-token chunks with the highest mean static score.

    Whole chunks only, never more than `budget` (`choose_chunks`); with `edges` the first
    and last 16 tokens are taken first.
    """
    layout = ChunkLayout.natural(len(scores), STATIC_CHUNK_TOKENS)
    mean_score = static_chunk_mass(scores, layout) / layout.sizes  # value per byte: a partial chunk too
    forced = edge_chunks(layout, STATIC_EDGE_CHUNKS, STATIC_EDGE_CHUNKS) if edges else None
    return np.asarray(layout.token_mask(choose_chunks(mean_score, layout, budget, 0.0, forced).chosen))


def _query_aware(
    state: PrefixState, kind: str, layer: int, queries: Array, budget: Budget, config: QAConfig, charge: bool
) -> Array:
    summary = state.summaries(kind, config)[layer]
    layout = summary.layout
    if not reads_summary(budget):
        return np.ones((1, state.num_tokens), dtype=bool)
    cost = summary.bytes_fraction if charge else 0.0
    if _is_shipped_shape(kind, config):  # the engine's own choice (importance/query_select.py)
        approx = np.swapaxes(summary.fields["keys_t"], 1, 2)
        chosen = choose_layer_chunks(
            queries, approx, budget, scale=state.scale, summary_fraction=cost,
            chunk_tokens=config.chunk_tokens, sink_tokens=config.sink_chunks * config.chunk_tokens,
            recent_tokens=config.recent_chunks * config.chunk_tokens,
        )  # fmt: skip
        return layout.token_mask(np.isin(np.arange(layout.num_chunks), chosen))[None]
    kv_heads = state.keys[layer].shape[0]
    mass = chunk_mass(summary.chunk_logits(queries, state.scale), kv_heads, config.per_kv_head)
    if config.static_weight:
        mass = mix_static(mass, static_chunk_mass(state.static_scores, layout), config.static_weight)
    forced = edge_chunks(layout, config.sink_chunks, config.recent_chunks)
    choice = choose_chunks(mass, layout, budget, cost, forced)
    return layout.token_mask(choice.chosen)


def _is_shipped_shape(kind: str, config: QAConfig) -> bool:
    """Low-bit keys, one choice per layer over prompt-order chunks, nothing mixed in."""
    plain = config.layout == "natural" and not config.per_kv_head and not config.static_weight
    return kind.startswith("lowbit") and plain


def _snapkv(state: PrefixState, layer: int, queries: Array, k: int) -> Array:
    keys_t = state.summaries("exact", QAConfig())[layer].fields["keys_t"]  # natural layout: slots = tokens
    kv_heads = keys_t.shape[0]
    q = queries.reshape(kv_heads, -1, *queries.shape[1:]) * state.scale
    logits = q @ keys_t[:, None]
    weights = np.exp(logits - logits.max(axis=-1, keepdims=True))
    weights /= weights.sum(axis=-1, keepdims=True)
    votes = weights.sum(axis=2).mean(axis=1)  # (kv_heads, tokens)
    pad = SNAPKV_POOL // 2
    padded = np.pad(votes, ((0, 0), (pad, pad)), constant_values=-np.inf)
    pooled = np.lib.stride_tricks.sliding_window_view(padded, SNAPKV_POOL, axis=1).max(axis=-1)
    keep = np.zeros(votes.shape, dtype=bool)
    top = np.argsort(-pooled, axis=1, kind="stable")[:, :k]
    np.put_along_axis(keep, top, True, axis=1)
    return keep
