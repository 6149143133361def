"""The engine's prefill paths: the prompt computed on top of the prefix KV the store holds.

Two paths, chosen by `Engine` (engine_adapter/runner/engine.py): the prefix loaded in one call
(`prefill_static`), or layer by layer, each layer's chunks chosen by the new tokens'
queries (`prefill_layered`, engine_adapter/runner/layered.py). Either falls back to computing
the whole prompt (`recompute`) when its load or its copy to the device fails. The
static path stores the new full blocks with their prefill scores and reports how the
new tokens attended to the prefix.

The paths read the engine through `PrefillEngine`, the handful of its attributes they
need, and record their loads there (`last_load`, `last_layered`) for `generate -v`.
"""

from __future__ import annotations

import contextlib
import functools
import time
import warnings
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any, NamedTuple, Protocol

import numpy as np
import torch

from engine_adapter.runner.attention import AttentionStats
from engine_adapter.runner.cache import cache_from, cache_kwargs
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.device import KVTransfer, LayerUpload
from engine_adapter.runner.layered import LayeredReport, layered_prefill
from engine_adapter.runner.layered_policy import plan_layered
from engine_adapter.runner.model import LoadedModel
from engine_adapter.runner.saver import piece_ranges
from engine_adapter.runner.topup import DecodeTopUp, TopUpSettings
from engine_adapter.runner.upload import PackUpload
from kvstore.api import LoadStream, PrefixStore
from kvstore.budget import Budget
from kvstore.errors import KVSieveError
from kvstore.load.buffers import StagingError
from kvstore.load.device import PendingDownload, as_array, as_tensor, torch_dtype
from kvstore.load.read_packed import PackView
from kvstore.load.stream import LocalLoadStream


@dataclass
class Timings:
    """Seconds spent in each phase of one request."""

    lookup_s: float = 0.0
    load_s: float = 0.0
    prefill_s: float = 0.0
    decode_s: float = 0.0
    #: After the logits, storing the new blocks and reporting scores in line (the rest goes behind):
    #: what every plan of a request pays alike, left out of what the cost model files for its plan.
    store_s: float = 0.0


@dataclass
class Prefill:
    """State after the prompt: the cache, the logits of its last token, and what was reused."""

    cache: Any
    logits: torch.Tensor
    next_position: int
    matched_tokens: int = 0
    loaded_tokens: int = 0
    computed_tokens: int = 0
    stored_blocks: int = 0
    timings: Timings = field(default_factory=Timings)
    #: Completes the store of the new blocks (their KV on its way off the device):
    #: `Engine.finish_store` calls it once the answer is decoded.
    pending_store: Callable[[], int] | None = None
    #: The decode-time top-up of a layer-by-layer prefill (engine_adapter/runner/topup.py), holding its load.
    topup: DecodeTopUp | None = None


class Loaded(NamedTuple):
    """A prefix loaded for prefill: its tokens' positions, the cache, the prefix length covered,
    and its copy to the device (None when the cache already holds it)."""

    positions: Any
    cache: Any
    covered: int
    upload: LayerUpload | PackUpload | None = None


class PrefillEngine(Protocol):
    """What the prefill paths read from the engine (`Engine`'s attributes of these names),
    and the two they write: the load each prefill made, for `generate -v` and the benchmarks."""

    lm: LoadedModel
    store: PrefixStore | None
    namespace: str
    collect_stats: bool
    choose_with_last: int | None
    transfer: KVTransfer
    topup: TopUpSettings | None
    costs: CostModel
    last_load: LoadStream | None
    last_layered: LayeredReport | None


