"""`kvsieve bench remote`: the shared tier on a real redis-server, against redis-py itself.

In one run, on loopback:
- `remote_load_mb_s`: a fresh store (no local copy, memory tier off) loads a
  SmolLM2-shaped prefix (2,048 tokens, 47 MB; 512 with --quick) from the remote
  tier: metadata lookup along the key chain, chunk reads, checksum, decode, gather.
- `redis_get_mb_s`: plain pipelined GETs with redis-py of values of the same sizes
  and total (no decoding): what Redis and the client library give at best.
- `store_ms_write_behind`, `store_ms_sync`: Store latency seen by the caller
  (LMDB commit included) with write-behind and with the remote write inline.
- `ttft_speedup_remote_vs_recompute`: time to first token on SmolLM2-135M of a
  second store that finds the prefix only remotely, vs recomputing it
  (2,048 + 32 tokens; 256 + 32 with --quick).
"""

from __future__ import annotations

import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

from bench.common.redisd import RedisNode
from bench.datapath.store_bench import SMOLLM2_SHAPE
from kvstore.config import StoreConfig
from kvstore.load.buffers import keep_large_buffers
from kvstore.store.tiered import TieredStore

MODEL = SMOLLM2_SHAPE


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench remote --json` prints."""
    keep_large_buffers()
    num_tokens = 512 if quick else 2048
    repeats = 3 if quick else 5
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        server = RedisNode(Path(tmp) / "redis", maxmemory="4gb").start()
        try:
            out = _transfer(server, Path(tmp), num_tokens, repeats)
            out |= _store_latency(server, Path(tmp), num_tokens, repeats)
            out |= _ttft(server, Path(tmp), 256 if quick else 2048)
        finally:
            server.stop()
    out["remote_vs_get"] = round(out["remote_load_mb_s"] / out["redis_get_mb_s"], 3)
    out["ttft_speedup_remote_vs_recompute"] = round(out["ttft_recompute_s"] / out["ttft_remote_s"], 2)
    return {"prefix_tokens": num_tokens, **out}


def _config(url: str, data_dir: Path | None, **fields: Any) -> StoreConfig:
    fields.setdefault("memory_bytes", 4 << 30)
    fields.setdefault("remote_prefix", "bench")
    return StoreConfig(data_dir=data_dir, remote_url=url, **fields)


def _transfer(server: RedisNode, tmp: Path, num_tokens: int, repeats: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, 49152, num_tokens)
    kv = rng.standard_normal(MODEL.kv_shape(num_tokens)).astype(np.float16)
    with TieredStore(_config(server.url, tmp / "writer", remote_write_behind=False)) as writer:
        writer.store(tokens, kv, model=MODEL)
        assert writer.flush(120)  # the remote tier is fed after the disk's group commit
        chunk_sizes = [len(c) for c in _remote_chunks(writer, tokens)]
    seconds = []
    for _ in range(repeats):
        # A fresh store each time: nothing local, the memory tier too small to keep a chunk.
        with TieredStore(_config(server.url, None, memory_bytes=1)) as reader:
            t0 = time.perf_counter()
            covered, _, loaded = reader.load_arrays(tokens, model=MODEL)
            seconds.append(time.perf_counter() - t0)
            if covered != num_tokens or loaded.tobytes() != kv.tobytes():
                raise RuntimeError("the remote tier returned different KV")
            if reader.stats().get("chunk_hits.redis") != len(chunk_sizes):
                raise RuntimeError("the load did not come from the remote tier")
    return {
        "prefix_bytes": kv.nbytes,
        "remote_chunks": len(chunk_sizes),
        "remote_load_mb_s": round(kv.nbytes / statistics.median(seconds) / 1e6, 1),
        "redis_get_mb_s": round(_plain_get_mb_s(server, chunk_sizes, repeats), 1),
    }


def _remote_chunks(store: TieredStore, tokens: Any) -> list[bytes]:
    """The encoded records a full load of `tokens` reads from the remote tier (to size the plain-GET
    baseline): every chunk of an importance-layout block, a layered block's layer pack (not its
    key summaries)."""
    from kvstore.format.layered_block import stored_records
    from kvstore.keys import block_keys, namespace_digest

    remote = None if store.remote_link is None else store.remote_link.tier
    assert remote is not None
    keys = block_keys(tokens, store.config.block_tokens, MODEL.fingerprint, namespace_digest("default"))
    out: list[bytes] = []
    for meta in remote.get_metas(keys):
        assert meta is not None
        wanted = stored_records(meta, range(meta.num_chunks))
        out += [bytes(c) for c in remote.get_chunks(meta, wanted) if c is not None]
    return out


def _plain_get_mb_s(server: RedisNode, sizes: list[int], repeats: int) -> float:
    client = server.client()
    payload = np.random.default_rng(1).bytes(max(sizes))
    keys = [f"plain:{i}" for i in range(len(sizes))]
    for key, size in zip(keys, sizes, strict=True):
        client.set(key, payload[:size])
    seconds = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        pipe = client.pipeline(transaction=False)
        for key in keys:
            pipe.get(key)
        values = pipe.execute()
        seconds.append(time.perf_counter() - t0)
        assert sum(len(v) for v in values) == sum(sizes)
    client.delete(*keys)
    return sum(sizes) / statistics.median(seconds) / 1e6


def _store_latency(server: RedisNode, tmp: Path, num_tokens: int, repeats: int) -> dict[str, Any]:
    out = {}
    for name, behind in (("store_ms_write_behind", True), ("store_ms_sync", False)):
        rng = np.random.default_rng(2 if behind else 3)  # new prefixes: nothing is skipped as cached
        with TieredStore(_config(server.url, tmp / name, remote_write_behind=behind)) as store:
            seconds = []
            for _ in range(repeats):
                tokens = rng.integers(0, 49152, num_tokens)
                kv = rng.standard_normal(MODEL.kv_shape(num_tokens)).astype(np.float16)
                t0 = time.perf_counter()
                store.store(tokens, kv, model=MODEL)
                seconds.append(time.perf_counter() - t0)
                assert store.flush(120)  # the disk backlog, then the remote queue it feeds
            out[name] = round(statistics.median(seconds) * 1e3, 1)
    return out


def _ttft(server: RedisNode, tmp: Path, num_tokens: int) -> dict[str, Any]:
    from bench.common.texts import token_windows
    from bench.datapath.ttft_bench import _question, _ttft
    from engine_adapter.runner.engine import Engine
    from engine_adapter.runner.model import load_model

    lm = load_model(quiet=True)
    prompt = token_windows(lm.tokenizer, num_tokens, 1)[0][1] + _question(lm)
    recompute = statistics.median(_ttft(Engine(lm, None, collect_stats=False), prompt, 1.0) for _ in range(2))
    with TieredStore(_config(server.url, tmp / "engine-a", remote_prefix="ttft")) as first:
        Engine(lm, first).prefill(prompt)  # stores the prefix; closing drains it to Redis
    remote = []
    for attempt in range(2):
        with TieredStore(_config(server.url, tmp / f"engine-b{attempt}", remote_prefix="ttft")) as second:
            remote.append(_ttft(Engine(lm, second), prompt, 1.0))
            if second.stats().get("chunk_hits.redis") == 0:
                raise RuntimeError("the second engine did not load from the remote tier")
    return {
        "ttft_prompt_tokens": len(prompt),
        "ttft_recompute_s": round(recompute, 4),
        "ttft_remote_s": round(statistics.median(remote), 4),
    }
