"""Where the connector's time goes: one JSON line per lookup, load and save copy.

Off unless `timings_path` is set (`kvsieve bench vllm` sets it). The scheduler
and the worker may live in different processes, so each appends its own lines
to the file (one `write` per line, O_APPEND: lines never interleave); the
reader attributes them to requests by order. Kept free of vLLM imports.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any


class TimingLog:
    """Appends timing records to `path`; does nothing when `path` is None.

    A record that cannot be written is dropped silently after the first failure
    is logged: timings must never cost a request.
    """

    def __init__(self, path: str | None, log: Any = None) -> None:
        self._fd = -1
        self._lock = threading.Lock()
        self._log = log
        if path is not None:
            self._fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)

    @property
    def enabled(self) -> bool:
        return self._fd >= 0

    def record(self, what: str, **fields: Any) -> None:
        """Append {"what": what, "pid": ..., "at": monotonic seconds, **fields}."""
        if self._fd < 0:
            return
        line = json.dumps({"what": what, "pid": os.getpid(), "at": time.monotonic(), **fields}) + "\n"
        try:
            with self._lock:
                os.write(self._fd, line.encode())
        except OSError:
            if self._log is not None:
                self._log.exception("kvsieve timings: cannot append to the timings file; no more records")
            self.close()

    @contextmanager
    def span(self, what: str, **fields: Any) -> Iterator[dict[str, Any]]:
        """Time the block and record it as `s`; the block may add fields to the yielded dict."""
        extra: dict[str, Any] = dict(fields)
        t0 = time.perf_counter()
        try:
            yield extra
        finally:
            if self._fd >= 0:
                self.record(what, s=time.perf_counter() - t0, **extra)

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


def read_records(path: Path, start: int = 0) -> tuple[list[dict[str, Any]], int]:
    """The records appended to `path` from byte `start` on, and the offset after the last whole line."""
    if not path.exists():
        return [], start
    with path.open("rb") as f:
        f.seek(start)
        data = f.read()
    end = data.rfind(b"\n") + 1
    records = [json.loads(line) for line in data[:end].splitlines() if line.strip()]
    return records, start + end
