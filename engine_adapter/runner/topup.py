"""The decode-time top-up: chunks the current token needs, fetched while the answer is decoded.

After a layer-by-layer prefill (engine_adapter/runner/layered.py) each layer holds the chunks
the question chose. At every decode step, in every layer, before that layer's attention
(a forward pre-hook on the attention module), the decode token's query (post-RoPE, true
position) is scored against the layer's key summary as the prefill decoded it (kept,
never read again): each chunk's estimated share of the token's attention over the prefix
(engine_adapter/runner/chunk_mass.py). Missing chunks whose share exceeds `theta` are fetched,
largest share first, while the layer's fetched tokens stay within `cap` of the prefix's
tokens: one `LayeredLoad.read_layer` call per layer and step, for all chunks chosen there.
Their KV (post-RoPE, as stored) is appended to the layer's cache tensors, so the current
token's attention in that layer already sees them, and every later token too. This is
the rule bench/quality/topup.py simulates (docs/importance.md).

Layers then hold different numbers of tokens. The model builds one attention mask from
layer 0's length; the hook gives each layer its own: every cached token visible (the
engine's single-row requests have no padding), the new tokens' causal block as the
model built it. Order in the cache does not matter to attention (keys carry their
positions in their rotation), so appending is exact.

A store error during a top-up (e.g. a chunk that fails its checksum) stops the top-up
for the rest of the answer: the decode goes on with what the cache holds, all of it
verified KV (a read's KV is inserted only whole and checked), and the report says why
(`LayeredReport.topup_error`, printed by `kvsieve generate -v`).
"""

from __future__ import annotations

import contextlib
import math
import time
from collections.abc import Iterator
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from engine_adapter.runner.chunk_mass import chunk_mass
from engine_adapter.runner.device import copy_into_cache
from engine_adapter.runner.layered import LayeredPrefill, LayeredReport, check_slice, layer_queries
from kvstore.api import LayeredLoad
from kvstore.errors import InvalidInputError, KVSieveError
from kvstore.load.buffers import StagingError

Array = np.ndarray[Any, Any]
#: Fetch a missing chunk when the summary gives it more than this share of the current
#: token's attention over the prefix. Through the engine (bench/quality/through_engine.py, budget
#: 0.25, 1,024 tokens; docs/importance.md "Top-up in the engine").
THETA = 0.02
#: The most tokens one layer may fetch during an answer, as a fraction of the prefix's tokens.
CAP = 0.1
#: Tokens per layer a budget keeps back for the top-up: the prefill's choice reads that many
#: fewer, and the top-up never reads past the budget. About what a 16-token answer fetched at
#: 1,024 cached tokens (3.7-4.5 % of the bytes; 0.4 % at 4,096, 0.1 % at 8,192: a fixed count
#: is a share that shrinks as the prefix grows, as the top-up's need does; docs/importance.md).
RESERVE_TOKENS = 40
#: ... and never more than this share of the prefix (a 256-token prefix keeps 10 tokens back).
RESERVE_MAX_FRACTION = 0.04


@dataclass(frozen=True)
class TopUpSettings:
    """When the decode-time top-up fetches a chunk, and how much it may fetch.

    Attributes:
        theta: a missing chunk is fetched when its estimated share of the current token's
            attention over the prefix exceeds this, in [0, 1).
        cap: the most tokens each layer fetches during one answer, as a fraction of the
            prefix's tokens, in [0, 1] (1.0: no limit).
        reserve_tokens: tokens per layer of the budget kept for the top-up (the prefill
            chooses that many fewer; at most `RESERVE_MAX_FRACTION` of the prefix); whatever it
            is, the top-up stops at the budget.
        within_budget: stop at the budget (the default); False lets the top-up read past it,
            up to its cap (to measure the top-up alone).

    Raises:
        InvalidInputError: a value out of range.
    """

    theta: float = THETA
    cap: float = CAP
    reserve_tokens: int = RESERVE_TOKENS
    within_budget: bool = True

    def reserve(self, matched_tokens: int) -> float:
        """The share of a `matched_tokens` prefix's bytes the prefill leaves to the top-up."""
        return min(self.reserve_tokens / matched_tokens, RESERVE_MAX_FRACTION) if matched_tokens > 0 else 0.0

    def __post_init__(self) -> None:
        if not (0.0 <= self.theta < 1.0) or not (0.0 <= self.cap <= 1.0) or self.reserve_tokens < 0:
            raise InvalidInputError(
                f"top-up theta must be in [0, 1), cap in [0, 1] and reserve_tokens >= 0, got theta "
                f"{self.theta}, cap {self.cap}, reserve_tokens {self.reserve_tokens}"
            )


