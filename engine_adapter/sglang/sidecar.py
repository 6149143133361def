"""Pages in and out of a `kvsieve serve` sidecar, turning every failure into a miss.

`PageStore` is what the SGLang backend holds instead of a `KVClient`: it stores,
loads and looks up one page per call (pages.py says how a page becomes a block),
and it never raises. A call that fails (sidecar stopped, deadline passed, refused)
is a miss, logged, and opens a short window (`retry_s`) in which calls are misses
without trying, so a dead sidecar costs SGLang's threads no timeouts in a row;
the first call after the window builds a fresh channel, so the backend recovers as
soon as the sidecar is back, without waiting out gRPC's reconnect backoff.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import numpy as np

from engine_adapter.sglang.pages import PageFormat
from engine_adapter.sglang.settings import BackendSettings
from kvstore.client.kvclient import KVClient
from kvstore.errors import RpcFailedError

Array = np.ndarray[Any, Any]
logger = logging.getLogger(__name__)


@dataclass
class PageCounters:
    """What the backend did since it started (monotonic counts)."""

    stored: int = 0
    store_failed: int = 0
    hits: int = 0
    misses: int = 0
    rejected: int = 0  # came back, but not this key's intact page
    sidecar_errors: int = 0
    bytes_read: int = 0
    bytes_written: int = 0


class PageStore:
    """Pages of one namespace on one sidecar. Thread-safe; no method raises.

    Args:
        settings: where the sidecar is, how long to wait, the namespace.
        clock: monotonic seconds (injected by tests of the retry window).
    """

    def __init__(self, settings: BackendSettings, clock: Callable[[], float] = time.monotonic) -> None:
        self._settings = settings
        self._clock = clock
        self._lock = threading.Lock()
        self._client: KVClient | None = None
        self._down_until = 0.0
        self.counters = PageCounters()
        self._warned_short = False

    def put(self, fmt: PageFormat, key: str, carrier: Array) -> bool:
        """Store `key`'s sealed carrier (pages.py). True once the sidecar holds the whole page."""
        client = self._usable_client()
        if client is None:
            return self._count_store(False)
        try:
            result = client.store(
                fmt.tokens(key), carrier, model=fmt.spec, namespace=self._settings.namespace
            )
        except Exception as exc:  # any failure is a page not stored; SGLang carries on
            self._failed(client, "store", exc)
            return self._count_store(False)
        if result.num_tokens < fmt.tokens_per_page:
            self._warn_short(result.num_tokens, fmt.tokens_per_page)
            return self._count_store(False)
        with self._lock:
            self.counters.bytes_written += fmt.page_bytes
        return self._count_store(True)

    def fetch(self, fmt: PageFormat, key: str, consume: Callable[[Array], None]) -> bool:
        """Load `key`'s page and hand its bytes (uint8, valid only during the call) to `consume`.

        False, without calling `consume`, when the page is missing, short, corrupt, of
        another key, or the sidecar failed.
        """
        client = self._usable_client()
        if client is None:
            return self._count_read(False)
        try:
            with client.load(fmt.tokens(key), model=fmt.spec, namespace=self._settings.namespace) as stream:
                positions, kv = stream.gather(fmt.spec)
                complete = stream.num_tokens == fmt.tokens_per_page and np.array_equal(
                    positions, np.arange(fmt.tokens_per_page)
                )
                if not complete or not self._hand_over(fmt, key, kv, consume):
                    return self._count_read(False)
        except Exception as exc:  # a miss: SGLang recomputes the page
            self._failed(client, "load", exc)
            return self._count_read(False)
        with self._lock:
            self.counters.bytes_read += fmt.page_bytes
        return self._count_read(True)

    def fetch_many(
        self, fmt: PageFormat, keys: list[str], consume: Callable[[int, Array], None]
    ) -> list[bool] | None:
        """`fetch` of every key in one LoadMany stream: `consume(i, page bytes)` for each page
        found whole and intact; a success flag per key. None when the sidecar is older than
        LoadMany (fetch one by one instead)."""
        found = [False] * len(keys)
        client = self._usable_client()
        if client is not None and keys:
            try:
                lists = fmt.tokens_of(keys)
                for index, delivered, kv in client.load_many(
                    lists, model=fmt.spec, namespace=self._settings.namespace
                ):
                    if delivered == fmt.tokens_per_page:
                        found[index] = self._hand_over(
                            fmt, keys[index], kv, functools.partial(consume, index)
                        )
            except RpcFailedError as exc:
                if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                    return None
                self._failed(client, "load_many", exc)
            except Exception as exc:  # every page not handed over is a miss
                self._failed(client, "load_many", exc)
        hits = sum(found)
        with self._lock:
            self.counters.hits += hits
            self.counters.misses += len(keys) - hits
            self.counters.bytes_read += hits * fmt.page_bytes
        return found

    def _hand_over(self, fmt: PageFormat, key: str, kv: Array, consume: Callable[[Array], None]) -> bool:
        """Check a whole loaded carrier and give its page to `consume`; False if it is not intact."""
        carrier = np.ascontiguousarray(kv)  # the arena's slots may be strided
        if not fmt.check(key, carrier):
            logger.warning("kvsieve: page %s came back damaged or not its own: a miss", key)
            with self._lock:
                self.counters.rejected += 1
            return False
        try:
            consume(fmt.page_view(carrier))
        except Exception:  # the host pool refused it: that page is a miss, the batch goes on
            logger.exception("kvsieve: could not place page %s", key)
            return False
        return True

    def contains(self, fmt: PageFormat, key: str) -> bool:
        """Whether the sidecar holds the whole page of `key` (no data read)."""
        client = self._usable_client()
        if client is None:
            return False
        try:
            found = client.lookup(fmt.tokens(key), model=fmt.spec, namespace=self._settings.namespace)
        except Exception as exc:
            self._failed(client, "lookup", exc)
            return False
        return found.num_tokens >= fmt.tokens_per_page

    def leading(self, fmt: PageFormat, keys: list[str]) -> int | None:
        """How many of `keys`, from the first, the sidecar holds whole: one LookupMany call.

        None when the sidecar is older than LookupMany (ask `contains` per key instead);
        0 when it failed.
        """
        client = self._usable_client()
        if client is None or not keys:
            return 0
        lists = fmt.tokens_of(keys)
        try:
            return client.lookup_many(lists, model=fmt.spec, namespace=self._settings.namespace)
        except RpcFailedError as exc:
            if exc.code == grpc.StatusCode.UNIMPLEMENTED:
                return None
            self._failed(client, "lookup_many", exc)
        except Exception as exc:
            self._failed(client, "lookup_many", exc)
        return 0

    def close(self) -> None:
        """Close the channel (idempotent)."""
        with self._lock:
            client, self._client = self._client, None
        if client is not None:
            client.close()

    def _usable_client(self) -> KVClient | None:
        """The client, a fresh one after a failure window, or None while the window is open."""
        with self._lock:
            if self._client is not None:
                return self._client
            if self._clock() < self._down_until:
                return None
            try:
                self._client = KVClient(
                    self._settings.address,
                    token=self._settings.token or None,
                    root_certificates=self._settings.root_certificates(),
                    use_shm=self._settings.shm,
                    timeout_s=self._settings.timeout_s,
                )
            except Exception as exc:  # e.g. an unreadable CA file: every call is a miss
                logger.error("kvsieve: cannot open a channel to %s: %s", self._settings.address, exc)
                self._down_until = self._clock() + self._settings.retry_s
                return None
            return self._client

    def _failed(self, client: KVClient, what: str, exc: Exception) -> None:
        """Log, open the retry window and drop the channel (the next one starts afresh)."""
        logger.warning("kvsieve: %s failed at %s (%s): a miss", what, self._settings.address, exc)
        with self._lock:
            self.counters.sidecar_errors += 1
            self._down_until = self._clock() + self._settings.retry_s
            if self._client is client:
                self._client = None
            else:
                client = None  # type: ignore[assignment]  # another thread replaced it already
        if client is not None:
            with contextlib.suppress(Exception):  # closing a broken channel may fail too
                client.close()

    def _warn_short(self, stored: int, wanted: int) -> None:
        if not self._warned_short:
            self._warned_short = True
            logger.error(
                "kvsieve: the sidecar kept %d of a page's %d tokens: kvsieve_tokens_per_page must be "
                "a multiple of the sidecar's --block-tokens",
                stored,
                wanted,
            )

    def _count_store(self, ok: bool) -> bool:
        with self._lock:
            if ok:
                self.counters.stored += 1
            else:
                self.counters.store_failed += 1
        return ok

    def _count_read(self, ok: bool) -> bool:
        with self._lock:
            if ok:
                self.counters.hits += 1
            else:
                self.counters.misses += 1
        return ok
