"""Scenarios and measurements of kvsieve's SGLang backend, with SGLang's own code.

Imported by bench/sglang_hicache_driver.py inside the SGLang environment (torch,
SGLang); never imported by kvsieve's own venv. Every figure is an observation
(counts, byte comparisons); tests/test_sglang_hicache.py and bench/sglang_bench.py
judge them.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import statistics
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np
import torch
from sglang.srt.mem_cache.device_pool_info import (  # type: ignore[import-not-found]
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
    PoolName,
    PoolTransfer,
)
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # type: ignore[import-not-found]
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # type: ignore[import-not-found]
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-not-found]

from kvstore.client.kvclient import KVClient
from kvstore.model import ModelSpec


class Geometry(NamedTuple):
    layers: int
    heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


SMALL = Geometry(4, 2, 64, 16, torch.bfloat16)
SMOLLM2 = Geometry(30, 3, 64, 64, torch.float16)  # SmolLM2-135M's KV, SGLang's usual page size
_BLOCK_TOKENS = 256


def check_imports() -> None:
    """Import the backend as SGLang's factory would."""
    from engine_adapter.sglang.backend import KvsieveStorage

    assert issubclass(KvsieveStorage, HiCacheStorage)


# --- real components -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Sidecar:
    """A real `kvsieve serve` (kvsieve's interpreter), stoppable, pausable, restartable in place."""

    def __init__(
        self, python: str, data_dir: Path, block_tokens: int = 256, chunk_tokens: int = 16, *extra: str
    ) -> None:
        self.python, self.data_dir = python, data_dir
        self.block_tokens, self.chunk_tokens = block_tokens, chunk_tokens
        self.extra = list(extra)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Sidecar:
        cmd = [self.python, "-m", "kvstore.cli.main", "serve", "--listen", self.address]
        cmd += ["--metrics-listen", f"127.0.0.1:{_free_port()}", "--data-dir", str(self.data_dir)]
        cmd += ["--block-tokens", str(self.block_tokens), "--chunk-tokens", str(self.chunk_tokens)]
        cmd += ["--max-store-tokens", "65536", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_") and k != "PYTHONPATH"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        spec = ModelSpec("probe", 1, 1, 8)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited with {self.proc.returncode}")
            try:
                with KVClient(self.address, timeout_s=1) as client:
                    client.lookup([1], model=spec)
                return self
            except Exception:
                time.sleep(0.1)
        raise TimeoutError("kvsieve serve did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def mha_pool(geom: Geometry, layout: str, pages: int, seed: int | None = None) -> Any:
    """SGLang's MHA host pool on the CPU, `pages` pages, random KV when `seed` is given."""
    device_tokens = geom.page_size
    k = tuple(
        torch.zeros(device_tokens, geom.heads, geom.head_dim, dtype=geom.dtype) for _ in range(geom.layers)
    )
    v = tuple(
        torch.zeros(device_tokens, geom.heads, geom.head_dim, dtype=geom.dtype) for _ in range(geom.layers)
    )
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=geom.page_size,
        head_num=geom.heads,
        head_dim=geom.head_dim,
        v_head_dim=geom.head_dim,
        dtype=geom.dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, geom.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=geom.layers,
        host_token_capacity=pages * geom.page_size,
    )  # fmt: skip
    return _randomised(pool, seed)


def mla_pool(geom: Geometry, layout: str, pages: int, seed: int | None = None) -> Any:
    """SGLang's MLA host pool on the CPU (latent rank `head_dim`, rope 16)."""
    rope, device_tokens = 16, geom.page_size
    rows = tuple(
        torch.zeros(device_tokens, 1, geom.head_dim + rope, dtype=geom.dtype) for _ in range(geom.layers)
    )
    info = MLABufferInfo(
        buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(geom.layers)),
        device_layer_num=geom.layers, page_size=geom.page_size, kv_lora_rank=geom.head_dim,
        qk_rope_head_dim=rope, kv_cache_dim=geom.head_dim + rope, dtype=geom.dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, geom.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=geom.layers,
        target_layer_num=geom.layers, host_token_capacity=pages * geom.page_size,
    )  # fmt: skip
    return _randomised(pool, seed)


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _randomised(pool: Any, seed: int | None) -> Any:
    ints = pool.kv_buffer.view(torch.int16)
    if seed is None:
        ints.zero_()
    else:
        ints.random_(-(1 << 15), (1 << 15) - 1, generator=torch.Generator().manual_seed(seed))
    return pool


