"""`kvsieve bench chaos`: stores and loads while the server, clients and disk misbehave.

Against a real `kvsieve serve` process on loopback, for a bounded time: stores,
loads inline and through shared memory, SIGKILLs of the server (mid-store; then a
restart on the same data directory) and of client processes (mid shared-memory
load), bit flips in chunk records and in block metadata records while the server
is down, then a full disk (a small tmpfs as the data directory, where this
machine can mount one), then the layered layout's own phase (bench/chaos/layered.py:
LoadLayers streams, flips in layer records and summaries, three sidecars of two
geometries on one Redis). Every load is checked against what was stored: a load may
miss, but any byte it returns must be the stored one (`wrong_kv` counts loads that
returned anything else, including KV for a prompt that was never stored).
"""

from __future__ import annotations

import contextlib
import os
import random
import select
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos import faults, layered
from bench.chaos.faults import BLOCK_TOKENS, MODEL, Prefix, make_prefix
from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import store_data_file, store_lmdb_dir
from kvstore.rpc import shm

SERVER_ARGS = ["--metrics-listen", ""]


@dataclass
class Tally:
    """What happened; the published figures are the first seven."""

    server_kills: int = 0
    client_kills: int = 0
    flips_injected: int = 0
    loads_checked: int = 0
    wrong_kv: int = 0
    server_crashes_unplanned: int = 0
    leaked_segments: int = 0
    chunk_flips: int = 0
    meta_token_flips: int = 0
    meta_byte_flips: int = 0
    wrong_kv_after_meta_flip: int = 0
    loads_missed: int = 0
    load_errors: int = 0
    stores_ok: int = 0
    store_errors: int = 0
    restarts_needing_fsck: int = 0
    disk_full: str = "not run"
    disk_full_store_errors: dict[str, int] = field(default_factory=dict)
    disk_full_server_survived: bool = False
    disk_full_restart: str = "not run"
    disk_full_stores_ok: int = 0
    disk_full_first_error: str = ""


