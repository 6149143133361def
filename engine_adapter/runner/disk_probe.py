"""The disk's own rate, measured in the background when an engine opens a store: `start_disk_probe`.

Until a cold load had run, the cost model decided on a prior (1 GB/s): on the H200 machine the first
cold request split where recomputing was 30x faster (issue 47). A store that holds data at start
(the restart case, where cold loads happen) holds the very file to measure: the probe reads its
first `PROBE_BYTES` sequentially on a thread of its own and hands the rate to the cost model
(`CostModel.observe_disk_probe`); no request waits for it. It reads with O_DIRECT into a
page-aligned buffer, so the page cache neither serves it (it measures the device, not memory) nor
keeps what it read (the next cold load stays as cold as it was). Where O_DIRECT is refused (tmpfs,
some network file systems, macOS), or the file holds less than `MIN_PROBE_BYTES` (a new store: too
little to time, and nothing in it is cold yet), nothing is probed and the first cold load measures
the disk, as before; the engine asks again when a later request finds its prefix on disk.
"""

from __future__ import annotations

import mmap
import os
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kvstore.config import store_data_file
from kvstore.store.tiered import TieredStore

if TYPE_CHECKING:
    from engine_adapter.runner.costs import CostModel

#: Bytes the probe reads at most: ~0.15 s at 1.7 GB/s, long enough to pass the disk's first latency.
PROBE_BYTES = 256 << 20
#: Files smaller than this are not probed (the read would time the disk's latency, not its rate).
MIN_PROBE_BYTES = 16 << 20
#: One read: large and aligned, as O_DIRECT needs and a sequential read wants.
READ_BYTES = 8 << 20


def read_rate(
    path: Path, max_bytes: int = PROBE_BYTES, clock: Callable[[], float] = time.perf_counter
) -> float:
    """Bytes per second of a sequential O_DIRECT read of up to `max_bytes` from the start of `path`.

    Raises:
        OSError: O_DIRECT is refused here, or the file cannot be read.
    """
    direct = getattr(os, "O_DIRECT", 0)
    if not direct:
        raise OSError(f"O_DIRECT is not available on {os.name}")
    fd = os.open(path, os.O_RDONLY | direct)
    buffer = mmap.mmap(-1, READ_BYTES)  # page-aligned, as O_DIRECT needs
    try:
        total, t0 = 0, clock()
        while total < max_bytes and (n := os.readv(fd, [buffer])) > 0:
            total += n
        seconds = clock() - t0
    finally:
        buffer.close()
        os.close(fd)
    if total <= 0 or seconds <= 0:
        raise OSError(f"nothing timed reading {path} ({total} B in {seconds} s)")
    return total / seconds


class DiskProbe:
    """One background read of a file (`read_rate`), its rate handed to `report` from the probe's
    own thread. `join` waits (benchmarks, so that a timed request has the disk to itself)."""

    def __init__(
        self, path: Path, report: Callable[[float], None], max_bytes: int = PROBE_BYTES,
        clock: Callable[[], float] = time.perf_counter,
    ) -> None:  # fmt: skip
        self.path = path
        #: The rate measured (bytes/s), once done; None before, or if the probe failed (`error`).
        self.rate_bytes_s: float | None = None
        self.error = ""
        self._report, self._max_bytes, self._clock = report, max_bytes, clock
        self._thread = threading.Thread(target=self._run, name="kvsieve-disk-probe", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            rate = read_rate(self.path, self._max_bytes, self._clock)
        except OSError as exc:  # no rate: the first cold load measures the disk instead
            self.error = str(exc)
            return
        self.rate_bytes_s = rate
        self._report(rate)

    def join(self, timeout_s: float | None = None) -> bool:
        """Wait for the probe; True if it has finished."""
        self._thread.join(timeout_s)
        return not self._thread.is_alive()


def start_disk_probe(costs: CostModel, store: Any) -> DiskProbe | None:
    """Probe the disk under `store`'s data file for `costs`, once per cost model, where the store
    is embedded, has a disk and its file holds at least `MIN_PROBE_BYTES`; the probe, or None."""
    if costs.disk_probe is not None or not isinstance(store, TieredStore) or store.config.data_dir is None:
        return None
    path = store_data_file(store.config.data_dir)
    try:
        stat = path.stat()
    except OSError:
        return None
    on_disk = min(stat.st_size, stat.st_blocks * 512)  # allocated blocks: never time a sparse hole
    if on_disk < MIN_PROBE_BYTES:
        return None
    probe = DiskProbe(path, costs.observe_disk_probe, min(on_disk, PROBE_BYTES))
    costs.disk_probe = probe
    return probe
