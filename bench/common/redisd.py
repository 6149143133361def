"""Real redis-server processes on free loopback ports: one server, or a 3-node cluster.

Used by the test fixtures (tests/conftest.py) and `kvsieve bench remote`. The
cluster is formed with plain commands (CLUSTER ADDSLOTSRANGE, CLUSTER MEET), so
only redis-server (or valkey-server) is needed, not redis-cli.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from bench.common.sidecar import free_port

NUM_SLOTS = 16384
CLUSTER_BUS_OFFSET = 10000  # a cluster node also listens on port + 10000


def free_cluster_port() -> int:
    """A free loopback port whose cluster bus port (port + 10000) is free too."""
    import random
    import socket

    for _ in range(200):
        port = random.randrange(20000, 55000)
        try:
            with socket.socket() as a, socket.socket() as b:
                a.bind(("127.0.0.1", port))
                b.bind(("127.0.0.1", port + CLUSTER_BUS_OFFSET))
            return port
        except OSError:
            continue
    raise RuntimeError("no free port pair for a cluster node")


def server_binary() -> str | None:
    """Path of redis-server or valkey-server, or None if neither is installed."""
    return shutil.which("redis-server") or shutil.which("valkey-server")


@dataclass
class RedisNode:
    """One redis-server process; `cluster` starts it with cluster mode enabled."""

    workdir: Path
    port: int = 0
    cluster: bool = False
    maxmemory: str = "256mb"
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> RedisNode:
        binary = server_binary()
        if binary is None:
            raise RuntimeError("redis-server (or valkey-server) is not installed")
        self.port = self.port or (free_cluster_port() if self.cluster else free_port())
        self.workdir.mkdir(parents=True, exist_ok=True)
        cmd = [binary, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
               "--dir", str(self.workdir), "--maxmemory", self.maxmemory,
               "--maxmemory-policy", "allkeys-lru"]  # fmt: skip
        if self.cluster:
            cmd += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", "1000", "--cluster-require-full-coverage", "no"]  # fmt: skip
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self._wait_ping()
        return self

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def client(self) -> redis.Redis:
        # Timeouts and no retries: a server that did not start must fail the start, not hang it.
        return redis.Redis(
            port=self.port, socket_timeout=2, socket_connect_timeout=2, retry=Retry(NoBackoff(), 0)
        )

    def kill(self) -> int:
        """SIGKILL the server; returns its exit status (negative: the signal)."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGKILL)
        return self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.terminate()
            self.proc.wait(10)

    def _wait_ping(self) -> None:
        client = self.client()
        for _ in range(200):
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}")
            try:
                client.ping()
                return
            except (redis.ConnectionError, redis.TimeoutError):
                time.sleep(0.025)
        self.stop()
        raise RuntimeError(f"redis-server on port {self.port} did not start")


@dataclass
class LocalCluster:
    """A Redis Cluster of `size` primaries (no replicas) on loopback."""

    workdir: Path
    size: int = 3
    nodes: list[RedisNode] = field(default_factory=list)

    def start(self) -> LocalCluster:
        self.nodes = [RedisNode(self.workdir / f"node{i}", cluster=True).start() for i in range(self.size)]
        share = NUM_SLOTS // self.size
        for i, node in enumerate(self.nodes):
            last = NUM_SLOTS - 1 if i == self.size - 1 else (i + 1) * share - 1
            node.client().execute_command("CLUSTER", "ADDSLOTSRANGE", i * share, last)
        for node in self.nodes[1:]:
            self.nodes[0].client().execute_command("CLUSTER", "MEET", "127.0.0.1", node.port)
        self.wait_ok()
        return self

    @property
    def addresses(self) -> tuple[str, ...]:
        return tuple(n.address for n in self.nodes)

    def wait_ok(self, timeout_s: float = 30) -> None:
        """Wait until every running node reports cluster_state:ok and knows every node."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if all(self._node_ok(n) for n in self.nodes if n.proc is not None and n.proc.poll() is None):
                return
            time.sleep(0.05)
        raise RuntimeError("the redis cluster did not reach cluster_state:ok")

    def restart(self, index: int) -> None:
        """Start node `index` again on its port with its nodes.conf (its data is gone)."""
        node = self.nodes[index]
        node.start()
        self.wait_ok()

    def stop(self) -> None:
        for node in self.nodes:
            node.stop()

    def _node_ok(self, node: RedisNode) -> bool:
        try:
            info = node.client().execute_command("CLUSTER", "INFO")
        except redis.RedisError:
            return False
        text = info.decode() if isinstance(info, bytes) else str(info)
        known = f"cluster_known_nodes:{self.size}" in text
        return "cluster_state:ok" in text and known and "cluster_slots_assigned:16384" in text
