"""Damaged and full disks give clean, documented outcomes, never a signal or a partial Store.

Real faults only: data.mdb truncated, emptied or overwritten on disk, a small tmpfs
mounted as the data directory and filled for real (skipped, with the reason, where
the machine does not allow mounting), and data.mdb unlinked under a live store.
"""

from __future__ import annotations

import errno
import functools
import json
import os
import struct
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import grpc
import lmdb
import numpy as np
import pytest
from conftest import kvsieve as run_kvsieve
from conftest import make_kv, make_tokens

from bench.common.sidecar import Sidecar, free_port
from kvstore.client.kvclient import KVClient
from kvstore.config import StoreConfig
from kvstore.errors import DamagedStoreError, RpcFailedError, StorageUnavailableError, StoreFullError
from kvstore.model import ModelSpec
from kvstore.offline.fsck import fsck
from kvstore.rpc.status import status_for
from kvstore.store.tiered import TieredStore
from kvstore.tiers.disk.datafile import storage_error

WIDE = ModelSpec("disk-test", num_layers=4, num_kv_heads=4, head_dim=64)  # 128 KiB per 32-token block


def config_for(data_dir: Path) -> StoreConfig:
    # Synchronous stores: a full disk fails the Store itself (write-behind: tests/test_write_behind.py)
    return StoreConfig(
        data_dir=data_dir, block_tokens=32, chunk_tokens=8, memory_bytes=64 << 20, sync_stores=True
    )


kvsieve = functools.partial(run_kvsieve, timeout=60)  # a store command that hangs is a failure here


def filled(data_dir: Path, prompts: int = 10) -> Path:
    """A store with `prompts` prompts of 320 tokens; returns its data.mdb."""
    with TieredStore(config_for(data_dir)) as s:
        for i in range(prompts):
            s.store(make_tokens(320, seed=i), make_kv(WIDE, 320, i), model=WIDE)
    return data_dir / "lmdb" / "data.mdb"


def serve(data_dir: Path) -> subprocess.CompletedProcess[str]:
    listen = f"127.0.0.1:{free_port()}"
    return kvsieve("serve", "--data-dir", str(data_dir), "--listen", listen, "--metrics-listen", "")


def assert_refused_everywhere(data_dir: Path, reason: str) -> None:
    """fsck exits 2 saying why; the store and the server refuse to open, naming data.mdb and fsck."""
    data_file = data_dir / "lmdb" / "data.mdb"
    size = data_file.stat().st_size
    result = kvsieve("fsck", "--data-dir", str(data_dir))
    assert result.returncode == 2, result
    assert reason in result.stdout and str(data_file) in result.stdout and not result.stderr
    result = kvsieve("fsck", "--data-dir", str(data_dir), "--repair", "--json")
    assert result.returncode == 2 and reason in json.loads(result.stdout)["unreadable"]
    with pytest.raises(DamagedStoreError, match=reason) as info:
        TieredStore(config_for(data_dir))
    assert str(data_file) in str(info.value) and "kvsieve fsck" in str(info.value)
    result = serve(data_dir)
    assert result.returncode == 2, result  # not -7 (SIGBUS): a message, then a clean exit
    assert str(data_file) in result.stderr and "kvsieve fsck" in result.stderr
    assert data_file.stat().st_size == size  # nobody "repaired" it into an empty store


