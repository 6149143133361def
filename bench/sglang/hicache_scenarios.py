"""The scenarios tests/test_sglang_hicache.py checks, run with SGLang's own code.

Each returns observations (flags, counts, byte comparisons), never a verdict: the
test judges them. Run by `bench/sglang/hicache_driver.py scenarios`.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    PoolName,
    PoolTransfer,
)

from bench.sglang.hicache_parts import (
    SMALL,
    Sidecar,
    attach,
    mha_pool,
    mla_pool,
    pages_equal,
    slots,
    split_width_pool,
    storage_config,
    token_major,
)


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
        out["refused"] = _refused_pool(sidecar)
        if redis_url:
            out["redis"] = _shared_through_redis(python, work, redis_url)
        out["stats"] = {"backup_pgs": writer.get_stats().backup_pgs, "clear": writer.clear()}
    finally:
        sidecar.stop()
    return out


def _roundtrips(sidecar: Sidecar, source: Any, keys: list[str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for layout in ("layer_first", "page_first", "page_first_direct"):
        target = mha_pool(SMALL, layout, 160)
        reader = attach(storage_config(sidecar.address), target)
        flags = reader.batch_get_v1(keys, slots(target, 16, 128))
        others = [*range(16), *range(144, 160)]  # pages no slot of the call points at
        out[f"get_v1_{layout}"] = {
            "flags": flags,
            "equal": pages_equal(source, range(128), target, range(16, 144)),
            "untouched_before": all(bool(torch.all(token_major(target, p) == 0)) for p in others),
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
        "--sync-stores",  # the shared tier written before the Store returns (else after the disk commit)
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


def _refused_pool(sidecar: Sidecar) -> str:
    """A host pool the backend does not handle (K and V of different widths): attaching says
    so (SGLang then refuses to attach the storage), rather than storing pages it could misread.
    (SGLang's page_head and page_first_kv_split pools cannot be built on the CPU.)"""
    try:
        attach(storage_config(sidecar.address), split_width_pool(SMALL, 2))
    except ValueError as exc:
        return str(exc)
    return ""


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
