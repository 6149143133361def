"""Dynamo's standalone KV indexer as a process: the router-side consumer of kvsieve's KV events.

It runs from the venv `bench/events/setup_dynamo.sh` builds (ai-dynamo-runtime 1.6.1, no torch), as
`python -m dynamo.indexer`, subscribes to a publisher over ZMQ and answers `POST /query` with
the longest prefix of a token list that each worker holds (in tokens). Used by
tests/test_kv_events_dynamo.py and bench/events/events_bench.py.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from bench.common.sidecar import free_port

VENV_ENV = "KVSIEVE_DYNAMO_VENV"
DEFAULT_VENV = Path.home() / ".cache" / "kvsieve" / "dynamo-venv"
MODEL_NAME = "default"


def dynamo_python() -> Path | None:
    """The Python of the Dynamo venv ($KVSIEVE_DYNAMO_VENV or ~/.cache/kvsieve/dynamo-venv), or None."""
    python = Path(os.environ.get(VENV_ENV) or DEFAULT_VENV) / "bin" / "python"
    return python if python.exists() else None


@dataclass
class DynamoIndexer:
    """One `python -m dynamo.indexer` process on a free loopback port.

    Attributes:
        python: the Dynamo venv's interpreter.
        log_path: where its output goes (it logs every gap and replay).
    """

    python: Path
    log_path: Path
    port: int = 0
    proc: subprocess.Popen[bytes] | None = None

    def start(self, timeout_s: float = 60) -> DynamoIndexer:
        """Start it and wait until it answers HTTP."""
        self.port = self.port or free_port()
        cmd = [str(self.python), "-m", "dynamo.indexer", "--port", str(self.port), "--threads", "1"]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamo.indexer exited ({self.proc.returncode}); see {self.log_path}")
            try:
                self._request("GET", "/workers")
                return self
            except (urllib.error.URLError, ConnectionError):
                time.sleep(0.1)
        raise TimeoutError(f"dynamo.indexer did not answer within {timeout_s} s; see {self.log_path}")

    def register(self, instance_id: int, endpoint: str, replay_endpoint: str, block_size: int) -> None:
        """Subscribe to a publisher (with its replay socket, asked after any gap)."""
        self._request("POST", "/register", {
            "instance_id": instance_id, "endpoint": endpoint, "replay_endpoint": replay_endpoint,
            "model_name": MODEL_NAME, "block_size": block_size,
        })  # fmt: skip

    def matched(self, tokens: list[int], instance_id: int = 1, cache_salt: str | None = None) -> int:
        """Tokens of the longest prefix of `tokens` the indexer says `instance_id` holds."""
        body: dict[str, Any] = {"token_ids": tokens, "model_name": MODEL_NAME}
        if cache_salt is not None:
            body["cache_salt"] = cache_salt
        answer = self._request("POST", "/query", body)
        instance = answer.get("instances", {}).get(str(instance_id))
        return 0 if instance is None else int(instance["longest_matched"])

    def wait_matched(
        self, tokens: list[int], expected: int, timeout_s: float = 10, cache_salt: str | None = None
    ) -> int:
        """`matched`, asked again until it equals `expected` or `timeout_s` passed; the last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            got = self.matched(tokens, cache_salt=cache_salt)
            if got == expected or time.monotonic() > deadline:
                return got
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill it (its state lives in memory only)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)

    def _request(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}", data=data, method=method,
            headers={"Content-Type": "application/json"},
        )  # fmt: skip
        with urllib.request.urlopen(request, timeout=10) as reply:
            text = reply.read().decode()
        return json.loads(text) if text.strip().startswith(("{", "[")) else text