def prefill_static(
    engine: PrefillEngine, ids: Sequence[int], budget: Budget, timings: Timings, reuse: bool = True,
    stored_tokens: int = 0,
) -> Prefill:  # fmt: skip
    """Load the prefix in one call (if `reuse`), compute the rest, store (past `stored_tokens`, the
    prefix the store holds already) and report.

    A copy to the device that fails (out of memory, a CUDA error) abandons the
    loaded prefix: the prompt is recomputed (`transfer.last_error` says why).
    """
    lm = engine.lm
    try:
        positions, cache, matched, upload = load_prefix(engine, ids, budget if reuse else None, timings)
        loaded = len(positions)
        stats = AttentionStats(loaded, lm.spec.num_layers) if engine.collect_stats else None
        t0 = time.perf_counter()
        with upload.attached(lm.model) if upload is not None else contextlib.nullcontext():
            logits = forward(lm, ids[matched:], matched, cache, stats, last_only=True)
    except StagingError as exc:
        if not reuse:
            raise
        engine.transfer.last_error = str(exc)
        return recompute(engine, ids, timings)
    synchronize(lm.device)  # the answer's first step waits for these logits anyway
    timings.prefill_s = time.perf_counter() - t0
    engine.costs.observe_prefill(len(ids) - matched, matched, timings.prefill_s)
    state = Prefill(cache, logits[0, -1], len(ids), matched, loaded, len(ids) - matched, timings=timings)
    if loaded == matched:  # KV computed over a partial prefix is approximate: never store it
        t0 = time.perf_counter()
        state.pending_store = store_new(engine, ids, max(matched, stored_tokens), cache, stats)
        if stats is not None and matched:
            report_history(engine, ids[:matched], stats)
        timings.store_s = time.perf_counter() - t0
    return state


def prefill_layered(
    engine: PrefillEngine, ids: Sequence[int], budget: Budget, timings: Timings
) -> Prefill | None:
    """The layer-by-layer path (engine_adapter/runner/layered_policy.py says when), or None.

    A store error mid-pass abandons it: the prompt is recomputed without the store. On a
    device, `layered_prefill` builds its cache and inputs there and each layer's chosen
    chunks go through the shared staging copier (`copy_into_cache`); a failed copy
    (`StagingError`) abandons the pass the same way.
    """
    if engine.store is None:
        return None
    t0 = time.perf_counter()
    reserve = None if engine.topup is None else engine.topup.reserve
    plan = plan_layered(
        engine.store, ids, budget, model=engine.lm.spec, namespace=engine.namespace, reserve=reserve
    )
    if plan is None:
        return None
    timings.lookup_s = time.perf_counter() - t0
    matched = int(plan.load.matched_tokens)
    try:  # the load stays open for the top-up, which then owns it
        out = layered_prefill(
            engine.lm.model, plan.load, ids[matched:], plan.chunks, engine.choose_with_last,
            keep_summaries=engine.topup is not None,
        )  # fmt: skip
    except (KVSieveError, StagingError) as exc:
        plan.load.close()
        engine.last_layered = LayeredReport(matched, plan.load.chunk_tokens, plan.chunks, error=str(exc))
        return recompute(engine, ids, timings)
    except BaseException:
        plan.load.close()
        raise
    topup = None if engine.topup is None else DecodeTopUp(plan.load, out, engine.topup, plan.fraction)
    if topup is None:
        plan.load.close()
    engine.last_layered = out.report
    timings.load_s = out.report.load_s
    timings.prefill_s = time.perf_counter() - t0 - timings.lookup_s - out.report.load_s
    loaded = plan.chunks * plan.load.chunk_tokens  # per layer; never stored (an approximation)
    return Prefill(
        out.cache, out.logits[0, -1], len(ids), matched, loaded, len(ids) - matched, timings=timings,
        topup=topup,
    )  # fmt: skip


def recompute(engine: PrefillEngine, ids: Sequence[int], timings: Timings, stored_tokens: int = 0) -> Prefill:
    """The whole prompt computed, nothing loaded, its new blocks stored (after a failed load, or as
    the cost model's choice: then the `stored_tokens` of the cached prefix are not stored again)."""
    return prefill_static(engine, ids, 1.0, timings, reuse=False, stored_tokens=stored_tokens)


