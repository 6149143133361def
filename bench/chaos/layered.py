"""The layered layout under chaos, for `kvsieve bench chaos`: LoadLayers streams and budgeted
loads against three sidecars that share one real Redis, two of them of different geometry.

Sidecars A and C store blocks in the layered layout with `layer_chunk_tokens` 8, sidecar B
with 16; all three share one redis-server on loopback and have data directories of their
own, so each reads the others' blocks through the shared tier. The same prompts are stored
through A and through B (the same tokens always have the same KV, as with a real model),
which is what once made the shared tier hand out one geometry's records under the other's
metadata. Meanwhile sidecars are SIGKILLed in the middle of LoadLayers streams and get one
bit flipped in a layer record or a key summary of their LMDB file while they are down.

Every chunk a LoadLayers read returns and every chunk of a Load (budget 0.5 and full) is
checked against the stored KV of its position: `wrong_kv_layered` counts reads that returned
anything else. Errors and misses are allowed (and counted); an INTERNAL status is counted
apart (`layered_internal_errors`): it means a bug, not a refusal.
"""

from __future__ import annotations

import contextlib
import random
import signal
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bench.chaos import faults
from bench.chaos.faults import BLOCK_TOKENS, MODEL, Prefix, make_prefix
from bench.common.redisd import RedisNode, server_binary
from bench.common.sidecar import Sidecar
from kvstore.client.kvclient import KVClient
from kvstore.config import store_data_file, store_lmdb_dir
from kvstore.errors import KVSieveError, RpcFailedError
from kvstore.format.key_summary import is_summary
from kvstore.format.layer_record import is_layer_record

GEOMETRIES = {"A": 8, "B": 16, "C": 8}  # sidecar -> layer_chunk_tokens
SEED_BASE = 2_000_000  # prompts of this phase never share a first token with the main phase's


@dataclass
class LayeredTally:
    """What the layered phase saw; the first two are published."""

    layered_loads_checked: int = 0
    wrong_kv_layered: int = 0
    layered_internal_errors: int = 0
    layered_load_errors: int = 0
    layered_loads_missed: int = 0
    layered_server_kills: int = 0
    layer_record_flips: int = 0
    summary_flips: int = 0
    layered_prefixes: int = 0
    layered_shared_tier: str = "not run"