class Chaos:
    """One run: the server, the ground truth, the clients, and the tally."""

    def __init__(self, data_dir: Path, seed: int = 0) -> None:
        self.data_dir = data_dir
        self.rng = random.Random(seed)
        self.tally = Tally()
        self.prefixes: list[Prefix] = []
        self.mutants: list[np.ndarray[Any, Any]] = []
        self.child_pids: set[int] = set()
        self.server = Sidecar(data_dir, list(SERVER_ARGS)).start()
        self.inline = KVClient(self.server.address, use_shm=False, timeout_s=10)
        self.shared = KVClient(self.server.address, use_shm=True, timeout_s=10)
        self._planned_down = False

    # -- operations ---------------------------------------------------------------

    def store(self, client: KVClient | None = None) -> None:
        prefix = make_prefix(len(self.prefixes) + 1, self.rng.randint(1, 4))
        self.prefixes.append(prefix)  # the truth, whether or not the store gets through
        try:
            (client or self.inline).store(prefix.tokens, prefix.kv, model=MODEL)
            self.tally.stores_ok += 1
        except Exception:
            self.tally.store_errors += 1

    def load(self, client: KVClient, tokens: np.ndarray[Any, Any], after_meta_flip: bool = False) -> None:
        try:
            num_tokens, positions, kv = client.load_arrays(tokens, model=MODEL)
        except Exception:
            self.tally.load_errors += 1
            return
        self.tally.loads_checked += 1
        if not self._correct(tokens, num_tokens, positions, kv):
            self.tally.wrong_kv += 1
            self.tally.wrong_kv_after_meta_flip += after_meta_flip
        elif num_tokens < len(tokens) // BLOCK_TOKENS * BLOCK_TOKENS:
            self.tally.loads_missed += 1

    def _correct(self, tokens: Any, num_tokens: int, positions: Any, kv: Any) -> bool:
        """Whether every returned token's KV is the one stored for this very prompt prefix."""
        if num_tokens == 0 and len(positions) == 0:
            return True
        best = max(self.prefixes, key=lambda p: _common_prefix(tokens, p.tokens))
        allowed = _common_prefix(tokens, best.tokens) // BLOCK_TOKENS * BLOCK_TOKENS
        if num_tokens > allowed or len(positions) == 0 or int(positions.max()) >= num_tokens:
            return False
        expected = best.kv[:, :, :, positions, :]
        return kv.shape == expected.shape and bool(
            np.array_equal(kv.view(np.uint16), expected.view(np.uint16))
        )

    def kill_client(self) -> None:
        proc = faults.start_client(self.server.address, len(self.child_pids))
        self.child_pids.add(proc.pid)
        assert proc.stdout is not None
        ready, _, _ = select.select([proc.stdout], [], [], 20)
        if ready and proc.stdout.readline().strip() == "ready":
            time.sleep(self.rng.uniform(0.05, 0.6))  # somewhere inside its store/load loop
        proc.kill()
        if proc.wait(10) == -signal.SIGKILL:
            self.tally.client_kills += 1

    def kill_server(self) -> None:
        """SIGKILL the server mid-store, damage the stopped store, restart on the same directory."""
        assert self.server.proc is not None
        writer = threading.Thread(target=self.store, args=(KVClient(self.server.address, timeout_s=10),))
        writer.start()
        time.sleep(self.rng.uniform(0.0, 0.05))
        self._planned_down = True
        self.server.proc.kill()
        if self.server.proc.wait(10) == -signal.SIGKILL:
            self.tally.server_kills += 1
        writer.join(30)
        assert not writer.is_alive()
        self._damage()
        self._restart()

    def _damage(self) -> None:
        lmdb_dir = store_lmdb_dir(self.data_dir)
        if not store_data_file(self.data_dir).exists():
            return
        kind = self.rng.choice(["none", "chunk", "meta_token", "meta_byte"])
        if kind == "chunk" and faults.flip_chunk_byte(lmdb_dir, self.rng):
            self.tally.chunk_flips += 1
        elif kind == "meta_token" and (flip := faults.flip_meta_token(lmdb_dir, self.prefixes, self.rng)):
            self.tally.meta_token_flips += 1
            self.mutants.append(flip.mutant)
        elif kind == "meta_byte" and faults.flip_meta_byte(lmdb_dir, self.rng):
            self.tally.meta_byte_flips += 1
        self.tally.flips_injected = (
            self.tally.chunk_flips + self.tally.meta_token_flips + self.tally.meta_byte_flips
        )

    def _restart(self) -> None:
        """Start again; a refusal to open a damaged store is followed by `kvsieve fsck --repair`."""
        try:
            self.server.start()
        except (RuntimeError, TimeoutError):
            self.tally.restarts_needing_fsck += 1
            cmd = [
                sys.executable,
                "-m",
                "kvstore.cli.main",
                "fsck",
                "--data-dir",
                str(self.data_dir),
                "--repair",
            ]
            subprocess.run(cmd, capture_output=True, timeout=120)
            try:
                self.server.start()
            except (RuntimeError, TimeoutError):
                self.tally.server_crashes_unplanned += 1
                self.server.kill()
                raise
        self._planned_down = False

    def check_alive(self) -> None:
        assert self.server.proc is not None
        if self.server.proc.poll() is not None and not self._planned_down:
            self.tally.server_crashes_unplanned += 1
            self._restart()

    def step(self) -> None:
        self.check_alive()
        ops = ["store", "load_inline", "load_shm", "probe", "kill_client", "kill_server"]
        op = self.rng.choices(ops, weights=[24, 24, 24, 8 if self.mutants else 0, 8, 12])[0]
        if op == "store" or not self.prefixes:
            self.store()
        elif op in ("load_inline", "load_shm"):
            client = self.inline if op == "load_inline" else self.shared
            self.load(client, self.rng.choice(self.prefixes).tokens)
        elif op == "probe":  # the prompt a flipped token id now names: must miss from that block on
            self.load(self.shared, self.rng.choice(self.mutants), after_meta_flip=True)
        elif op == "kill_client":
            self.kill_client()
        else:
            self.kill_server()

    def finish(self) -> None:
        """Check every prefix and mutant once more, close clients, count leaked segments."""
        self.check_alive()
        for prefix in self.prefixes:
            self.load(self.shared, prefix.tokens)
        for mutant in self.mutants:
            self.load(self.inline, mutant, after_meta_flip=True)
        self.inline.close()
        self.shared.close()
        self.server.terminate()
        mine = {str(os.getpid()), *map(str, self.child_pids)}
        self.tally.leaked_segments = sum(name.split("-")[1] in mine for name in shm.leaked_segments())