def test_truncated_data_file_is_refused_not_a_sigbus(tmp_path: Path) -> None:
    data_file = filled(tmp_path / "data")
    os.truncate(data_file, data_file.stat().st_size // 2)
    assert_refused_everywhere(tmp_path / "data", "is truncated")


def test_zero_length_data_file_is_damage_not_an_empty_store(tmp_path: Path) -> None:
    data_file = filled(tmp_path / "data", prompts=1)
    os.truncate(data_file, 0)
    assert_refused_everywhere(tmp_path / "data", "is empty")


def test_data_file_that_is_not_lmdb_is_refused(tmp_path: Path) -> None:
    data_file = filled(tmp_path / "data", prompts=1)
    data_file.write_bytes(np.random.default_rng(0).bytes(data_file.stat().st_size))
    assert_refused_everywhere(tmp_path / "data", "no valid LMDB meta page")


def test_damage_behind_valid_meta_pages_never_kills_fsck(tmp_path: Path) -> None:
    data_file = filled(tmp_path / "data")
    size = data_file.stat().st_size
    with data_file.open("r+b") as f:  # keep both meta pages, scramble every B-tree page
        f.seek(2 * 4096)
        f.write(np.random.default_rng(1).bytes(size - 2 * 4096))
    result = kvsieve("fsck", "--data-dir", str(tmp_path / "data"), "--json")
    assert result.returncode == 2, result
    report = json.loads(result.stdout)
    assert report["unreadable"] or report["problems"]
    assert "Traceback" not in result.stderr


def test_value_pointing_past_the_end_is_a_bad_record_not_a_sigbus(tmp_path: Path) -> None:
    """py-lmdb touches every page of a value it hands out: a node claiming 256 MiB past the file's
    end was a SIGBUS in any process that read it. Values are located by their nodes and read with
    pread (kvstore/tiers/disk/locate.py): a short read, a record that fails its checksum."""
    data_file = filled(tmp_path / "data")
    env = lmdb.open(str(tmp_path / "data" / "lmdb"), max_dbs=4)
    with env.begin() as txn:
        first_chunk = next(iter(txn.cursor(db=env.open_db(b"chunks", txn=txn)).iternext(values=False)))
    env.close()
    image = bytearray(data_file.read_bytes())
    at = image.find(first_chunk)
    while at >= 0:  # every copy of its leaf node (LMDB keeps old page copies) now claims 256 MiB
        _lo, _hi, flags, key_size = struct.unpack_from("<HHHH", image, at - 8)
        if (flags, key_size) == (1, len(first_chunk)):  # F_BIGDATA node of this key
            struct.pack_into("<HH", image, at - 8, 0, (256 << 20) >> 16)
        at = image.find(first_chunk, at + 1)
    data_file.write_bytes(bytes(image))
    in_process = subprocess.run(
        [sys.executable, "-c", f"from kvstore.offline.fsck import fsck; fsck({str(tmp_path / 'data')!r})"],
        capture_output=True, timeout=60,
    )  # fmt: skip
    assert in_process.returncode == 0, in_process.stderr  # no signal, even unisolated
    result = kvsieve("fsck", "--data-dir", str(tmp_path / "data"))
    assert result.returncode == 2 and "bad-chunk" in result.stdout and "checksum mismatch" in result.stdout
    assert "Traceback" not in result.stderr


def test_deleted_data_file_fails_writes_instead_of_vanishing(tmp_path: Path) -> None:
    kept, lost = make_tokens(64, seed=1), make_tokens(64, seed=2)
    with TieredStore(config_for(tmp_path / "data")) as s:
        s.store(kept, make_kv(WIDE, 64, 1), model=WIDE)
        (tmp_path / "data" / "lmdb" / "data.mdb").unlink()
        with pytest.raises(StorageUnavailableError, match="deleted or replaced") as info:
            s.store(lost, make_kv(WIDE, 64, 2), model=WIDE)
        assert status_for(info.value) == grpc.StatusCode.UNAVAILABLE
        assert s.lookup(lost, model=WIDE).num_tokens == 0
        covered, _positions, kv = s.load_arrays(kept, model=WIDE)  # reads still come from the open map
        assert covered == 64 and kv.tobytes() == make_kv(WIDE, 64, 1).tobytes()


def test_replaced_data_file_fails_writes(tmp_path: Path) -> None:
    data_file = tmp_path / "data" / "lmdb" / "data.mdb"
    with TieredStore(config_for(tmp_path / "data")) as s:
        s.store(make_tokens(32, seed=1), make_kv(WIDE, 32, 1), model=WIDE)
        copy = data_file.with_suffix(".copy")
        copy.write_bytes(data_file.read_bytes())
        copy.replace(data_file)  # same name, another inode
        with pytest.raises(StorageUnavailableError, match="deleted or replaced"):
            s.store(make_tokens(32, seed=2), make_kv(WIDE, 32, 2), model=WIDE)


def test_write_errors_map_to_full_or_unavailable(tmp_path: Path) -> None:
    full = storage_error(errno.ENOSPC, "write failed", tmp_path)
    assert isinstance(full, StoreFullError) and status_for(full) == grpc.StatusCode.RESOURCE_EXHAUSTED
    broken = storage_error(errno.EIO, "write failed", tmp_path)  # EIO with free space: a real I/O error
    assert isinstance(broken, StorageUnavailableError) and status_for(broken) == grpc.StatusCode.UNAVAILABLE


def test_full_disk_store_is_store_full_and_keeps_nothing_of_the_call(
    tmpfs: Callable[[int], Path],
) -> None:
    data_dir = tmpfs(3 << 20) / "data"
    stored: list[int] = []
    with TieredStore(config_for(data_dir)) as s:
        with pytest.raises(StoreFullError, match="disk full") as info:
            for i in range(64):
                s.store(make_tokens(128, seed=i), make_kv(WIDE, 128, i), model=WIDE)
                stored.append(i)
        failed = len(stored)
        assert status_for(info.value) == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert stored and s.lookup(make_tokens(128, seed=failed), model=WIDE).num_tokens == 0
    with TieredStore(config_for(data_dir)) as s:  # reopens on the full disk
        assert s.lookup(make_tokens(128, seed=failed), model=WIDE).num_tokens == 0
        for i in stored:
            covered, _positions, kv = s.load_arrays(make_tokens(128, seed=i), model=WIDE)
            assert covered == 128 and kv.tobytes() == make_kv(WIDE, 128, i).tobytes()
    assert fsck(data_dir).clean


def test_full_disk_over_grpc_is_resource_exhausted_and_server_lives(
    tmpfs: Callable[[int], Path],
) -> None:
    server = Sidecar(tmpfs(3 << 20) / "data", ["--sync-stores"]).start()
    try:
        with KVClient(server.address, use_shm=False) as client:
            with pytest.raises(StoreFullError):  # RESOURCE_EXHAUSTED on the wire
                for i in range(64):
                    client.store(make_tokens(128, seed=i), make_kv(WIDE, 128, i), model=WIDE)
                    last = i
            assert client.lookup(make_tokens(128, seed=last + 1), model=WIDE).num_tokens == 0
            assert client.lookup(make_tokens(128, seed=0), model=WIDE).num_tokens == 128
        assert server.proc is not None and server.proc.poll() is None  # still serving
    finally:
        server.kill()


def test_fresh_server_on_a_full_disk_says_so(tmpfs: Callable[[int], Path]) -> None:
    mount = tmpfs(1 << 20)
    with (mount / "filler").open("wb") as f, pytest.raises(OSError) as info:
        while True:
            f.write(bytes(64 << 10))
            f.flush()
    assert info.value.errno == errno.ENOSPC
    result = serve(mount / "data")
    assert result.returncode == 2, result  # not -7 (SIGBUS on LMDB's lock file)
    assert "disk full" in result.stderr and "lock.mdb" in result.stderr


def test_store_created_on_a_nearly_full_disk_leaves_no_half_file(tmpfs: Callable[[int], Path]) -> None:
    mount = tmpfs(1 << 20)
    st = os.statvfs(mount)
    filler = os.open(mount / "filler", os.O_CREAT | os.O_RDWR)
    os.posix_fallocate(filler, 0, st.f_bavail * st.f_frsize - 36 * 1024)  # room for lock.mdb only
    os.close(filler)
    with pytest.raises(StoreFullError, match="disk full"):
        TieredStore(config_for(mount / "data"))
    assert not (mount / "data" / "lmdb" / "data.mdb").exists()  # not an empty file read as damage later
    (mount / "filler").unlink()
    with TieredStore(config_for(mount / "data")) as s:  # space back: it starts, empty
        s.store(make_tokens(32), make_kv(WIDE, 32), model=WIDE)
        assert s.lookup(make_tokens(32), model=WIDE).num_tokens == 32


def test_deleted_data_file_over_grpc_is_unavailable(tmp_path: Path) -> None:
    server = Sidecar(tmp_path / "data", ["--sync-stores"]).start()  # the write fails the Store
    try:
        with KVClient(server.address, use_shm=False) as client:
            client.store(make_tokens(32, seed=1), make_kv(WIDE, 32, 1), model=WIDE)
            (tmp_path / "data" / "lmdb" / "data.mdb").unlink()
            with pytest.raises(RpcFailedError) as info:
                client.store(make_tokens(32, seed=2), make_kv(WIDE, 32, 2), model=WIDE)
            assert info.value.code == grpc.StatusCode.UNAVAILABLE and "deleted" in str(info.value)
            assert client.lookup(make_tokens(32, seed=2), model=WIDE).num_tokens == 0
    finally:
        server.kill()