def load_prefix(engine: PrefillEngine, ids: Sequence[int], budget: Budget | None, timings: Timings) -> Loaded:
    """The loaded prefix: positions of its tokens, the cache holding them, prefix length covered.

    With `budget` None nothing is loaded (the whole prompt is computed).

    One Load call: its header answers what a Lookup would (the matched prefix),
    so no separate round trip. At least the last token is computed: its logits
    start the answer. With a staged transfer (CUDA) the cache's tensors are filled
    layer by layer during the forward pass (`Loaded.upload`).
    """
    from transformers import DynamicCache

    lm, transfer = engine.lm, engine.transfer
    cache = DynamicCache(config=lm.model.config)
    if engine.store is None or budget is None or len(ids) < 2:
        return Loaded(np.zeros(0, np.int64), cache, 0)
    t0 = time.perf_counter()
    stream = engine.store.load(ids[:-1], model=lm.spec, namespace=engine.namespace, budget=budget)
    engine.last_load = stream  # its fractions stay readable after close (`generate -v`)
    with contextlib.ExitStack() as closing:
        closing.enter_context(stream)
        timings.lookup_s = time.perf_counter() - t0  # until the match was known
        if transfer.staged and isinstance(stream, LocalLoadStream) and (views := stream.pack_views()):
            return _pack_upload(engine, _read_views(engine, views), stream, closing, timings, t0)
        positions, kv = stream.gather(lm.spec)
        covered = int(stream.num_tokens)  # shorter than matched if a block was corrupt
        if not covered or not len(positions):
            return Loaded(np.zeros(0, np.int64), cache, 0)
        if transfer.staged:
            positions, order = position_order(positions)
            # `kv` may be a view of the stream's buffers, read layer by layer during
            # the forward pass: the upload closes the stream once every layer is copied.
            upload = transfer.upload(kv, order, lm.dtype, owner=closing.pop_all())
            timings.load_s = time.perf_counter() - t0
            return Loaded(positions, cache_from(lm.model.config, upload.pairs), covered, upload)
        positions, tensor = cache_tensor(positions, kv, lm.dtype, lm.device)
    cache = cache_from(lm.model.config, [(t[0].unsqueeze(0), t[1].unsqueeze(0)) for t in tensor])
    timings.load_s = time.perf_counter() - t0
    return Loaded(positions, cache, covered)


def _read_views(engine: PrefillEngine, views: Iterator[PackView]) -> list[PackView]:
    """Every view of a full load, read; how fast the disk delivered them goes to the cost model."""
    t0 = time.perf_counter()
    listed = list(views)
    from_disk = sum(v.nbytes for v in listed if v.tier != "memory")
    if from_disk * 2 >= sum(v.nbytes for v in listed) > 0:  # mostly the disk's: its rate
        engine.costs.observe_read("disk", from_disk, time.perf_counter() - t0)
    return listed


def _pack_upload(
    engine: PrefillEngine, views: list[PackView], stream: LocalLoadStream, closing: contextlib.ExitStack,
    timings: Timings, t0: float,
) -> Loaded:  # fmt: skip
    """A full load of packed blocks to the device from where the store holds them (engine_adapter/
    runner/upload.py): the views are read (a slower tier's blocks promoted) here, the copies run on
    the upload's own thread while the forward pass computes."""
    lm, transfer = engine.lm, engine.transfer
    from transformers import DynamicCache

    if not views:
        return Loaded(np.zeros(0, np.int64), DynamicCache(config=lm.model.config), 0)
    upload = transfer.upload_views(views, lm.spec.num_layers, lm.dtype, owner=closing.pop_all())
    timings.load_s = time.perf_counter() - t0
    positions = np.concatenate([v.positions for v in views])
    return Loaded(positions, cache_from(lm.model.config, upload.pairs), int(stream.num_tokens), upload)


