"""`kvsieve bench gpu` end to end: through `Engine`, from a real store (LMDB on disk, the memory tier
page-locked), with random-weight models of real shapes in half precision on the GPU.

Per model shape (SmolLM2-135M's, `_smol`; an 8B Llama's, no tag) and prompt length N (a prefix of
N tokens, whole blocks, then a question of `QUESTION_TOKENS`), each the least of `repeats` runs:

- `e2e_recompute_s{tag}_{N}`: the whole prompt computed (no store).
- `e2e_store_s{tag}_{N}` and `e2e_store_vs_prefill{tag}_{N}`: the first run with a store (its blocks
  stored behind it, on the engine's saver), against the prefill alone (target <= 1.1).
- `e2e_full_warm_s{tag}_{N}`: the prefix loaded from the memory tier, the question computed;
  `e2e_full_warm_vs_recompute{tag}_{N}`.
- `e2e_full_cold_s{tag}_{N}`: the same from disk, the data file evicted from the page cache and the
  store reopened (memory empty); `e2e_full_cold_vs_recompute{tag}_{N}`, and
  `e2e_cold_read_vs_disk{tag}_{N}`: the prefix's bytes over the load's seconds, against the
  disk's own sequential read of the same file, cold (`disk_seq_read_gb_s{tag}_{N}`).
- `e2e_qa25_warm_s` / `e2e_qa25_cold_s{tag}_{N}`: query-aware at budget 0.25 (layer by layer, the
  question's queries choosing each layer's chunks), and their ratios to the full loads;
  `e2e_qa25_cold_vs_recompute{tag}_{N}`: the cold one against recomputing the prompt (the product's
  target: a quarter from disk faster than the GPU recomputes all); `e2e_qa25_speculation_hit_rate`:
  the share of its chosen chunks the guess a layer ahead had named (random weights: a floor);
  `e2e_qa25_auto_warm_vs_full{tag}_{N}`: budget 0.25 as the engine runs it by default on a device
  (query-aware only where the cost model measured it faster than a full load).
- `e2e_split_warm_s` / `e2e_split_cold_s{tag}_{N}` and `..._vs_best`: the engine's own choice of how
  much to load and compute meanwhile (engine_adapter/runner/choice.py: the cost model is shared, so
  it chooses among what the runs before it measured, recompute and the full load, and may try a
  split its estimate puts 10 % under them), against min(recompute, full load) (target <= 1.05);
  `..._kind`: what it chose; `e2e_split_cold_again_vs_best{tag}_{N}` / `..._kind`: a second cold
  request, after what the first measured (a plan measured > 5 % slower never runs again).
- `e2e_store_behind_s{tag}_{N}`: the store the first run queued, finished after it returned;
  `e2e_store_mb_s{tag}_{N}`: the prefix's bytes over the first run and its store together.

Keys of the 8B shape at its largest N: `h2d_tier_gb_s` (the memory tier's own buffers to the GPU
through `PackUpload`, copies only), `h2d_vs_pinned_floor` (that over one pinned tensor's copy of the
same bytes), `overlap_hidden_fraction` (of those copies, the share hidden behind the question's
compute).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from engine_adapter.runner.cache import cache_from
from engine_adapter.runner.costs import CostModel
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel, kv_dtype, random_llama, spec_from_config
from engine_adapter.runner.prefill import forward
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

QUESTION_TOKENS = 64
BLOCK_TOKENS = 256


def shape_figures(
    tag: str, shape: tuple[int, ...], sizes: tuple[int, ...], dtype: torch.dtype, work: Path, repeats: int,
    device: str = "cuda",
) -> dict[str, Any]:  # fmt: skip
    """Every key above for one model shape, over `sizes` (on `device`: the CPU only to try the code)."""
    model = random_llama(shape, device, dtype)  # type: ignore[arg-type]
    source = work / f"model{tag or '_8b'}"
    lm = LoadedModel(model, None, spec_from_config(model.config, source, kv_dtype(dtype)), source)
    figures: dict[str, Any] = {}
    for n in sizes:
        figures |= _at_length(lm, tag, n, work / f"store{tag}_{n}", repeats)
    return figures


def _at_length(lm: LoadedModel, tag: str, n: int, data: Path, repeats: int) -> dict[str, Any]:
    ids = np.random.default_rng(n).integers(0, lm.model.config.vocab_size, n + QUESTION_TOKENS).tolist()
    prefix_bytes = n * lm.spec.token_bytes
    config = StoreConfig(data_dir=data, memory_bytes=3 * prefix_bytes + (256 << 20))
    key, costs = f"{tag}_{n}", CostModel()  # one cost model: what one device measured
    recompute = _best(lambda: Engine(lm, None, collect_stats=False, costs=costs).prefill(ids), repeats)
    out: dict[str, Any] = {f"e2e_recompute_s{key}": round(recompute, 4)}
    with TieredStore(config) as store:
        full = _engine(lm, store, costs, split=False)
        stored = _timed(lambda: full.prefill(ids))  # the first: computes, and stores behind it
        flushed = _timed(full.flush_stores)
        out |= {
            f"e2e_store_s{key}": round(stored, 4),
            f"e2e_store_vs_prefill{key}": round(stored / recompute, 3),
            f"e2e_store_behind_s{key}": round(flushed, 4),
            f"e2e_store_mb_s{key}": round(prefix_bytes / (stored + flushed) / 1e6, 1),
        }
        warm = _best(lambda: full.prefill(ids), repeats)
        qa = _engine(lm, store, costs, split=False, query_aware=True)
        qa_warm = _best(lambda: qa.prefill(ids, budget=0.25), repeats)
        auto = _engine(lm, store, costs, split=True)  # the engine's own choice at budget 0.25
        qa_auto_warm = _best(lambda: auto.prefill(ids, budget=0.25), repeats)
        split = _engine(lm, store, costs, split=True)
        split_warm = _best(lambda: split.prefill(ids), repeats)
        out[f"e2e_split_warm_kind{key}"] = split.last_split.kind if split.last_split else "none"
        if not tag:
            out |= _transfer_figures(lm, store, ids, n, key, warm)
    cold = _cold(lm, config, ids, 1.0, costs, split=False)
    split_cold = _cold(lm, config, ids, 1.0, costs, split=True)
    split_again = _cold(lm, config, ids, 1.0, costs, split=True)  # after what the first one measured
    qa_cold = _cold(lm, config, ids, 0.25, costs, split=False, query_aware=True)
    disk = _disk_read_gb_s(config)
    out |= {
        f"e2e_full_warm_s{key}": round(warm, 4),
        f"e2e_full_warm_vs_recompute{key}": round(warm / recompute, 3),
        f"e2e_full_cold_s{key}": round(cold[0], 4),
        f"e2e_full_cold_vs_recompute{key}": round(cold[0] / recompute, 3),
        f"disk_seq_read_gb_s{key}": round(disk, 3),
        f"e2e_cold_read_vs_disk{key}": round(prefix_bytes / max(cold[1], 1e-9) / 1e9 / disk, 3),
        f"e2e_split_warm_s{key}": round(split_warm, 4),
        f"e2e_split_warm_vs_best{key}": round(split_warm / min(recompute, warm), 3),
        f"e2e_split_cold_s{key}": round(split_cold[0], 4),
        f"e2e_split_cold_vs_best{key}": round(split_cold[0] / min(recompute, cold[0]), 3),
        f"e2e_split_cold_kind{key}": split_cold[2],
        f"e2e_split_cold_again_vs_best{key}": round(split_again[0] / min(recompute, cold[0]), 3),
        f"e2e_split_cold_again_kind{key}": split_again[2],
        f"e2e_qa25_warm_s{key}": round(qa_warm, 4),
        f"e2e_qa25_warm_vs_full{key}": round(qa_warm / warm, 3),
        f"e2e_qa25_auto_warm_vs_full{key}": round(qa_auto_warm / warm, 3),
        f"e2e_qa25_cold_s{key}": round(qa_cold[0], 4),
        f"e2e_qa25_cold_vs_full{key}": round(qa_cold[0] / cold[0], 3),
        f"e2e_qa25_cold_vs_recompute{key}": round(qa_cold[0] / recompute, 3),
        f"e2e_qa25_speculation_hit_rate{key}": round(qa_cold[3], 3),
    }
    return out


def _engine(
    lm: LoadedModel, store: TieredStore | None, costs: CostModel, split: bool, query_aware: bool | None = None
) -> Engine:
    return Engine(
        lm, store, collect_stats=False, topup=None, costs=costs, split=split, query_aware=query_aware
    )


def _cold(
    lm: LoadedModel, config: StoreConfig, ids: list[int], budget: float, costs: CostModel, split: bool,
    query_aware: bool | None = None,
) -> tuple[float, float, str, float]:  # fmt: skip
    """(seconds of the prefill, seconds of its load, the split chosen, the share of a query-aware
    load's chosen chunks its guesses named a layer ahead) with the data file out of the page cache
    and the store reopened: every byte comes from the disk."""
    _evict(config)
    with TieredStore(config) as store:
        # a sidecar makes its memory ahead after it starts, before requests come: so does this store
        store.warm_reads(config.warm_read_ahead_bytes, wait_s=30.0)
        engine = _engine(lm, store, costs, split, query_aware)
        if costs.disk_probe is not None:  # the disk's rate, read at store open: no request waits for it
            costs.disk_probe.join(60)  # here the request follows at once: it must not share the disk
        states = []
        seconds = _timed(lambda: states.append(engine.prefill(ids, budget=budget)))
        engine.flush_stores()
        kind = engine.last_split.kind if engine.last_split else "none"
        guessed = engine.last_layered.speculation_hit_rate if engine.last_layered else 0.0
        return seconds, states[0].timings.load_s, kind, guessed


def _evict(config: StoreConfig) -> None:
    """Drop the data directory's files from the page cache (their pages are clean: LMDB syncs)."""
    assert config.data_dir is not None
    for path in Path(config.data_dir).rglob("*"):
        if path.is_file():
            fd = os.open(path, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _disk_read_gb_s(config: StoreConfig) -> float:
    """The disk's own sequential read of the store's data file, cold, in 16 MiB reads."""
    _evict(config)
    assert config.data_dir is not None
    path = max((p for p in Path(config.data_dir).rglob("*.mdb")), key=lambda p: p.stat().st_size)
    t0 = time.perf_counter()
    total = 0
    with open(path, "rb", buffering=0) as fh:
        while chunk := fh.read(16 << 20):
            total += len(chunk)
    return total / (time.perf_counter() - t0) / 1e9


def _transfer_figures(
    lm: LoadedModel, store: TieredStore, ids: list[int], n: int, key: str, warm_s: float
) -> dict[str, Any]:
    """The memory tier's own buffers to the GPU: copies alone, against a pinned floor; and the share
    of the copies hidden behind the question's compute in the warm full load (`warm_s`)."""
    transfer = KVTransfer(lm.device, staging=True)
    layers = lm.spec.num_layers
    kept: list[Any] = []

    def copies() -> None:
        stream = store.load(ids[:n], model=lm.spec)
        listed = stream.pack_views()
        assert listed is not None, "a full load of packs has views"
        upload = transfer.upload_views(list(listed), layers, lm.dtype, owner=stream)
        upload.wait_all()
        upload.close()
        _sync()
        kept[:] = [upload]

    ours_s = _best(copies, 3)
    upload = kept[0]
    nbytes = sum(v.layer_bytes * layers for v in upload.views)
    pinned = torch.empty(nbytes, dtype=torch.uint8, pin_memory=torch.cuda.is_available())
    device = torch.empty(nbytes, dtype=torch.uint8, device=lm.device)

    def floor() -> None:
        device.copy_(pinned, non_blocking=True)
        _sync()

    def compute() -> None:
        forward(lm, ids[n:], n, cache_from(lm.model.config, upload.pairs), None, last_only=True)

    floor_s, compute_s = _best(floor, 3), _best(compute, 3)
    hidden = (ours_s + compute_s - warm_s) / ours_s if ours_s > 0 else 0.0
    return {
        "h2d_tier_gb_s": round(nbytes / ours_s / 1e9, 3),
        "h2d_pinned_floor_gb_s": round(nbytes / floor_s / 1e9, 3),
        "h2d_vs_pinned_floor": round(floor_s / ours_s, 3),
        "overlap_hidden_fraction": round(min(max(hidden, 0.0), 1.0), 3),
        f"e2e_copies_s{key}": round(ours_s, 4),
        f"e2e_question_compute_s{key}": round(compute_s, 4),
    }


def _timed(fn: Callable[[], Any]) -> float:
    _sync()
    t0 = time.perf_counter()
    fn()
    _sync()
    return time.perf_counter() - t0


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def _best(fn: Callable[[], Any], repeats: int) -> float:
    """Least seconds of `repeats` runs after one warm-up run."""
    fn()
    return min(_timed(fn) for _ in range(repeats))
