"""A cold full load's read rate against the disk's own sequential read of the same file (issue 47).

`kvsieve bench ttft` publishes these for its longest published prefix (2,048 tokens of SmolLM2,
47 MB of KV), from the stores its runs wrote; `python -m bench.datapath.cold_read` runs the same
measurement on random KV of SmolLM2's shape without the model:

- `cold_read_mb_s{tag}`: the prefix's bytes over the time of a full load from a store just opened
  (memory empty; its memory for reads made ahead, `warm_read_ahead_bytes`, as `kvsieve serve` makes
  it at its start) with the data file evicted from the page cache: `Load`, then every block read,
  verified and promoted, as `PackView`s where the layout allows (the views a device copies from),
  else gathered into one array (the CPU engine's path);
- `disk_file_read_mb_s{tag}`: the same data file read front to back, cold (`timed_seq_read_mb_s`);
- `cold_read_vs_disk{tag}`: the first over the second (target >= 0.8).

The two are measured side by side, alternating, `repeats` times, and the medians published: the
disk here is shared with other jobs and its cold rate moves 2-5x between minutes.
"""

from __future__ import annotations

import gc
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.datapath.page_cache import make_cold, timed_seq_read_mb_s
from kvstore.config import StoreConfig
from kvstore.load.stream import LocalLoadStream
from kvstore.model import ModelSpec
from kvstore.store.tiered import TieredStore

#: SmolLM2-135M's KV shape (bfloat16 in the model; float16 here: the same bytes a token).
SMOL = ModelSpec("smollm2-135m-shape", num_layers=30, num_kv_heads=3, head_dim=64)


def cold_read_figures(
    config: StoreConfig, tokens: np.ndarray[Any, Any], model: ModelSpec, tag: str = "", repeats: int = 5
) -> dict[str, Any]:
    """The keys above for the prefix `tokens` that the store at `config` holds whole."""
    assert config.lmdb_dir is not None
    data_file = config.lmdb_dir / "data.mdb"
    loads, disks, nbytes, method = [], [], 0, "none"
    for _ in range(repeats):
        with TieredStore(config) as store:
            # what `kvsieve serve` makes at its start, idle before the first load: not the load's work
            store.warm_reads(config.warm_read_ahead_bytes, wait_s=30.0)
            gc.collect()  # the store of the repeat before: freed here, not by a collection mid-load
            method = make_cold(data_file, drop_all=False)  # a model mapped beside it stays cached
            t0 = time.perf_counter()
            nbytes = _full_load(store, tokens, model)
            loads.append(nbytes / (time.perf_counter() - t0) / 1e6)
        disks.append(timed_seq_read_mb_s(data_file, drop_all=False))
    load_mb_s, disk_mb_s = statistics.median(loads), statistics.median(disks)
    return {
        f"cold_read_mb_s{tag}": round(load_mb_s, 1),
        f"disk_file_read_mb_s{tag}": round(disk_mb_s, 1),
        f"cold_read_vs_disk{tag}": round(load_mb_s / disk_mb_s, 3),
        f"cold_read_prefix_mb{tag}": round(nbytes / 1e6, 1),
        f"cold_read_method{tag}": method,
    }


def _full_load(store: TieredStore, tokens: np.ndarray[Any, Any], model: ModelSpec) -> int:
    """Bytes of the prefix's KV delivered by one full load (as views where the layout allows)."""
    with store.load(tokens, model=model) as stream:
        views = stream.pack_views() if isinstance(stream, LocalLoadStream) else None
        if views is not None:
            listed = list(views)
            if stream.num_tokens != len(tokens) // store.config.block_tokens * store.config.block_tokens:
                raise RuntimeError("the cold load lost a block")
            return sum(len(v.positions) for v in listed) * model.token_bytes
        _, kv = stream.gather(model)
        return int(kv.nbytes)


#: (tag, layout, host_arena): both layouts a store writes, and the GPU's memory layout on the CPU.
VARIANTS = (("layered", "layered", None), ("importance", "importance", None), ("arena", "layered", True))


def run(num_tokens: int = 2048, repeats: int = 5) -> dict[str, Any]:
    """On random KV of SmolLM2's shape: `_layered` (the default layout: a pack per block),
    `_importance` (16 chunk records per block, what `bench ttft`'s full loads read) and `_arena`
    (layered, the memory tier's records in a `HostArena` as on a GPU, unpinned here)."""
    out: dict[str, Any] = {"model_shape": SMOL.name, "prefix_tokens": num_tokens}
    tokens = np.arange(num_tokens, dtype=np.int64) + 7
    kv = np.random.default_rng(0).standard_normal(SMOL.kv_shape(num_tokens), dtype=np.float32)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        for tag, layout, arena in VARIANTS:
            config = StoreConfig(
                data_dir=Path(tmp) / tag, memory_bytes=1 << 30, layout=layout, host_arena=arena
            )
            with TieredStore(config) as store:
                store.store(tokens, kv.astype(np.float16), model=SMOL)
                store.flush()
            out |= cold_read_figures(config, tokens, SMOL, f"_{tag}", repeats)
    return out


if __name__ == "__main__":
    import json

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 2048), indent=1))