def token_major(pool: Any, page: int) -> torch.Tensor:
    """Page `page` of a pool as (K/V, layer, token, ...) bit patterns, read by SGLang's dims
    (`init_kv_buffer`): the order in which two layouts must agree, independent of the backend."""
    start = page * pool.page_size
    raw = pool.get_data_page(start, flat=False).view(torch.int16)
    mla = pool.kv_buffer.dim() == 4
    if pool.layout == "layer_first":
        return raw.clone()
    return (raw.transpose(0, 1) if mla else raw.transpose(1, 2)).clone()  # page_first


def storage_config(address: str, **overrides: Any) -> HiCacheStorageConfig:
    """SGLang's storage config for the dynamic backend; `kvsieve_*` and identity overrides."""
    extra = {
        "backend_name": "kvsieve",
        "module_path": "engine_adapter.sglang.backend",
        "class_name": "KvsieveStorage",
        "interface_v1": 1,
        "kvsieve_address": address,
        "kvsieve_timeout_s": 1.0,
        "kvsieve_retry_s": 0.2,
    }
    identity = {
        "tp_rank": 0,
        "tp_size": 1,
        "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "is_mla_model": False,
    }
    for key, value in overrides.items():
        (extra if key.startswith("kvsieve_") else identity)[key] = value
    return HiCacheStorageConfig(
        pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, enable_storage_metrics=False,
        is_page_first_layout=False, extra_config=extra, **identity,
    )  # fmt: skip


def attach(config: HiCacheStorageConfig, pool: Any) -> Any:
    """What SGLang's cache controller does: the factory by name, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def slots(pool: Any, first_page: int, count: int) -> torch.Tensor:
    """The host slots (token indices) of pages [first_page, first_page + count)."""
    ps = pool.page_size
    return torch.arange(first_page * ps, (first_page + count) * ps, dtype=torch.int64)


def pages_equal(a: Any, a_pages: range, b: Any, b_pages: range) -> list[bool]:
    return [torch.equal(token_major(a, i), token_major(b, j)) for i, j in zip(a_pages, b_pages, strict=True)]


# --- scenarios (tests/test_sglang_hicache.py) ---------------------------------------------------


def scenarios(python: str, work: Path, redis_url: str | None = None) -> dict[str, Any]:
    """Every behaviour the test checks, as observations (sharing through Redis when given a URL)."""
    sidecar = Sidecar(python, work / "sidecar").start()
    out: dict[str, Any] = {}
    try:
        source = mha_pool(SMALL, "layer_first", 160, seed=1)
        writer = attach(storage_config(sidecar.address), source)
        out["factory_class"] = f"{type(writer).__module__}.{type(writer).__qualname__}"
        out["is_hicache_storage"] = isinstance(writer, HiCacheStorage)
        keys = [f"page-{i:03d}-{os.getpid()}" for i in range(128)]
        out["set_v1"] = writer.batch_set_v1(keys, slots(source, 0, 128))
        out |= _roundtrips(sidecar, source, keys)
        out |= _generic(sidecar, source, writer)
        out["exists"] = {
            "all_128": writer.batch_exists(keys),
            "gap_after_5": writer.batch_exists([*keys[:5], "absent", *keys[5:10]]),
            "first_missing": writer.batch_exists(["absent", *keys[:4]]),
            "empty": writer.batch_exists([]),
            "one": writer.exists(keys[3]),
            "absent": writer.exists("absent"),
        }
        out["v2"] = _pool_group_methods(sidecar, source, keys)
        out["wrong_namespace"] = _foreign_readers(sidecar, keys)
        out["forged"] = _forged(sidecar, writer, keys)
        out["stopped"] = _stopped(sidecar, source, keys)
        out["paused"] = _paused(sidecar, keys)
        out["corrupt"] = _corrupt_on_disk(sidecar, source, keys)
        out["mla"] = _mla(sidecar)
        if redis_url:
            out["redis"] = _shared_through_redis(python, work, redis_url)
        out["stats"] = {"backup_pgs": writer.get_stats().backup_pgs, "clear": writer.clear()}
    finally:
        sidecar.stop()
    return out


def _roundtrips(sidecar: Sidecar, source: Any, keys: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("layer_first", "page_first"):
        target = mha_pool(SMALL, layout, 160)
        reader = attach(storage_config(sidecar.address), target)
        flags = reader.batch_get_v1(keys, slots(target, 16, 128))
        out[f"get_v1_{layout}"] = {
            "flags": flags,
            "equal": pages_equal(source, range(128), target, range(16, 144)),
            "untouched_before": bool(torch.all(target.kv_buffer[..., :16, :, :] == 0))
            if layout == "layer_first"
            else bool(torch.all(target.kv_buffer[:, :16] == 0)),
        }
        reader.close()
    return out


def _generic(sidecar: Sidecar, source: Any, writer: Any) -> dict[str, Any]:
    """The deprecated tensor methods, as SGLang's generic controller path calls them."""
    target = mha_pool(SMALL, "page_first", 8)
    reader = attach(storage_config(sidecar.address), target)
    keys = [f"generic-{i}-{os.getpid()}" for i in range(4)]
    stored = writer.batch_set(keys, [source.get_data_page(p * SMALL.page_size) for p in range(140, 144)])
    got = reader.batch_get(keys, [target.get_dummy_flat_data_page() for _ in keys])
    for page, flat in enumerate(got):
        if flat is not None:
            target.set_from_flat_data_page(page * SMALL.page_size, flat)
    single = reader.get("absent", target.get_dummy_flat_data_page())
    reader.close()
    return {
        "generic": {
            "batch_set": stored,
            "found": [g is not None for g in got],
            "equal": pages_equal(source, range(140, 144), target, range(4)),
            "absent_is_none": single is None,
            "set_one": writer.set(f"one-{os.getpid()}", source.get_data_page(150 * SMALL.page_size)),
        }
    }


