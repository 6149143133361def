"""Reading an LMDB value where it lies: a view of the map, for a value the page cache holds whole.

After a restart the sidecar's memory tier is empty, but the pages of its data file are often still
in the kernel's page cache. Read with `pread` (kvstore/tiers/disk/pread.py) such a value is copied
into memory of the process first: 47 MB of a 2,048-token SmolLM2 prefix took 7.6 ms of `preadv`
at best on this VM, where the copy the load needs anyway (into the client's shared-memory arena)
takes about as long again. Viewed in LMDB's map, the load's own copy reads the page cache directly:
each byte is copied once. Mapping the pages costs little (fault-around maps 16 pages a fault:
47 MB hashed through a fresh map in 1.7-2.1 ms here, against 1.5 ms in memory already mapped).

Only a value whose every page is resident (`mincore`) is viewed: a page that is not would be read
from the disk by a fault, one readahead window at a time and with the GIL held (what `pread`
replaced), and an I/O error there is a SIGBUS, not an exception. A page evicted between the check
and the copy is read back by its fault: slower, still correct. The view is valid only while the
read transaction that located the value is open (LMDB reuses no page a reader can see) and the map
is not resized (the tier's map guard): callers hold both for as long as they use it.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import functools
import mmap

import numpy as np

PAGE_BYTES = mmap.PAGESIZE


@functools.cache
def _libc() -> ctypes.CDLL | None:
    """The C library, for `mincore`; None where it has none (then nothing is ever resident)."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
        libc.mincore.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p)
    except (OSError, AttributeError):
        return None
    return libc


def resident(address: int, nbytes: int) -> bool:
    """Whether the page cache holds every page of the mapped bytes [address, address + nbytes)
    (Linux `mincore`: asks the kernel, touches no page). False where it cannot tell."""
    libc = _libc()
    if libc is None or nbytes <= 0:
        return False
    start = address - address % PAGE_BYTES
    pages = -(-(address + nbytes - start) // PAGE_BYTES)
    vec = np.zeros(pages, np.uint8)
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(address + nbytes - start), vec.ctypes.data):
        return False  # ENOMEM: not all mapped; anything else: cannot tell
    return bool(np.all(vec & 1))


def view_at(address: int, nbytes: int) -> memoryview:
    """A read-only view of `nbytes` mapped bytes at `address` (nothing is read or copied). The
    caller keeps the mapping in place while the view is used."""
    return memoryview((ctypes.c_ubyte * nbytes).from_address(address)).cast("B").toreadonly()
