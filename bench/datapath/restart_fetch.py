"""A restarted sidecar's first load of a prefix, as the vLLM connector fetches it (issue 47 item 4).

After `kvsieve serve` restarts its memory tier is empty; the data file's pages are still in the
page cache (the prefixes were just stored). Each measured load is a prefix's first after the
restart: `KVClient.load` + `gather` through the client's shared-memory arena, until the KV is
a view of the arena (the connector's `fetch_s`). Side by side in one run, on two data
directories holding the same prefixes, alternating which goes first each round:

- `restart_fetch_s`: the default, each block copied once from LMDB's map into the arena
  (`read_in_place`, kvstore/load/place.py);
- `restart_fetch_pread_s`: `--no-read-in-place`, each block read with pread first (and
  promoted), then copied into the arena;
- `restart_fetch_memcpy_s`: one memcpy of the same bytes in this process, the floor.

Before the measured loads each restarted sidecar serves one load of another prefix: the
client's arena and the process's first-call costs are not what a restart's hit is about. Its data
file is read first, so that the page cache holds it whatever other jobs dropped, and a restart
whose loads saw the page cache dropped is measured again (`restart_fetch_cache_drops`).
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.sidecar import Sidecar
from bench.common.warm import cache_drops, warm_files
from kvstore.client.kvclient import KVClient
from kvstore.model import ModelSpec

#: Pause after a restart before the first load, as while vLLM starts again (the sidecar makes its
#: warm read memory meanwhile, on a low-priority thread: 1 s was not enough on 2 busy cores).
SETTLE_S = 3.0
#: Tries of a restart's loads while something drops the page cache during them (bench/common/warm.py).
RETRIES = 4


def restart_fetch(
    base: Path, model: ModelSpec, num_tokens: int, prefixes: int, rounds: int
) -> dict[str, float | int]:
    """The keys above: medians over `rounds` restarts of each mode, `prefixes` - 1 measured loads
    each (the first prefix is the warm-up load), of `num_tokens`-token prefixes of `model`."""
    rng = np.random.default_rng(5)
    tokens = [rng.integers(0, 49152, num_tokens) for _ in range(prefixes)]
    kv = rng.standard_normal(model.kv_shape(num_tokens)).astype(model.np_dtype)
    sidecars = {
        "in_place": _sidecar(base / "in_place"),
        "pread": _sidecar(base / "pread", "--no-read-in-place"),
    }
    seconds: dict[str, list[float]] = {mode: [] for mode in sidecars}
    drops = 0
    try:
        for sidecar in sidecars.values():
            _store(sidecar, tokens, kv, model)
        for round_ in range(rounds):
            order = list(sidecars) if round_ % 2 == 0 else list(reversed(sidecars))
            for mode in order:
                loads, dropped = _first_loads(sidecars[mode], tokens, model)
                seconds[mode] += loads
                drops += dropped
    finally:
        for sidecar in sidecars.values():
            sidecar.kill()
    in_place, pread = (statistics.median(seconds[mode]) for mode in ("in_place", "pread"))
    memcpy = _memcpy_s(kv, rounds * (prefixes - 1))
    return {
        "restart_fetch_s": round(in_place, 4),
        "restart_fetch_pread_s": round(pread, 4),
        "restart_fetch_memcpy_s": round(memcpy, 4),
        "restart_fetch_vs_pread": round(pread / in_place, 2),
        "restart_fetch_vs_memcpy": round(memcpy / in_place, 3),
        "restart_fetch_bytes": int(kv.nbytes),
        "restart_fetch_cache_drops": drops,  # rounds measured again because the page cache was dropped
    }


def _sidecar(data_dir: Path, *extra: str) -> Sidecar:
    # The store's default geometry (256-token blocks, 16-token chunks), as `kvsieve bench vllm` runs it.
    return Sidecar(
        data_dir, ["--metrics-listen", "", "--block-tokens", "256", "--chunk-tokens", "16", *extra]
    )


def _store(sidecar: Sidecar, tokens: list[Any], kv: Any, model: ModelSpec) -> None:
    """Store every prefix, its disk writes committed (SIGTERM commits the backlog)."""
    sidecar.start()
    with KVClient(sidecar.address) as client:
        for toks in tokens:
            client.store(toks, kv, model=model)
    rc, err = sidecar.terminate()
    if rc != 0:
        raise RuntimeError(f"kvsieve serve exited {rc} at SIGTERM: {err[-2000:]}")


def _first_loads(sidecar: Sidecar, tokens: list[Any], model: ModelSpec) -> tuple[list[float], int]:
    """Restart `sidecar`, read its data file (the page cache holds it), load the first prefix (not
    timed), then time each other prefix's load. Again, up to `RETRIES` times, while the page
    cache was dropped meanwhile (then some loads read the disk); the drops seen are returned."""
    drops = 0
    for _ in range(RETRIES):
        sidecar.start()
        try:
            time.sleep(SETTLE_S)
            warm_files(*sidecar.data_dir.rglob("*.mdb"))  # the LMDB files
            before = cache_drops()
            with KVClient(sidecar.address) as client:
                _fetch(client, tokens[0], model)
                seconds = [_fetch(client, toks, model) for toks in tokens[1:]]
            if cache_drops() == before:
                return seconds, drops
            drops += cache_drops() - before
        finally:
            sidecar.kill()
    raise RuntimeError(f"the page cache was dropped during each of {RETRIES} tries ({drops} drops)")


def _fetch(client: KVClient, tokens: Any, model: ModelSpec) -> float:
    """Seconds of one load until its KV is in this process, as the connector's `fetch_s`."""
    t0 = time.perf_counter()
    with client.load(tokens, model=model) as stream:
        _, kv = stream.gather(model)
        elapsed = time.perf_counter() - t0
        if (
            kv.shape[3] != len(tokens)
            or stream.arena_view is None
            or not np.shares_memory(kv, stream.arena_view)
        ):
            raise RuntimeError(
                f"the load delivered {kv.shape[3]} of {len(tokens)} tokens, or not in the arena"
            )
    return elapsed


def _memcpy_s(kv: Any, repeats: int) -> float:
    out = np.ones_like(kv)  # resident, as an arena reused load after load is
    times = []
    for _ in range(max(repeats, 3)):
        t0 = time.perf_counter()
        np.copyto(out, kv)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)