def _pool_group_methods(sidecar: Sidecar, source: Any, keys: list[str]) -> dict[str, Any]:
    """SGLang's v2 methods (hybrid controllers): KV pages as v1, other pools always misses."""
    target = mha_pool(SMALL, "page_first", 8)
    reader = attach(storage_config(sidecar.address), target)
    kv = PoolTransfer(name=PoolName.KV, host_indices=slots(target, 0, 8), keys=keys[:8])
    mamba = PoolTransfer(name=PoolName.MAMBA, host_indices=slots(target, 0, 8), keys=keys[:8])
    exists = reader.batch_exists_v2(keys)
    with_mamba = reader.batch_exists_v2(keys, [mamba])
    got = reader.batch_get_v2([kv, mamba])
    out = {
        "exists_kv": exists.kv_hit_pages,
        "exists_with_mamba": with_mamba.kv_hit_pages,
        "get_kv": got[PoolName.KV],
        "get_mamba": got[PoolName.MAMBA],
        "equal": pages_equal(source, range(8), target, range(8)),
    }
    reader.close()
    return out


def _foreign_readers(sidecar: Sidecar, keys: list[str]) -> dict[str, Any]:
    """Readers that differ from the writer in one part of the identity each: they find nothing."""
    out: dict[str, Any] = {}
    variants: dict[str, dict[str, Any]] = {
        "namespace": {"kvsieve_namespace": "another-tenant"},
        "tp_rank": {"tp_rank": 1, "tp_size": 2},
        "model": {"model_name": "another/model"},
    }
    for name, overrides in variants.items():
        target = mha_pool(SMALL, "layer_first", 8)
        reader = attach(storage_config(sidecar.address, **overrides), target)
        flags = reader.batch_get_v1(keys[:8], slots(target, 0, 8))
        out[name] = {
            "exists": reader.batch_exists(keys),
            "loaded": sum(flags),
            "pool_untouched": bool(torch.all(target.kv_buffer == 0)),
        }
        reader.close()
    return out


def _forged(sidecar: Sidecar, writer: Any, keys: list[str]) -> dict[str, Any]:
    """A page filed under one key whose content is another key's (or damaged): refused."""
    fmt = writer.page_format
    carrier = fmt.new_carrier()
    fmt.page_view(carrier)[:] = 7
    fmt.seal(keys[0], carrier)  # keys[0]'s trailer, stored as "forged"
    forged_key = f"forged-{os.getpid()}"
    filed = writer.page_store.put(fmt, forged_key, carrier)
    target = mha_pool(SMALL, "layer_first", 1)
    reader = attach(storage_config(sidecar.address), target)
    flags = reader.batch_get_v1([forged_key], slots(target, 0, 1))
    out = {
        "filed": filed,
        "exists": reader.exists(forged_key),
        "loaded": flags,
        "rejected": reader.counters.rejected,
        "pool_untouched": bool(torch.all(target.kv_buffer == 0)),
    }
    reader.close()
    return out