class DecodeTopUp:
    """The top-up of one answer: owns the prefill's open load until `close`.

    Args:
        load: the layered load the prefill read (still open: it pins the blocks).
        prefill: the prefill's result, with its summaries (`keep_summaries=True`).
        settings: theta and cap.
        budget: the fraction of the prefix's bytes the request may read in all (None, or
            `settings.within_budget` False: no limit but the cap). What the prefill left of it
            is one pool for all layers: a layer that needs more chunks than another takes more,
            first come first served, until the pool is spent.
    """

    def __init__(
        self, load: LayeredLoad, prefill: LayeredPrefill, settings: TopUpSettings, budget: float | None = None
    ) -> None:
        if len(prefill.summaries) != len(prefill.cache.layers):
            raise InvalidInputError("the top-up needs every layer's summary (layered_prefill keep_summaries)")
        self.load, self.cache, self.settings = load, prefill.cache, settings
        self.report: LayeredReport = prefill.report
        self.summaries = prefill.summaries
        self.chunk_tokens = int(load.chunk_tokens)
        num_chunks = int(load.matched_tokens) // self.chunk_tokens
        self.cap_tokens = math.floor(settings.cap * int(load.matched_tokens) + 1e-9)
        #: Bytes the top-up may still read (None: no limit but the cap); one chunk of one layer
        #: costs about `chunk_bytes` (a range read adds nothing: the headers were read)
        self.room_bytes = (
            (budget - float(load.read_fraction)) * load.prefix_bytes
            if budget is not None and settings.within_budget
            else None
        )
        kv_bytes = int(load.prefix_bytes) - int(load.summary_bytes)
        layer_tokens = max(1, int(load.matched_tokens) * int(load.num_layers))
        self.chunk_bytes = kv_bytes / layer_tokens * self.chunk_tokens
        self.have: dict[int, Array] = {}
        for layer, chosen in prefill.report.chosen.items():
            self.have[layer] = np.zeros(num_chunks, dtype=bool)
            self.have[layer][np.asarray(chosen, dtype=np.int64)] = True
        self.fetched_tokens = dict.fromkeys(self.have, 0)
        #: Per layer, each top-up's (first cache slot, chunks fetched, ascending): where its KV went.
        self.inserted: dict[int, list[tuple[int, list[int]]]] = {layer: [] for layer in self.have}
        self.active = True
        self._fetched_this_step = False

    # -- decoding -------------------------------------------------------------------

    @contextlib.contextmanager
    def attached(self, model: Any) -> Iterator[None]:
        """The top-up's hooks on every attention module of `model`, removed on exit."""
        handles = [
            layer.self_attn.register_forward_pre_hook(self._before_attention, with_kwargs=True)
            for layer in model.model.layers
        ]
        try:
            yield
        finally:
            for handle in handles:
                handle.remove()

    def _before_attention(
        self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]
    ) -> tuple[tuple[Any, ...], dict[str, Any]] | None:
        layer = int(module.layer_idx)
        hidden = kwargs["hidden_states"]
        new = int(hidden.shape[1])
        if layer == 0:
            self._fetched_this_step = False
        # Only a decode step (one new token) tops up: a multi-token pass would let its
        # earlier tokens see chunks fetched for its last (the engine feeds top-up answers
        # one token at a time).
        if new == 1 and self.active and layer in self.have:
            self._top_up(module, layer, hidden, kwargs["position_embeddings"])
        past = int(self.cache.layers[layer].keys.shape[-2])
        mask = layer_mask(kwargs.get("attention_mask"), past, new)
        if mask is kwargs.get("attention_mask"):
            return None
        return args, {**kwargs, "attention_mask": mask}

    def _top_up(self, module: Any, layer: int, hidden: torch.Tensor, rope: tuple[torch.Tensor, ...]) -> None:
        t0 = time.perf_counter()
        cos, sin = rope
        query = layer_queries(module, hidden, cos, sin)[0]  # (query heads, 1, head_dim)
        shares = chunk_mass(query, self.summaries[layer], self.chunk_tokens, float(module.scaling))
        wanted = self.pick(layer, shares)
        if wanted:
            before = int(self.load.bytes_read)
            try:
                part = self.load.read_layer(layer, wanted)
                check_slice(layer, part, np.asarray(wanted), self.chunk_tokens)
                keys, values = self._on_device(part.kv)
            except (KVSieveError, StagingError) as exc:
                self.active = False  # nothing of this read was inserted; what is in the cache is verified
                self.report.topup_error = f"layer {layer}: {exc}"
                self.report.topup_s += time.perf_counter() - t0
                return
            target = self.cache.layers[layer]
            self.inserted[layer].append((int(target.keys.shape[-2]), wanted))
            target.keys = torch.cat([target.keys, keys], dim=-2)
            target.values = torch.cat([target.values, values], dim=-2)
            self.have[layer][wanted] = True
            self.fetched_tokens[layer] += len(wanted) * self.chunk_tokens
            nbytes = int(self.load.bytes_read) - before
            if self.room_bytes is not None:
                self.room_bytes -= nbytes
            self._count(len(wanted), nbytes)
        self.report.topup_s += time.perf_counter() - t0

    def pick(self, layer: int, shares: Array) -> list[int]:
        """Missing chunks of `layer` over theta, largest share first, within the cap and what is
        left of the budget; ascending."""
        room = (self.cap_tokens - self.fetched_tokens[layer]) // self.chunk_tokens
        if self.room_bytes is not None:
            room = min(room, math.floor(self.room_bytes / self.chunk_bytes + 1e-9))
        if room <= 0:
            return []
        have = self.have[layer]
        order = np.argsort(-shares, kind="stable")
        over = order[shares[order] > self.settings.theta]
        return sorted(int(c) for c in over[~have[over]][:room])

    def _on_device(self, kv: Array) -> tuple[torch.Tensor, torch.Tensor]:
        """A read's KV (2, heads, n, dim) as the cache's dtype and device: (1, heads, n, dim) each."""
        like = self.cache.layers[0].keys
        shape = (1, *kv.shape[1:])
        pair = SimpleNamespace(
            keys=torch.empty(shape, dtype=like.dtype, device=like.device),
            values=torch.empty(shape, dtype=like.dtype, device=like.device),
        )
        copy_into_cache(pair, kv)
        return pair.keys, pair.values

    def _count(self, chunks: int, nbytes: int) -> None:
        report, load = self.report, self.load
        report.topup_chunks += chunks
        report.topup_bytes += nbytes
        if not self._fetched_this_step:
            report.topup_steps += 1
            self._fetched_this_step = True
        report.bytes_read = int(load.bytes_read)
        report.read_fraction = float(load.read_fraction)
        report.delivered_fraction = float(load.delivered_fraction)

    def close(self) -> None:
        """Release the load (its pin) and the summaries. Idempotent."""
        self.active = False
        self.summaries = {}
        self.load.close()


def layer_mask(mask: torch.Tensor | None, past: int, new: int) -> torch.Tensor | None:
    """The model's attention mask fitted to a layer holding `past` cached tokens.

    The model built `mask` (batch, 1, new, past0 + new) from layer 0's length: its last
    `new` columns are the new tokens' causal block. Every cached token is visible to
    every new one (a single row, no padding), whatever the layer holds.
    """
    if mask is None or mask.shape[-1] == past + new:
        return mask
    visible = True if mask.dtype == torch.bool else 0.0
    cached = torch.full((*mask.shape[:-1], past), visible, dtype=mask.dtype, device=mask.device)
    return torch.cat([cached, mask[..., -new:]], dim=-1)


@contextlib.contextmanager
def decoding(model: Any, topup: DecodeTopUp | None) -> Iterator[None]:
    """Decode with `topup`'s hooks attached (nothing without one), and close it after."""
    if topup is None:
        yield
        return
    try:
        with topup.attached(model):
            yield
    finally:
        topup.close()
