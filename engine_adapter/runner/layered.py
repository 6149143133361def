"""Prefill that loads the cached prefix layer by layer, each layer's chunks chosen by its queries.

The cache starts with `chunks x chunk_tokens` placeholder tokens per layer (the
same count in every layer, so one attention mask serves all layers). A forward
pre-hook on every attention module runs when that layer's input exists: it
computes the queries (post-RoPE, true positions) of the last `choose_with_last`
new tokens (the question, not the document's uncached tail), scores the prefix's
chunks against the layer's key summary (`LayeredLoad.key_summary`), chooses
(engine_adapter/runner/chunk_mass.py in torch, then importance/query_select.py's
`choose_by_mass`: the choice the quality benchmark simulates, held equal by a test), reads
the chosen chunks of that layer only (`LayeredLoad.read_layer`) and copies them
into the cache in place, before the attention reads it. Every new token is then
computed over the chosen chunks. Cached tokens keep their
true positions (keys are stored post-RoPE); the new tokens get theirs explicitly.

The resulting cache holds different tokens per layer: an approximation of the
prefix, never to be stored. A store error mid-pass propagates (the engine then
recomputes the prompt: no partial KV is used). With `keep_summaries` the decoded key
summaries stay in the result, for the decode-time top-up (engine_adapter/runner/topup.py).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import numpy as np
import torch

from engine_adapter.runner.cache import cache_from, cache_kwargs
from engine_adapter.runner.chunk_mass import chunk_mass, device_keys
from engine_adapter.runner.device import copy_into_cache, read_into_cache
from importance.query_select import choose_by_mass
from kvstore.api import LayeredLoad, LayerSlice
from kvstore.errors import ChecksumError, InvalidInputError
from kvstore.load.layer_by_layer import LocalLayeredLoad

Array = np.ndarray[Any, Any]
#: New tokens whose queries choose the chunks: the last ones (the question and the chat
#: template's closing markers). The new tokens also hold the document's uncached tail
#: (0-255 tokens short of a whole block), whose queries look at the document's own
#: recent context, not at what the question needs; choosing with all of them made answers
#: worse (issue #27). Through the engine (bench/quality/through_engine.py, 12 windows, budget 0.25,
#: docs/importance.md "Choosing with the question"): answer KL 0.255 with every new token,
#: 0.178 / 0.165 / 0.173 with the last 32 / 16 / 8; 16 is the lowest.
CHOOSE_WITH_LAST = 16


@dataclass
class LayeredReport:
    """What a layer-by-layer load delivered (`kvsieve generate -v` prints it).

    Attributes:
        matched_tokens: prefix tokens readable layer by layer.
        chunk_tokens: tokens per chunk.
        chunks_per_layer: chunks read in every layer.
        delivered_fraction: delivered tokens / (matched tokens x layers read).
        read_fraction: bytes read (summaries included) / the prefix's bytes.
        summary_fraction: the summaries' bytes / the prefix's bytes (part of `read_fraction`).
        bytes_read: bytes read, summaries included.
        chosen: per layer, the chunk indices read (sorted).
        new_tokens: tokens computed after the prefix.
        query_tokens: the last new tokens whose queries chose the chunks (<= new_tokens).
        load_s: seconds spent scoring and reading inside the forward pass.
        error: why the load was abandoned (the prompt was recomputed); "" if it was not.
        topup_chunks: chunks fetched during decoding (engine_adapter/runner/topup.py), over all layers;
            their bytes are in `bytes_read` and `read_fraction`, their tokens in `delivered_fraction`.
        topup_bytes: bytes those chunks read.
        topup_steps: decode steps that fetched at least one chunk.
        topup_s: seconds spent scoring, reading and inserting during decoding.
        topup_error: why the top-up stopped (a store error; the answer went on without it).
        speculated_chunks: chunks chosen in layers whose choice was guessed a layer ahead (a load
            that reads from disk guesses layer l+1's chunks from layer l's input and has the disk
            read them while layer l computes: `NextLayerGuess`).
        speculation_hits: of those, the chunks the guess had named.
    """

    matched_tokens: int
    chunk_tokens: int
    chunks_per_layer: int
    delivered_fraction: float = 0.0
    read_fraction: float = 0.0
    summary_fraction: float = 0.0
    bytes_read: int = 0
    chosen: dict[int, Array] = field(default_factory=dict)
    new_tokens: int = 0
    query_tokens: int = 0
    load_s: float = 0.0
    error: str = ""
    topup_chunks: int = 0
    topup_bytes: int = 0
    topup_steps: int = 0
    topup_s: float = 0.0
    topup_error: str = ""
    speculated_chunks: int = 0
    speculation_hits: int = 0

    @property
    def speculation_hit_rate(self) -> float:
        """The share of guessed layers' chosen chunks the guess had named (0.0 if none guessed)."""
        return self.speculation_hits / self.speculated_chunks if self.speculated_chunks else 0.0

    @property
    def topup_fraction(self) -> float:
        """The top-up's bytes / the prefix's bytes (part of `read_fraction`)."""
        return self.topup_bytes * self.read_fraction / self.bytes_read if self.bytes_read else 0.0


