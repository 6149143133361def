"""`kvsieve bench layout`: the importance layout against the layered one, side by side.

A 2,048-token SmolLM2-shaped prefix (random fp16 KV, 47 MB) is stored into a fresh
LMDB-backed store in each layout, then loaded from a restarted store: cold (page cache
dropped where allowed: see bench/datapath/page_cache.py), warm (a second full load, now from memory),
and a static 0.25 budget load. For the layered layout, `layer_read_0_25_ms` is one
query-aware pass over a warm store: `open_layers`, then for every layer its key summary
and `read_layer` of a quarter of the chunks. Each figure is the median of the runs;
every full load is checked bit-exact.
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.datapath.page_cache import make_cold
from bench.datapath.store_bench import SMOLLM2_SHAPE
from kvstore.config import StoreConfig
from kvstore.load.buffers import keep_large_buffers
from kvstore.store.tiered import TieredStore

MODEL = SMOLLM2_SHAPE
LAYOUTS = ("importance", "layered")


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench layout --json` prints."""
    keep_large_buffers()
    num_tokens = 512 if quick else 2048
    runs = 1 if quick else 5  # cold loads from disk vary by 20 % run to run: a median of 5
    rng = np.random.default_rng(0)
    kv = rng.standard_normal(MODEL.kv_shape(num_tokens)).astype(np.float16)
    samples: dict[str, list[float]] = {}
    for _ in range(runs):
        for layout in LAYOUTS:
            tokens = rng.integers(0, 49152, num_tokens)
            for key, value in _one_run(layout, tokens, kv, rng).items():
                samples.setdefault(f"{key}_{layout}", []).append(value)
    out: dict[str, Any] = {k: round(statistics.median(v), 3) for k, v in sorted(samples.items())}
    out["layered_vs_importance_cold"] = round(
        out["cold_full_mb_s_layered"] / out["cold_full_mb_s_importance"], 3
    )
    out["layered_vs_importance_warm"] = round(
        out["warm_full_mb_s_layered"] / out["warm_full_mb_s_importance"], 3
    )
    out["layered_block_bytes_ratio"] = round(out.pop("bytes_layered") / out.pop("bytes_importance"), 4)
    out["layer_read_0_25_ms"] = out.pop("layer_read_0_25_ms_layered")
    return {"prefix_tokens": num_tokens, "prefix_bytes": kv.nbytes, "runs": runs, **out}


def _one_run(layout: str, tokens: np.ndarray, kv: np.ndarray, rng: np.random.Generator) -> dict[str, float]:
    """Store, cold full, warm full and 0.25 loads (and a layered pass) in a fresh data dir."""
    mb = kv.nbytes / 1e6
    scores = rng.random(len(tokens)).astype(np.float32)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        config = StoreConfig(data_dir=Path(tmp), memory_bytes=4 << 30, layout=layout)
        with TieredStore(config) as store:
            start = time.perf_counter()
            store.store(tokens, kv, model=MODEL, scores=scores)
            store.flush()  # on disk: layouts compared at what a durable store costs (as before write-behind)
            figures = {"store_mb_s": mb / (time.perf_counter() - start)}
            figures["bytes"] = float(store.stats().tiers["lmdb"].used_bytes)
        with TieredStore(config) as store:
            make_cold(*Path(tmp).rglob("*.mdb"))
            figures["cold_full_mb_s"] = mb / _full_load(store, tokens, kv)
            figures["warm_full_mb_s"] = mb / _full_load(store, tokens, kv)
            start = time.perf_counter()
            store.load_arrays(tokens, model=MODEL, budget=0.25)
            figures["warm_0_25_ms"] = (time.perf_counter() - start) * 1e3
            if layout == "layered":
                figures["layer_read_0_25_ms"] = _layer_pass(store, tokens, rng)
    return figures


def _full_load(store: TieredStore, tokens: np.ndarray, kv: np.ndarray) -> float:
    """Seconds of one full load, checked bit-exact."""
    start = time.perf_counter()
    _, positions, out = store.load_arrays(tokens, model=MODEL)
    seconds = time.perf_counter() - start
    if np.take(out, np.argsort(positions), axis=3).tobytes() != kv.tobytes():
        raise AssertionError("a full load did not return the stored KV")
    return seconds


def _layer_pass(store: TieredStore, tokens: np.ndarray, rng: np.random.Generator) -> float:
    """Milliseconds of one layer-by-layer pass: every layer's summary, then a quarter of its chunks."""
    start = time.perf_counter()
    with store.open_layers(tokens, model=MODEL) as load:
        total = load.matched_tokens // load.chunk_tokens
        for layer in range(load.num_layers):
            load.key_summary(layer)
            chosen = rng.choice(total, size=max(1, total // 4), replace=False)
            layer_slice = load.read_layer(layer, chosen.tolist())
            if layer_slice.kv.shape[2] != len(chosen) * load.chunk_tokens:
                raise AssertionError("read_layer returned another number of tokens")
    return (time.perf_counter() - start) * 1e3
