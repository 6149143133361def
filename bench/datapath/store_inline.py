"""What storing a prompt's new blocks costs the request, on the CPU (issue 47, item 3).

`kvsieve bench gpu` runs this always (a GPU is not needed); `python -m bench.datapath.store_inline`
alone. A random-weight Llama of SmolLM2-135M's shape computes an N-token prompt (fp32 on the CPU,
its KV stored in fp16) with a real store (LMDB, layered layout) through the staged transfer that a
GPU runs (`KVTransfer(staging=True)`: the copy off the device into a pooled buffer, the store on
the engine's saver thread). Per N, the medians of `repeats` first requests, each on a fresh store,
measured alternately with the same prompt computed without a store:

- `cpu_store_inline_s_N`: what storing ran in line (`Timings.store_s`: issuing the copies of the
  new KV into the buffers the engine made when it started; encoding and the disk are the saver's);
- `cpu_store_inline_vs_prefill_N`: that over the prefill's compute (`Timings.prefill_s`; the
  target on every device: <= 0.1);
- `cpu_store_vs_prefill_N`: the whole request with a store over the request without one, the CPU
  counterpart of `e2e_store_vs_prefill` (the saver's work overlaps nothing here: the request has
  returned when it starts);
- `cpu_store_plain_vs_prefill_N`: `cpu_store_inline_vs_prefill_N` on the CPU's plain path (no
  staging, no saver: `Engine`'s default on the CPU, where the store is made in line after the
  answer because the saver would compete for the same cores).
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
import torch

from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.engine import Engine
from engine_adapter.runner.model import LoadedModel, random_llama, spec_from_config
from kvstore.config import StoreConfig
from kvstore.store.tiered import TieredStore

#: (hidden, intermediate, layers, attention heads, KV heads, vocabulary): SmolLM2-135M's.
SMOL_SHAPE = (576, 1536, 30, 9, 3, 49152)


def store_inline_figures(quick: bool = False) -> dict[str, Any]:
    """The keys above at N = 512 (quick) or 1,024 and 2,048 tokens."""
    torch.manual_seed(0)
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        model = random_llama(SMOL_SHAPE, "cpu", torch.float32)
        lm = LoadedModel(
            model, None, spec_from_config(model.config, Path(tmp) / "m", "float16"), Path(tmp) / "m"
        )
        figures: dict[str, Any] = {}
        for n in (512,) if quick else (1024, 2048):
            figures |= _at_length(lm, n, Path(tmp), repeats=2 if quick else 3)
    return figures


def _at_length(lm: LoadedModel, n: int, work: Path, repeats: int) -> dict[str, Any]:
    ids = np.random.default_rng(n).integers(0, lm.model.config.vocab_size, n + 1).tolist()
    plain, staged, unstaged = [], [], []
    _request(lm, ids, None, staging=True)  # the model's first run at this length: not counted
    for rep in range(repeats):
        plain.append(_request(lm, ids, None, staging=True))
        staged.append(_request(lm, ids, work / f"staged-{n}-{rep}", staging=True))
        unstaged.append(_request(lm, ids, work / f"plain-{n}-{rep}", staging=False))
    inline = statistics.median(t.store_s for _, t in staged)
    return {
        f"cpu_store_inline_s_{n}": round(inline, 4),
        f"cpu_store_inline_vs_prefill_{n}": round(
            statistics.median(t.store_s / t.prefill_s for _, t in staged), 4
        ),
        f"cpu_store_vs_prefill_{n}": round(
            statistics.median(s for s, _ in staged) / statistics.median(s for s, _ in plain), 3
        ),
        f"cpu_store_plain_vs_prefill_{n}": round(
            statistics.median(t.store_s / t.prefill_s for _, t in unstaged), 4
        ),
    }


def _request(lm: LoadedModel, ids: list[int], data: Path | None, staging: bool) -> tuple[float, Any]:
    """(seconds, `Timings`) of one first request: with a fresh store at `data` (None: no store)."""
    transfer = KVTransfer(torch.device("cpu"), staging=staging)
    store = None if data is None else TieredStore(StoreConfig(data_dir=data))
    try:
        engine = Engine(lm, store, collect_stats=False, transfer=transfer)
        transfer.copier.pool.wait_ahead()  # a started engine: its buffers were made at its start
        gc.collect()
        t0 = time.perf_counter()
        state = engine.prefill(ids)
        elapsed = time.perf_counter() - t0
        engine.flush_stores()  # the store behind the answer: not the request's time
        return elapsed, state.timings
    finally:
        if store is not None:
            store.close()


if __name__ == "__main__":
    import json

    print(json.dumps(store_inline_figures(quick="--quick" in sys.argv), indent=1))