def _stopped(sidecar: Sidecar, source: Any, keys: list[str]) -> dict[str, Any]:
    """The sidecar stops: every method is a miss, nothing raises, no v1 call returns None;
    it comes back (same data directory): pages are found again, restart included."""
    target = mha_pool(SMALL, "layer_first", 8)
    backend = attach(storage_config(sidecar.address), target)
    sidecar.stop()
    started = time.monotonic()
    out: dict[str, Any] = {
        "exists": backend.batch_exists(keys),
        "get_v1": backend.batch_get_v1(keys[:8], slots(target, 0, 8)),
        "set_v1": backend.batch_set_v1([f"during-{i}" for i in range(8)], slots(target, 0, 8)),
        "get": backend.get(keys[0], target.get_dummy_flat_data_page()),
        "set": backend.set("during", target.get_data_page(0)),
        "one_exists": backend.exists(keys[0]),
    }
    out["miss_s"] = round(time.monotonic() - started, 3)
    out["pool_untouched"] = bool(torch.all(target.kv_buffer == 0))
    out["offline"] = {job: _offline(sidecar, job) for job in ("fsck", "relayout")}  # while it is down
    sidecar.start()
    time.sleep(0.3)  # past kvsieve_retry_s
    out["after_restart_exists"] = backend.batch_exists(keys)
    out["after_restart_get_v1"] = sum(backend.batch_get_v1(keys[:8], slots(target, 0, 8)))
    out["after_restart_equal"] = pages_equal(source, range(8), target, range(8))
    backend.close()
    return out


def _offline(sidecar: Sidecar, job: str) -> dict[str, Any]:
    """`kvsieve fsck` or `kvsieve relayout --min-change 0` on the stopped sidecar's directory."""
    extra = ["--min-change", "0"] if job == "relayout" else []
    cmd = [
        sidecar.python,
        "-m",
        "kvstore.cli.main",
        job,
        "--data-dir",
        str(sidecar.data_dir),
        "--json",
        *extra,
    ]
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_") and k != "PYTHONPATH"}
    result = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=300)
    lines = result.stdout.strip().splitlines()
    report: dict[str, Any] = json.loads(lines[-1]) if result.returncode == 0 and lines else {}
    return {"returncode": result.returncode, "report": report}


def _paused(sidecar: Sidecar, keys: list[str]) -> dict[str, Any]:
    """The sidecar hangs (SIGSTOP): calls end within kvsieve_timeout_s as misses; SIGCONT: found again."""
    target = mha_pool(SMALL, "layer_first", 8)
    backend = attach(storage_config(sidecar.address), target)
    backend.batch_exists(keys[:1])  # channel up before the pause
    sidecar.pause()
    started = time.monotonic()
    try:
        out: dict[str, Any] = {
            "exists": backend.batch_exists(keys),
            "get_v1": backend.batch_get_v1(keys[:8], slots(target, 0, 8)),
        }
        out["miss_s"] = round(time.monotonic() - started, 3)
    finally:
        sidecar.resume()
    time.sleep(0.3)
    out["after_resume_exists"] = backend.batch_exists(keys)
    backend.close()
    return out


def _corrupt_on_disk(sidecar: Sidecar, source: Any, keys: list[str]) -> dict[str, Any]:
    """One byte of one page flipped in the sidecar's LMDB file: that page is a miss, its
    neighbours load, and the host pool keeps its old bytes where the page would have gone."""
    victim = 7
    sidecar.stop()
    needle = token_major(source, victim).reshape(-1)[:64].numpy().tobytes()  # canonical page head
    data_files = [p for p in (sidecar.data_dir).rglob("data.mdb")]
    flipped = 0
    for path in data_files:
        blob = bytearray(path.read_bytes())
        at = blob.find(needle)
        if at >= 0:
            blob[at + 10] ^= 0x40
            path.write_bytes(bytes(blob))
            flipped += 1
    sidecar.start()
    time.sleep(0.3)
    target = mha_pool(SMALL, "layer_first", 3)
    backend = attach(storage_config(sidecar.address), target)
    flags = backend.batch_get_v1(keys[victim - 1 : victim + 2], slots(target, 0, 3))
    out = {
        "flipped_files": flipped,
        "loaded": flags,
        "neighbours_equal": pages_equal(source, range(victim - 1, victim + 2, 2), target, range(0, 3, 2)),
        "victim_slot_untouched": bool(torch.all(token_major(target, 1) == 0)),
    }
    backend.close()
    return out


