"""Checks of an LMDB data file made before it is mapped, and the errors of its I/O.

LMDB maps `data.mdb` into memory. A file shorter than the pages its meta page
declares makes every read past the end a SIGBUS, which kills the process without
a word, and LMDB takes a zero-length file for a new, empty environment. So the
file is checked first, by reading its two meta pages with plain reads: a damaged
file is refused with a `DamagedStoreError` naming it and `kvsieve fsck`.

Meta page layout (LMDB 0.9, 64-bit): a 16-byte page header, then `mm_magic` (u32
0xBEEFC0DE), `mm_version` (u32), `mm_address`, `mm_mapsize`, two 48-byte
`MDB_db` records (the first one's leading u32 is the page size), `mm_last_pg`
and `mm_txnid` (u64 each). The meta page with the larger txnid is the current one.
"""

from __future__ import annotations

import errno
import os
import struct
from pathlib import Path
from typing import NamedTuple

import lmdb

from kvstore.errors import DamagedStoreError, StorageUnavailableError, StoreFullError

#: The file LMDB keeps its data in, inside its environment directory.
DATA_FILE = "data.mdb"

LMDB_MAGIC = 0xBEEFC0DE
_MAGIC_VERSION = struct.Struct("<II")  # at offset 16 of a meta page
_PAGE_SIZE = struct.Struct("<I")  # at offset 40
_LAST_PAGE_TXN = struct.Struct("<QQ")  # at offset 136
_META_END = 152
# Free space below which an EIO from a write is taken for a full disk: LMDB reports
# a short write (the last pages of a full file system) as EIO.
_FULL_DISK_SLACK = 1 << 20


class DataFileInfo(NamedTuple):
    """What the current meta page of a data file declares."""

    page_size: int
    last_page: int
    txnid: int
    file_bytes: int

    @property
    def required_bytes(self) -> int:
        """Bytes the file must hold for every declared page to be readable."""
        return (self.last_page + 1) * self.page_size


def check_data_file(path: Path) -> DataFileInfo:
    """Verify that an existing LMDB data file is whole enough to map.

    Raises:
        DamagedStoreError: the file is empty, not LMDB, or shorter than its declared pages.
        StorageUnavailableError: the file cannot be read at all (I/O error).
    """
    data_dir = path.parent.parent
    try:
        with path.open("rb") as f:
            size = os.fstat(f.fileno()).st_size
            head = f.read(2 * 65536)
    except OSError as exc:
        raise StorageUnavailableError(f"cannot read {path}: {exc.strerror}") from exc
    if size == 0:
        raise DamagedStoreError(f"{path} is empty (0 bytes), not an LMDB store", data_dir)
    first = _meta_at(head, 0)
    second = _meta_at(head, first[0] if first else 4096)
    metas = [m for m in (first, second) if m is not None]
    if not metas:
        raise DamagedStoreError(f"{path} has no valid LMDB meta page", data_dir)
    page_size, last_page, txnid = max(metas, key=lambda m: m[2])
    info = DataFileInfo(page_size, last_page, txnid, size)
    if size < info.required_bytes:
        raise DamagedStoreError(
            f"{path} is truncated: {size} bytes, but its pages need {info.required_bytes}", data_dir
        )
    return info


def _meta_at(head: bytes, offset: int) -> tuple[int, int, int] | None:
    """(page size, last page, txnid) of the meta page at `offset`, or None if invalid."""
    if offset + _META_END > len(head):
        return None
    magic, _version = _MAGIC_VERSION.unpack_from(head, offset + 16)
    page_size = _PAGE_SIZE.unpack_from(head, offset + 40)[0]
    if magic != LMDB_MAGIC or page_size < 512 or page_size & (page_size - 1):
        return None
    last_page, txnid = _LAST_PAGE_TXN.unpack_from(head, offset + 136)
    return int(page_size), int(last_page), int(txnid)


def reserve_lock_file(path: Path, max_readers: int) -> None:
    """Allocate LMDB's lock file on disk before LMDB maps it.

    LMDB sizes `lock.mdb` with ftruncate and writes its reader table through a
    mapping: on a full file system the first write is a SIGBUS. Allocating the
    blocks first turns that into a clean `StoreFullError`.
    """
    size = 64 * (max_readers + 4)  # one 64-byte slot per reader, plus the table header
    fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        if os.fstat(fd).st_size < size:
            os.posix_fallocate(fd, 0, size)
    except OSError as exc:
        raise storage_error(exc.errno, f"cannot allocate {path}: {exc.strerror}", path.parent) from exc
    finally:
        os.close(fd)


def write_error(exc: lmdb.Error, env_dir: Path) -> Exception:
    """The domain error for a failed LMDB write: full disk or storage unavailable."""
    if isinstance(exc, lmdb.DiskError):
        code = errno.ENOSPC
    elif "Input/output error" in str(exc):
        code = errno.EIO
    else:
        code = None
    return storage_error(code, f"LMDB write under {env_dir} failed: {exc}", env_dir)


def storage_error(code: int | None, message: str, env_dir: Path) -> Exception:
    """StoreFullError for a full disk (ENOSPC, EDQUOT, or EIO with no free space), else unavailable."""
    if code in (errno.ENOSPC, errno.EDQUOT) or (code == errno.EIO and _nearly_full(env_dir)):
        return StoreFullError(f"disk full: {message}; nothing of this call was kept")
    return StorageUnavailableError(f"{message}; nothing of this call was kept")


def _nearly_full(directory: Path) -> bool:
    try:
        st = os.statvfs(directory)
    except OSError:
        return False
    return st.f_bavail * st.f_frsize < _FULL_DISK_SLACK
