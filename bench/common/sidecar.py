"""A real `kvsieve serve` process on free loopback ports, for benchmarks and tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free when asked (tests and benchmarks share this one)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class Sidecar:
    data_dir: Path
    args: list[str] = field(default_factory=list)
    port: int = 0
    metrics_port: int = 0
    proc: subprocess.Popen[str] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Sidecar:
        self.port = self.port or free_port()
        while not self.metrics_port or self.metrics_port == self.port:  # nothing holds the first
            self.metrics_port = free_port()  # port yet: the kernel may hand out the same one again
        cmd = [sys.executable, "-m", "kvstore.cli.main", "serve", "--listen", self.address]
        cmd += [
            "--metrics-listen",
            f"127.0.0.1:{self.metrics_port}",
            "--data-dir",
            str(self.data_dir),
        ]
        cmd += ["--block-tokens", "32", "--chunk-tokens", "8", *self.args]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_")}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        self.wait_healthy()
        return self

    def wait_healthy(self, timeout_s: float = 30) -> None:
        deadline = time.monotonic() + timeout_s
        with grpc.insecure_channel(self.address) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                assert self.proc is not None
                if self.proc.poll() is not None:
                    raise RuntimeError(
                        f"server exited: {self.proc.stderr.read() if self.proc.stderr else ''}"
                    )
                try:
                    reply = stub.Check(health_pb2.HealthCheckRequest(service=""), timeout=1)
                    if reply.status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    time.sleep(0.1)
        raise TimeoutError("server did not become healthy")

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def terminate(self) -> tuple[int, str]:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGTERM)
        _out, err = self.proc.communicate(timeout=30)
        return self.proc.returncode, err