def _shared_through_redis(python: str, work: Path, redis_url: str) -> dict[str, Any]:
    """Two sidecars with their own disks and one Redis tier: pages one SGLang instance stored
    through the first are found and loaded by another instance through the second."""
    remote = (
        "--remote-url",
        redis_url,
        "--remote-prefix",
        f"sglang-{os.getpid()}",
        "--no-remote-write-behind",
    )
    first = Sidecar(python, work / "first", 256, 16, *remote).start()
    second = Sidecar(python, work / "second", 256, 16, *remote).start()
    try:
        source = mha_pool(SMALL, "page_first", 8, seed=9)
        writer = attach(storage_config(first.address), source)
        keys = [f"shared-{i}-{os.getpid()}" for i in range(8)]
        stored = writer.batch_set_v1(keys, slots(source, 0, 8))
        target = mha_pool(SMALL, "layer_first", 8)
        reader = attach(storage_config(second.address), target)
        out = {
            "set_v1": stored,
            "exists": reader.batch_exists(keys),
            "get_v1": reader.batch_get_v1(keys, slots(target, 0, 8)),
            "equal": pages_equal(source, range(8), target, range(8)),
        }
        writer.close()
        reader.close()
    finally:
        first.stop()
        second.stop()
    return out


def _mla(sidecar: Sidecar) -> dict[str, Any]:
    """MLA pools (one latent buffer), both layouts; pages shared by every TP rank."""
    source = mla_pool(SMALL, "page_first", 8, seed=5)
    writer = attach(storage_config(sidecar.address, is_mla_model=True, tp_rank=0, tp_size=2), source)
    keys = [f"mla-{i}-{os.getpid()}" for i in range(8)]
    out: dict[str, Any] = {"set_v1": writer.batch_set_v1(keys, slots(source, 0, 8))}
    target = mla_pool(SMALL, "layer_first", 8)
    reader = attach(storage_config(sidecar.address, is_mla_model=True, tp_rank=1, tp_size=2), target)
    out["get_v1_rank1"] = reader.batch_get_v1(keys, slots(target, 0, 8))
    out["equal"] = pages_equal(source, range(8), target, range(8))
    writer.close()
    reader.close()
    return out


# --- measurements (bench/sglang_bench.py) -------------------------------------------------------


def _paired_p50(ours: Callable[[], Any], theirs: Callable[[], Any], reps: int) -> tuple[float, float]:
    """p50 seconds of each, the two run alternately so that both see the same machine load."""
    times: tuple[list[float], list[float]] = ([], [])
    for _ in range(reps):
        for run, out in ((ours, times[0]), (theirs, times[1])):
            started = time.perf_counter()
            run()
            out.append(time.perf_counter() - started)
    return statistics.median(times[0]), statistics.median(times[1])


def measure(python: str, work: Path, *, quick: bool) -> dict[str, Any]:
    """The benchmark's figures: SmolLM2 pages of 64 tokens, against one real sidecar."""
    pages, reps = (16, 3) if quick else (64, 5)
    sidecar = Sidecar(python, work / "bench-sidecar").start()
    try:
        return _measure(sidecar, pages, reps)
    finally:
        sidecar.stop()