class LayeredPrefill(NamedTuple):
    """Logits of the new tokens (1, new, vocab), the cache after them, the load's report, and
    (with `keep_summaries`) each layer's decoded key summary as scored, on the model's device."""

    logits: torch.Tensor
    cache: Any
    report: LayeredReport
    summaries: dict[int, torch.Tensor]


def layer_queries(module: Any, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The attention module's queries after RoPE: (batch, query_heads, tokens, head_dim).

    Same arithmetic as the Llama attention (q_proj, then rotate-half RoPE).
    """
    q = module.q_proj(hidden).view(*hidden.shape[:-1], -1, module.head_dim).transpose(1, 2)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)
    half = q.shape[-1] // 2
    rotated = torch.cat((-q[..., half:], q[..., :half]), dim=-1)
    return q * cos + rotated * sin


def check_choose_with_last(choose_with_last: int | None) -> None:
    """InvalidInputError unless `choose_with_last` is None or at least 1."""
    if choose_with_last is not None and choose_with_last < 1:
        raise InvalidInputError(f"choose_with_last must be >= 1 or None, got {choose_with_last}")


def layered_prefill(
    model: Any,
    load: LayeredLoad,
    new_ids: Sequence[int],
    chunks: int,
    choose_with_last: int | None = CHOOSE_WITH_LAST,
    keep_summaries: bool = False,
    speculate: bool | None = None,
) -> LayeredPrefill:
    """Compute `new_ids` (at positions matched_tokens..) over `chunks` chosen chunks per layer.

    Args:
        model: a Llama-style HF causal LM (attention modules at model.model.layers[i].self_attn).
        load: an open layered load; not closed here.
        new_ids: the tokens after the matched prefix (at least one).
        chunks: chunks to read in every layer, in [1, matched_tokens / chunk_tokens].
        choose_with_last: the last this many new tokens' queries choose (all of them when
            fewer); None = every new token's.
        keep_summaries: keep every layer's decoded summary (`LayeredPrefill.summaries`): the
            decode-time top-up scores with them instead of reading them again.
        speculate: guess each next layer's chunks, for the disk to read ahead (`_guess`).

    Raises:
        InvalidInputError: no new tokens, a prefix not a whole number of chunks, a bad
            count, or `choose_with_last` below 1.
        KVSieveError: from the load (e.g. `ChecksumError`); nothing read may be used.
    """
    n, chunk = int(load.matched_tokens), int(load.chunk_tokens)
    if not new_ids or n <= 0 or n % chunk or not 1 <= chunks <= n // chunk:
        raise InvalidInputError(
            f"layered prefill needs new tokens, a prefix of whole chunks and chunks in "
            f"[1, {n // max(chunk, 1)}]; got {len(new_ids)} new, prefix {n}, chunk {chunk}, chunks {chunks}"
        )
    check_choose_with_last(choose_with_last)
    query_tokens = len(new_ids) if choose_with_last is None else min(choose_with_last, len(new_ids))
    config = model.config
    heads, dim = (
        config.num_key_value_heads,
        getattr(config, "head_dim", None) or (config.hidden_size // config.num_attention_heads),
    )
    dtype, device = next(model.parameters()).dtype, next(model.parameters()).device
    shape = (1, heads, chunks * chunk, dim)
    cache = cache_from(config, [(torch.zeros(shape, dtype=dtype, device=device),
                                 torch.zeros(shape, dtype=dtype, device=device))
                                for _ in range(config.num_hidden_layers)])  # fmt: skip
    filler = _LayerFiller(load, cache, chunks, query_tokens, len(new_ids), keep_summaries)
    filler.guess = _guess(model, load, device.type != "cpu" if speculate is None else speculate)
    handles = [
        layer.self_attn.register_forward_pre_hook(filler, with_kwargs=True) for layer in model.model.layers
    ]
    try:
        out = model(
            input_ids=torch.tensor([list(new_ids)], dtype=torch.long, device=device),
            position_ids=torch.arange(n, n + len(new_ids), device=device).unsqueeze(0),
            **cache_kwargs(model, cache),
        )
    finally:
        for handle in handles:
            handle.remove()
    return LayeredPrefill(out.logits, cache, filler.report(), filler.summaries)


def _guess(model: Any, load: LayeredLoad, speculate: bool) -> NextLayerGuess | None:
    """A `NextLayerGuess` where asked for and the load reads from disk (memory needs no read-ahead).
    By default on a GPU only: a guess costs a layer's scoring again, cheap there, a core's time here."""
    if speculate and isinstance(load, LocalLayeredLoad) and load.reads_from_disk:
        return NextLayerGuess(load, [layer.self_attn for layer in model.model.layers])
    return None


class _LayerFiller:
    """The forward pre-hook: choose, read and install one layer's chunks before its attention."""

    def __init__(
        self, load: LayeredLoad, cache: Any, chunks: int, query_tokens: int, new_tokens: int,
        keep_summaries: bool = False,
    ) -> None:  # fmt: skip
        self.load, self.cache, self.chunks = load, cache, chunks
        self.query_tokens, self.new_tokens = query_tokens, new_tokens
        self.keep_summaries = keep_summaries
        self.chosen: dict[int, Array] = {}
        self.summaries: dict[int, torch.Tensor] = {}
        self.load_s = 0.0
        self._ahead: tuple[int, torch.Tensor] | None = None  # the next layer's summary, read early
        self.guess: NextLayerGuess | None = None  # set by `layered_prefill` for loads from disk

    def __call__(self, module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        t0 = time.perf_counter()
        layer = int(module.layer_idx)
        cos, sin = kwargs["position_embeddings"]
        last = slice(-self.query_tokens, None)  # only the choosing tokens' queries are computed
        hidden = kwargs["hidden_states"][:, last]
        queries = layer_queries(module, hidden, cos[:, last], sin[:, last])[0]
        summary = self._summary(layer, queries.device)
        chunk = int(self.load.chunk_tokens)
        mass = chunk_mass(queries, summary, chunk, float(module.scaling))
        if self.keep_summaries:
            self.summaries[layer] = summary
        chosen = choose_by_mass(mass, int(summary.shape[1]), self.chunks, chunk_tokens=chunk)
        wanted, held = [int(c) for c in chosen], self.cache.layers[layer]
        if isinstance(local := self.load, LocalLayeredLoad):  # one gathered read, chunk-major
            shape = (len(wanted), 2, int(held.keys.shape[1]), chunk, int(held.keys.shape[-1]))
            part = read_into_cache(
                held, lambda out: local.read_chunks(layer, chosen, out=out), shape, local.kv_dtype
            )
            check_slice(layer, part, chosen, chunk, chunk_major=True)
        else:
            part = self.load.read_layer(layer, wanted)
            check_slice(layer, part, chosen, chunk)
            # In place (the mask stays valid); on CUDA through pinned staging on the copy stream.
            copy_into_cache(self.cache.layers[layer], part.kv)
        self.chosen[layer] = chosen
        if self.guess is not None:
            self.guess.score(layer, chosen)
            if layer + 1 < len(self.guess.attentions):
                hidden, cos, sin = hidden, cos[:, last], sin[:, last]
                following = self._summary(layer + 1, queries.device)
                self._ahead = (layer + 1, following)
                self.guess.guess(layer + 1, hidden, cos, sin, following, self.chunks)
        self.load_s += time.perf_counter() - t0

    def _summary(self, layer: int, device: torch.device) -> torch.Tensor:
        """Layer `layer`'s key summaries on `device`: on a GPU unpacked there from their packed codes
        (`device_keys`: one small copy), on the CPU decoded by the load (on its reader thread, ahead:
        a core the prefill's own thread does not need)."""
        if self._ahead is not None and self._ahead[0] == layer:  # read a layer early, to guess with
            return self._ahead[1]
        packed = getattr(self.load, "packed_summary", None)
        if device.type != "cpu" and packed is not None:
            with contextlib.suppress(ValueError, InvalidInputError):  # unlike blocks: the host decodes
                return device_keys(packed(layer), device)
        return torch.from_numpy(self.load.key_summary(layer)).to(device)

    def report(self) -> LayeredReport:
        load = self.load
        return LayeredReport(
            int(load.matched_tokens), int(load.chunk_tokens), self.chunks,
            float(load.delivered_fraction), float(load.read_fraction),
            load.summary_bytes / load.prefix_bytes if load.prefix_bytes else 0.0,
            int(load.bytes_read), dict(self.chosen), self.new_tokens, self.query_tokens, self.load_s,
            speculated_chunks=self.guess.guessed if self.guess else 0,
            speculation_hits=self.guess.hits if self.guess else 0,
        )  # fmt: skip


class NextLayerGuess:
    """Guesses layer l+1's chunks from layer l's attention input and has the disk read them while
    layer l computes; counts how many of the chunks layer l+1 then chose it had named.

    Consecutive layers' inputs are close (the residual stream changes little per layer), so layer
    l+1's query projection of layer l's input approximates its queries (InfiniGen, OSDI 2024,
    speculates the same way). A guess only hints the disk (`LocalLayeredLoad.hint_layer`): layer
    l+1 still chooses by its own queries, and reads what the guess missed then; the answer is the
    same whatever the guess.
    """

    def __init__(self, load: LocalLayeredLoad, attentions: Sequence[Any]) -> None:
        self.load, self.attentions = load, attentions
        self._guesses: dict[int, Array] = {}
        self.guessed = 0  # chunks chosen in layers that had a guess
        self.hits = 0  # of those, named by the guess

    def guess(
        self, layer: int, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, summary: torch.Tensor,
        chunks: int,
    ) -> None:  # fmt: skip
        """Guess layer `layer`'s `chunks` from the layer before's input `hidden` (and its positions'
        `cos`, `sin`) against `summary`, its keys' summary; hint the disk."""
        module = self.attentions[layer]
        queries = layer_queries(module, hidden, cos, sin)[0]
        chunk = int(self.load.chunk_tokens)
        mass = chunk_mass(queries, summary, chunk, float(module.scaling))
        guessed = choose_by_mass(mass, int(summary.shape[1]), chunks, chunk_tokens=chunk)
        self._guesses[layer] = guessed
        self.load.hint_layer(layer, guessed)

    def score(self, layer: int, chosen: Array) -> None:
        """Count how much of layer `layer`'s choice its guess named (nothing if it had none)."""
        guessed = self._guesses.pop(layer, None)
        if guessed is not None:
            self.guessed += len(chosen)
            self.hits += len(np.intersect1d(guessed, chosen, assume_unique=True))


def chunk_positions(chosen: Array, chunk_tokens: int) -> Array:
    """True positions of the tokens of chunks `chosen` (prompt-order chunks), ascending."""
    chosen = np.sort(np.asarray(chosen, dtype=np.int64))
    return (chosen[:, None] * chunk_tokens + np.arange(chunk_tokens)[None, :]).reshape(-1)


def check_slice(
    layer: int, part: LayerSlice, chosen: Array, chunk_tokens: int, chunk_major: bool = False
) -> None:
    """A load that delivers other tokens than the chosen chunks' must not be used. `chunk_major`:
    kv is (chunks, 2, heads, chunk_tokens, dim) (`LocalLayeredLoad.read_chunks`), else (2, heads,
    tokens, dim)."""
    expected = chunk_positions(chosen, chunk_tokens)
    positions = np.asarray(part.positions)
    if positions.shape != expected.shape or not np.array_equal(positions, expected):
        raise ChecksumError(
            f"layer {layer}: the load delivered other positions than chunks {chosen.tolist()}"
        )
    shape = tuple(part.kv.shape)
    delivered = (shape[0] * shape[3], shape[1]) if chunk_major else (shape[2], shape[0])
    if delivered != (len(expected), 2):
        raise ChecksumError(f"layer {layer}: the load delivered KV of shape {part.kv.shape}")