def synchronize(device: torch.device) -> None:
    """Wait for the work queued on `device` (a no-op on the CPU): before a prefill's time is read."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def forward(
    lm: LoadedModel,
    ids: Sequence[int],
    start: int,
    cache: Any,
    stats: AttentionStats | None,
    last_only: bool = False,
) -> torch.Tensor:
    """The model over `ids` at positions start.. on top of `cache` (appended in place); its logits.

    With `stats`, attention statistics are collected; with `last_only`, the last token's logits only.
    """
    device = lm.device
    input_ids = torch.tensor([list(ids)], dtype=torch.long, device=device)
    position_ids = torch.arange(start, start + len(ids), device=device).unsqueeze(0)
    extra: dict[str, Any] = {"kvsieve_stats": stats} if stats is not None else {}
    if last_only:  # the vocabulary projection of every prompt token costs ~20 % of a prefill
        extra["logits_to_keep"] = 1
    out = lm.model(input_ids=input_ids, position_ids=position_ids, **cache_kwargs(lm.model, cache), **extra)
    return out.logits


def store_new(
    engine: PrefillEngine, ids: Sequence[int], start: int, cache: Any, stats: AttentionStats | None
) -> Callable[[], int] | None:
    """Store the new full blocks; what completes the store (None: nothing to store).

    On the CPU the store is made here. Through a staged transfer (CUDA) the KV leaves the device
    in pieces (engine_adapter/runner/saver.py `piece_ranges`): the first piece's copy starts here,
    each layer from the cache on the copy stream into a pooled buffer made when the engine started;
    the returned function waits for it, stores it from that buffer while the next piece is copied
    (`Engine.finish_store` runs it after the answer, or queues it on the engine's saver).
    """
    store = engine.store
    block = None if store is None else store.info.block_tokens  # None for a sidecar: it drops partial blocks
    if store is None or len(ids) <= start:
        return None
    end = len(ids) if block is None else len(ids) // block * block
    if end <= start:
        return None  # no new full block: skip building the KV array
    keys = [layer.keys for layer in cache.layers]  # decoding replaces the layers' tensors, not these
    values = [layer.values for layer in cache.layers]
    dtype = torch_dtype(engine.lm.spec.np_dtype)
    spec, namespace, transfer = engine.lm.spec, engine.namespace, engine.transfer
    scores = stats.prefill if stats is not None else None

    def piece(a: int, b: int) -> torch.Tensor:
        pairs = zip(keys, values, strict=True)
        return torch.stack([torch.stack([k[0, :, a:b], v[0, :, a:b]]) for k, v in pairs]).to(dtype)

    def put(a: int, b: int, kv: np.ndarray[Any, Any]) -> int:
        part = None if scores is None else scores[a - start : b - start]
        result = store.store(
            np.asarray(ids[:b]), kv, model=spec, namespace=namespace, scores=part, kv_start=a
        )
        return int(result.new_blocks)

    if not transfer.staged:
        stored = put(start, end, as_array(piece(start, end)))
        return lambda: stored
    pieces = piece_ranges(start, end, block, spec.token_bytes)
    pairs = list(zip(keys, values, strict=True))
    try:
        first = transfer.download_layers(pairs, *pieces[0], dtype)
    except StagingError as exc:  # not stored: the answer does not depend on it
        transfer.last_error = str(exc)
        return None

    return functools.partial(_store_pieces, transfer, pairs, pieces, dtype, first, put)


def _store_pieces(
    transfer: KVTransfer, pairs: list[tuple[torch.Tensor, torch.Tensor]], pieces: list[tuple[int, int]],
    dtype: torch.dtype, first: PendingDownload, put: Callable[[int, int, np.ndarray[Any, Any]], int],
) -> int:  # fmt: skip
    """`store_new`'s store through a staged transfer: each piece stored from the buffer its copy
    landed in (no copy out of it), the next piece's copy running meanwhile. Returns blocks stored."""
    stored, pending = 0, first
    for i, (a, b) in enumerate(pieces):
        following = None
        try:
            if i + 1 < len(pieces):
                following = transfer.download_layers(pairs, *pieces[i + 1], dtype)
            with pending.held() as kv:
                stored += put(a, b, kv)
        except BaseException:
            for left in (pending, following):  # waited for, their buffers back in the pool
                if left is not None and left.buffer is not None:
                    left.result()
            raise
        if following is not None:
            pending = following
    return stored


def report_history(engine: PrefillEngine, prefix: Sequence[int], stats: AttentionStats) -> None:
    """Report to the store how the new tokens attended to each prefix token (history scores)."""
    assert engine.store is not None
    history = stats.history
    if len(history) == len(prefix):
        engine.store.report_scores(
            np.asarray(prefix), history, model=engine.lm.spec, namespace=engine.namespace
        )


def position_order(positions: np.ndarray[Any, Any]) -> tuple[Any, np.ndarray[Any, Any] | None]:
    """(positions ascending, the order that sorts them), the order None if already ascending."""
    if len(positions) > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        order = np.argsort(positions, kind="stable")
        return positions[order], order
    return positions, None


def cache_tensor(
    positions: np.ndarray[Any, Any], kv: np.ndarray[Any, Any], dtype: torch.dtype, device: torch.device
) -> tuple[Any, torch.Tensor]:
    """Loaded KV (layers, 2, heads, n, dim) in `dtype` on `device` (the model's) in position order:
    the one dtype conversion, into a preallocated tensor; a reorder copy only if out of position order.

    `kv` may be a read-only view of shared memory: it is only read here.
    """
    with warnings.catch_warnings():  # torch warns about read-only arrays; the source is never written
        warnings.simplefilter("ignore", UserWarning)
        source = as_tensor(kv)
    if len(positions) > 1 and not bool(np.all(positions[1:] > positions[:-1])):
        order = np.argsort(positions, kind="stable")
        positions = positions[order]
        source = source.index_select(3, torch.from_numpy(order))
    out = torch.empty(source.shape, dtype=dtype, device=device)
    out.copy_(source)
    return positions, out