def _measure(sidecar: Sidecar, pages: int, reps: int) -> dict[str, Any]:
    geom = SMOLLM2
    source = mha_pool(geom, "layer_first", 2 * pages, seed=3)
    backend = attach(storage_config(sidecar.address, kvsieve_timeout_s=30.0), source)
    target = mha_pool(geom, "page_first", pages)
    reader = attach(storage_config(sidecar.address, kvsieve_timeout_s=30.0), target)
    spec = ModelSpec("SmolLM2-135M-Instruct", geom.layers, geom.heads, geom.head_dim, "float16")
    client = KVClient(sidecar.address, timeout_s=60)
    rng = np.random.default_rng(0)
    tokens_per_run = pages * geom.page_size
    kv = rng.integers(-(1 << 15), 1 << 15, spec.kv_shape(tokens_per_run), dtype=np.int16).view(np.float16)
    out: dict[str, Any] = {"pages": pages, "page_bytes": backend.page_format.page_bytes}

    # writes: fresh keys and fresh tokens every repetition, so every byte is really stored
    run = iter(range(1 << 30))
    ours_set, theirs_set = _paired_p50(
        lambda: backend.batch_set_v1(_keys(f"set{next(run)}", pages), slots(source, 0, pages)),
        lambda: client.store(rng.integers(0, 50000, tokens_per_run), kv, model=spec),
        reps,
    )
    out["batch_set_v1_vs_shm_store"] = round(theirs_set / ours_set, 3)

    keys = _keys("read", pages)
    backend.batch_set_v1(keys, slots(source, 0, pages))
    prefix = rng.integers(0, 50000, tokens_per_run)
    client.store(prefix, kv, model=spec)
    dest = np.empty_like(kv)

    def shm_load() -> None:
        with client.load(prefix, model=spec) as stream:
            _, loaded = stream.gather(spec)
            dest[...] = loaded

    ours_get, theirs_get = _paired_p50(
        lambda: reader.batch_get_v1(keys, slots(target, 0, pages)), shm_load, reps
    )
    out["batch_get_v1_vs_shm_load"] = round(theirs_get / ours_get, 3)
    target.kv_buffer.zero_()
    flags = reader.batch_get_v1(keys, slots(target, 0, pages))
    out["roundtrip_exact_page_first"] = all(flags) and all(
        pages_equal(source, range(pages), target, range(pages))
    )
    out["roundtrip_exact_layer_first"] = _layer_first_roundtrip(sidecar, source, keys)
    out["roundtrip_exact"] = out["roundtrip_exact_page_first"] and out["roundtrip_exact_layer_first"]

    many = _keys("exists", 128)
    for start in range(0, 128, pages):
        backend.batch_set_v1(many[start : start + pages], slots(source, 0, min(pages, 128 - start)))
    assert backend.batch_exists(many) == 128
    one_block = prefix[:_BLOCK_TOKENS]
    ours_exists, lookup = _paired_p50(
        lambda: backend.batch_exists(many), lambda: client.lookup(one_block, model=spec), 3 * reps
    )
    out["batch_exists_128_vs_lookup"] = round(ours_exists / lookup, 2)
    out |= {
        "batch_set_v1_mb_s": round(pages * out["page_bytes"] / ours_set / 1e6),
        "shm_store_mb_s": round(kv.nbytes / theirs_set / 1e6),
        "batch_get_v1_pages_s": round(pages / ours_get),
        "shm_load_pages_s": round(pages / theirs_get),
        "batch_exists_128_ms": round(ours_exists * 1e3, 3),
        "lookup_ms": round(lookup * 1e3, 3),
    }
    out["wrong_pages"] = _wrong_pages(sidecar, source, keys[: min(pages, 8)])
    client.close()
    reader.close()
    backend.close()
    return out


def _keys(tag: str, count: int) -> list[str]:
    return [f"{tag}-{i}-{os.getpid()}-{time.monotonic_ns()}" for i in range(count)]


def _layer_first_roundtrip(sidecar: Sidecar, source: Any, keys: list[str]) -> bool:
    target = mha_pool(SMOLLM2, "layer_first", len(keys))
    reader = attach(storage_config(sidecar.address), target)
    flags = reader.batch_get_v1(keys, slots(target, 0, len(keys)))
    reader.close()
    return all(flags) and all(pages_equal(source, range(len(keys)), target, range(len(keys))))


def _wrong_pages(sidecar: Sidecar, source: Any, keys: list[str]) -> int:
    """Pages handed to SGLang that are not the key's page: across wrong-namespace, forged and
    stopped-sidecar reads (each a miss), plus any page that loaded with other bytes."""
    wrong = 0
    n = len(keys)
    for overrides in ({"kvsieve_namespace": "another-tenant"}, {"tp_rank": 1, "tp_size": 2}):
        target = mha_pool(SMOLLM2, "layer_first", n)
        reader = attach(storage_config(sidecar.address, **overrides), target)
        wrong += sum(reader.batch_get_v1(keys, slots(target, 0, n)))
        wrong += 0 if bool(torch.all(target.kv_buffer == 0)) else n
        reader.close()
    target = mha_pool(SMOLLM2, "layer_first", n)
    reader = attach(storage_config(sidecar.address), target)
    fmt = reader.page_format
    carrier = fmt.new_carrier()
    fmt.seal(keys[0], carrier)
    reader.page_store.put(fmt, "forged", carrier)
    wrong += sum(reader.batch_get_v1(["forged"], slots(target, 0, 1)))
    sidecar.stop()
    wrong += sum(reader.batch_get_v1(keys, slots(target, 0, n)))
    wrong += 0 if bool(torch.all(target.kv_buffer == 0)) else n
    sidecar.start()
    time.sleep(0.3)
    flags = reader.batch_get_v1(keys, slots(target, 0, n))
    equal = pages_equal(source, range(n), target, range(n))
    wrong += sum(f and not e for f, e in zip(flags, equal, strict=True))
    reader.close()
    return wrong