class LayeredChaos:
    """Three sidecars on one Redis, the ground truth, and the tally."""

    def __init__(self, root: Path, redis_url: str | None, seed: int = 1) -> None:
        self.rng = random.Random(seed)
        self.tally = LayeredTally()
        self.prefixes: list[Prefix] = []
        remote = ["--remote-url", redis_url] if redis_url else []
        self.sidecars = {
            name: Sidecar(root / name, ["--metrics-listen", "", "--layout", "layered",
                                        "--layer-chunk-tokens", str(chunk), *remote])
            for name, chunk in GEOMETRIES.items()
        }  # fmt: skip
        for sidecar in self.sidecars.values():
            sidecar.start()

    def close(self) -> None:
        for sidecar in self.sidecars.values():
            sidecar.kill()

    # -- operations ---------------------------------------------------------------

    def store(self) -> None:
        prefix = make_prefix(SEED_BASE + len(self.prefixes), self.rng.randint(1, 3))
        self.prefixes.append(prefix)
        self.tally.layered_prefixes += 1
        for name in self.rng.sample(["A", "B"], self.rng.choice([1, 2])):  # often both geometries
            with contextlib.suppress(KVSieveError), self._client(name) as client:
                client.store(prefix.tokens, prefix.kv, model=MODEL)

    def load_layers(self, name: str) -> None:
        prefix = self.rng.choice(self.prefixes)
        try:
            with self._client(name) as client, client.open_layers(prefix.tokens, model=MODEL) as load:
                if load.matched_tokens == 0:
                    self.tally.layered_loads_missed += 1
                    return
                num_chunks = load.matched_tokens // load.chunk_tokens
                for layer in range(MODEL.num_layers):
                    load.key_summary(layer)
                    wanted = sorted(self.rng.sample(range(num_chunks), self.rng.randint(1, num_chunks)))
                    piece = load.read_layer(layer, wanted)
                    self._check_layer(prefix, load.matched_tokens, layer, piece.positions, piece.kv)
        except KVSieveError as exc:
            self._count_error(exc)

    def load_budget(self, name: str) -> None:
        prefix = self.rng.choice(self.prefixes)
        budget = self.rng.choice([0.5, 1.0])
        try:
            with self._client(name) as client:
                num_tokens, positions, kv = client.load_arrays(prefix.tokens, model=MODEL, budget=budget)
        except KVSieveError as exc:
            self._count_error(exc)
            return
        self.tally.layered_loads_checked += 1
        whole = len(prefix.tokens) // BLOCK_TOKENS * BLOCK_TOKENS
        if num_tokens == 0:
            self.tally.layered_loads_missed += 1
            return
        ok = num_tokens <= whole and len(positions) > 0 and int(positions.max()) < num_tokens
        ok = ok and _equal(kv, prefix.kv[:, :, :, positions, :])
        self.tally.wrong_kv_layered += not ok

    def kill_mid_stream(self) -> None:
        """SIGKILL a sidecar while a LoadLayers stream reads from it, flip a bit in one of its
        layer records or summaries, and start it again on the same data directory."""
        name = self.rng.choice(list(self.sidecars))
        sidecar = self.sidecars[name]
        reader = threading.Thread(target=self.load_layers, args=(name,))
        reader.start()
        time.sleep(self.rng.uniform(0.0, 0.05))
        assert sidecar.proc is not None
        sidecar.proc.kill()
        if sidecar.proc.wait(10) == -signal.SIGKILL:
            self.tally.layered_server_kills += 1
        reader.join(60)
        assert not reader.is_alive()
        self._flip(sidecar.data_dir)
        sidecar.start()

    def step(self) -> None:
        ops = ["store", "layers", "budget", "kill"]
        op = self.rng.choices(ops, weights=[20, 35, 35, 10])[0]
        if op == "store" or not self.prefixes:
            self.store()
        elif op == "layers":
            self.load_layers(self.rng.choice(list(self.sidecars)))
        elif op == "budget":
            self.load_budget(self.rng.choice(list(self.sidecars)))
        else:
            self.kill_mid_stream()

    def finish(self) -> None:
        """Every prefix once more, through every sidecar, both ways."""
        for name in self.sidecars:
            for _ in range(min(len(self.prefixes), 8)):
                self.load_layers(name)
                self.load_budget(name)

    # -- checks -------------------------------------------------------------------

    def _check_layer(self, prefix: Prefix, matched: int, layer: int, positions: Any, kv: Any) -> None:
        self.tally.layered_loads_checked += 1
        positions = np.asarray(positions)
        ok = len(positions) > 0 and int(positions.max()) < matched <= len(prefix.tokens)
        ok = ok and _equal(kv, prefix.kv[layer][:, :, positions, :])
        self.tally.wrong_kv_layered += not ok

    def _count_error(self, exc: KVSieveError) -> None:
        internal = isinstance(exc, RpcFailedError) and exc.code.name == "INTERNAL"
        self.tally.layered_internal_errors += internal
        self.tally.layered_load_errors += not internal

    def _client(self, name: str) -> KVClient:
        return KVClient(self.sidecars[name].address, use_shm=self.rng.random() < 0.5, timeout_s=10)

    def _flip(self, data_dir: Path) -> None:
        if not store_data_file(data_dir).exists():
            return
        lmdb_dir = store_lmdb_dir(data_dir)
        records = faults.chunk_records(lmdb_dir)
        summaries = [r for r in records if is_summary(r)]
        layers = [r for r in records if is_layer_record(r)]
        kind = self.rng.choice(["summary", "layer"])
        pool = summaries if kind == "summary" else layers
        if pool and faults.flip_record(lmdb_dir, self.rng.choice(pool), self.rng):
            if kind == "summary":
                self.tally.summary_flips += 1
            else:
                self.tally.layer_record_flips += 1


def _equal(got: Any, expected: Any) -> bool:
    return got.shape == expected.shape and bool(np.array_equal(got.view(np.uint16), expected.view(np.uint16)))


def run(seconds: float, seed: int = 1) -> dict[str, Any]:
    """The layered phase for `seconds`; the figures `kvsieve bench chaos` adds to its own."""
    with tempfile.TemporaryDirectory(dir=Path.home()) as tmp:
        root = Path(tmp)
        redis = RedisNode(root / "redis").start() if server_binary() else None
        shared = "one redis-server" if redis else "skipped: redis-server is not installed"
        chaos = LayeredChaos(root, None if redis is None else redis.url, seed)
        try:
            deadline = time.monotonic() + seconds
            while time.monotonic() < deadline:
                chaos.step()
            chaos.finish()
        finally:
            chaos.close()
            if redis is not None:
                redis.stop()
        chaos.tally.layered_shared_tier = shared
        return asdict(chaos.tally)
