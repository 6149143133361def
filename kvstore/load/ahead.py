"""Work done a few layers ahead of a layer-by-layer prefill, in one background thread.

A query-aware prefill asks for layer 0's key summary, then layer 1's, ... each a few
milliseconds of compute apart. Reading a summary (a disk read on a cold store), checking
it and decoding it does not depend on the queries, so a thread does it for the next
layers while the model computes the current one (numpy, torch and the disk reads release
the GIL). At 4,096 tokens these were ~20 ms of every layer's ~70 ms in the forward pass
(issue #27, item 5).

The thread stays at most `ahead` layers past the last one asked for, so a prefix of 8k
tokens holds a few layers' decoded keys (6 MB each), never all of them. A layer whose
work raised hands the exception to whoever asks for it; the thread stops there.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class LayersAhead(Generic[T]):
    """`get(layer)` returns `work(layer)`, computed in a background thread up to `ahead` layers early.

    Layers are computed in order 0, 1, ...; `get` of a layer the thread has not reached
    waits for it. Not for layers asked out of order far ahead: those wait for the ones before.
    """

    def __init__(self, work: Callable[[int], T], num_layers: int, ahead: int = 3) -> None:
        if ahead < 1 or num_layers < 0:
            raise ValueError(f"ahead must be >= 1 and num_layers >= 0, got {ahead}, {num_layers}")
        self._work, self._num_layers, self._ahead = work, num_layers, ahead
        self._done: dict[int, T | BaseException] = {}
        self._wanted = -1  # highest layer asked for
        self._stop = False
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="kvsieve-layers-ahead", daemon=True)
        self._thread.start()

    def get(self, layer: int) -> T:
        """Layer `layer`'s result (once: it is not kept). Raises what its work raised."""
        if not 0 <= layer < self._num_layers:
            raise IndexError(f"layer {layer} outside [0, {self._num_layers})")
        with self._cond:
            self._wanted = max(self._wanted, layer)
            self._cond.notify_all()
            while layer not in self._done:
                if self._stop:
                    raise RuntimeError("the background reader was stopped")
                self._cond.wait()
            result = self._done.pop(layer)
        if isinstance(result, BaseException):
            raise result
        return result

    def stop(self) -> None:
        """Stop the thread after its current layer and wait for it. Idempotent."""
        with self._cond:
            self._stop = True
            self._cond.notify_all()
        if self._thread is not threading.current_thread():
            self._thread.join()

    def _run(self) -> None:
        for layer in range(self._num_layers):
            with self._cond:
                while not self._stop and layer > self._wanted + self._ahead:
                    self._cond.wait()
                if self._stop:
                    return
            try:
                result: T | BaseException = self._work(layer)
            except BaseException as exc:  # handed to the asker: the prefill then recomputes
                result = exc
            with self._cond:
                self._done[layer] = result
                self._cond.notify_all()
                if isinstance(result, BaseException):
                    return