def _common_prefix(a: Any, b: Any) -> int:
    n = min(len(a), len(b))
    diff = np.flatnonzero(np.asarray(a[:n]) != np.asarray(b[:n]))
    return int(diff[0]) if len(diff) else n


def full_disk(root: Path, tally: Tally, seconds: float) -> None:
    """Fill a small tmpfs through the server: stores must fail cleanly, the server must survive."""
    mount = root / "tmpfs"
    with faults.small_tmpfs(mount, 8 << 20) as why_not:
        if why_not:
            tally.disk_full = f"skipped: {why_not}"
            return
        server = Sidecar(mount / "data", list(SERVER_ARGS))
        try:
            server.start()
        except (RuntimeError, TimeoutError) as exc:
            tally.disk_full = f"server did not start on an empty tmpfs: {str(exc)[-200:]}"
            return
        _fill(server, tally, seconds)
        tally.disk_full_server_survived = server.proc is not None and server.proc.poll() is None
        tally.server_crashes_unplanned += not tally.disk_full_server_survived
        server.kill()
        tally.disk_full_restart = _restart_on_full_disk(server)
        tally.server_crashes_unplanned += tally.disk_full_restart.startswith("killed by signal")
        tally.disk_full = "ran"


def _restart_on_full_disk(server: Sidecar) -> str:
    """A fresh server on the full filesystem: serving, a clean refusal, or death by a signal."""
    try:
        server.start()
    except (RuntimeError, TimeoutError) as exc:
        assert server.proc is not None
        code = server.proc.poll()
        if code is not None and code < 0:
            return f"killed by signal {signal.Signals(-code).name}"
        return f"refused (exit {code}): {' '.join(str(exc).split())[-160:]}"
    server.kill()
    return "serving"


def _fill(server: Sidecar, tally: Tally, seconds: float) -> None:
    from kvstore.errors import RpcFailedError

    deadline = time.monotonic() + seconds
    stored: list[Prefix] = []
    with KVClient(server.address, use_shm=False, timeout_s=10) as client:
        seed = 500_000
        while time.monotonic() < deadline and server.proc is not None and server.proc.poll() is None:
            seed += 1
            prefix = make_prefix(seed, 8)
            try:
                client.store(prefix.tokens, prefix.kv, model=MODEL)
                stored.append(prefix)
                tally.disk_full_stores_ok += 1
            except Exception as exc:
                code = exc.code.name if isinstance(exc, RpcFailedError) else type(exc).__name__
                tally.disk_full_first_error = tally.disk_full_first_error or " ".join(str(exc).split())[:200]
                tally.disk_full_store_errors[code] = tally.disk_full_store_errors.get(code, 0) + 1
        for prefix in stored[-5:]:  # what was stored before the disk filled still loads right
            with contextlib.suppress(Exception):
                num_tokens, positions, kv = client.load_arrays(prefix.tokens, model=MODEL)
                tally.loads_checked += 1
                ok = num_tokens == 0 or bool(np.array_equal(kv, prefix.kv[:, :, :, positions, :]))
                tally.wrong_kv += not ok


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench chaos --json` prints."""
    chaos_s, disk_s, layered_s = (20.0, 5.0, 15.0) if quick else (130.0, 15.0, 60.0)
    started = time.monotonic()
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        chaos = Chaos(Path(tmp) / "data")
        try:
            while time.monotonic() - started < chaos_s:
                chaos.step()
            chaos.finish()
        finally:
            chaos.server.kill()
        full_disk(Path(tmp), chaos.tally, disk_s)
    layered_figures = layered.run(layered_s)
    return {
        **asdict(chaos.tally),
        **layered_figures,
        "prefixes_stored": len(chaos.prefixes),
        "seconds": round(time.monotonic() - started, 1),
    }
