"""Helpers of the hostile-client tests: raw stubs with a token, waiting on a condition."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import grpc

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import kvsieve_pb2_grpc as pb_grpc

TOKENS_TOML = '[server]\nauth_tokens = { "tok-a" = ["a"], "tok-b" = ["b"], "tok-admin" = ["*"] }\n'


def auth_sidecar(tmp_path: Path, *args: str) -> Sidecar:
    """A started sidecar where tok-a grants "a", tok-b grants "b", tok-admin grants all."""
    config = tmp_path / "kvsieve.toml"
    config.write_text(TOKENS_TOML)
    return Sidecar(tmp_path / "data", ["--config", str(config), *args]).start()


@contextmanager
def raw_stub(address: str) -> Iterator[pb_grpc.KVCacheStub]:
    """A KVCache stub on its own channel (no client-side validation in the way)."""
    with grpc.insecure_channel(address, options=[("grpc.max_send_message_length", 256 << 20)]) as channel:
        yield pb_grpc.KVCacheStub(channel)


def bearer(token: str) -> list[tuple[str, str]]:
    """Call metadata for `token`."""
    return [("authorization", f"Bearer {token}")]


def code_of(call: Callable[[], object]) -> grpc.StatusCode:
    """The status a call fails with (OK if it succeeds); iterates server streams."""
    try:
        result = call()
        if hasattr(result, "__next__"):
            list(result)  # type: ignore[call-overload]
    except grpc.RpcError as exc:
        return exc.code()  # type: ignore[no-any-return]
    return grpc.StatusCode.OK


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0) -> bool:
    """Poll `condition` until true; False after `timeout_s` (a bound on waiting, not on speed)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.05)
    return condition()


def rss_bytes(pid: int) -> int:
    """Resident set size of a process."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise LookupError("VmRSS")
