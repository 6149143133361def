"""`kvsieve engine` as a tenant boundary: bind rules, bearer tokens, the namespace from the token,
and a stream that always ends, on the real model and real gRPC servers (engine and sidecar)."""

from __future__ import annotations

import json
import subprocess
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest
from conftest import ServerInThread, kvsieve

from bench.common.sidecar import Sidecar
from kvstore._generated.kvsieve.v1 import engine_pb2 as pb
from kvstore._generated.kvsieve.v1 import engine_pb2_grpc as pb_grpc
from kvstore.client.kvclient import KVClient
from kvstore.server.config import ServerConfig

SYSTEM_TEXT = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"
USER_TEXT = "Name three colours of the rainbow, please, in one short line of text."
PROGRAM = (
    f'program p() {{\n  system "{SYSTEM_TEXT}"\n  user "{USER_TEXT}"\n  a = gen(max_tokens=3)\n  yield a\n}}'
)
TOKENS = {"tok-a": ["tenant-a"], "tok-b": ["tenant-b"], "ops": ["*"]}
ENGINE_STORE_TOKEN = "engine-secret"


def test_non_loopback_engine_without_auth_is_refused() -> None:
    result = kvsieve("engine", "--listen", "0.0.0.0:0")
    assert result.returncode == 2 and "without auth_tokens" in result.stderr
    assert "Traceback" not in result.stderr


def test_non_loopback_engine_without_tls_is_refused() -> None:
    result = kvsieve("engine", "--listen", "0.0.0.0:0", "--auth-tokens", "tok-a=tenant-a")
    assert result.returncode == 2 and "without TLS" in result.stderr and "tls_cert" in result.stderr


class EngineThread:
    """An engine server on a free loopback port, served by an event loop in a thread."""

    def __init__(self, engine: Any, config: ServerConfig, root_cert: bytes | None = None) -> None:
        from engine_adapter.server import start_engine

        self.server = ServerInThread(start_engine(engine, config))
        self.target = "127.0.0.1:" + self.server.address.rsplit(":", 1)[1]
        if root_cert is None:
            self.channel = grpc.insecure_channel(self.target)
        else:  # the certificate is for "localhost"
            options = [("grpc.ssl_target_name_override", "localhost")]
            self.channel = grpc.secure_channel(self.target, grpc.ssl_channel_credentials(root_cert), options)
        self.stub = pb_grpc.EngineStub(self.channel)

    def run(self, token: str | None, namespace: str = "", timeout: float = 120) -> list[pb.ProgramEvent]:
        metadata = [("authorization", f"Bearer {token}")] if token else []
        request = pb.RunProgramRequest(source=PROGRAM, namespace=namespace)
        return list(self.stub.RunProgram(request, metadata=metadata, timeout=timeout))

    def close(self) -> None:
        self.channel.close()
        self.server.stop()


@pytest.fixture(scope="module")
def lm():  # type: ignore[no-untyped-def]
    from engine_adapter.runner.model import load_model

    return load_model(quiet=True)


@pytest.fixture
def sidecar(tmp_path: Path) -> Iterator[Sidecar]:
    server = Sidecar(tmp_path / "data", ["--auth-tokens", f"{ENGINE_STORE_TOKEN}=*"]).start()
    yield server
    server.kill()


@pytest.fixture
def engine_server(lm, sidecar: Sidecar) -> Iterator[EngineThread]:  # type: ignore[no-untyped-def]
    from engine_adapter.runner.engine import Engine

    store = KVClient(sidecar.address, token=ENGINE_STORE_TOKEN, timeout_s=30)
    server = EngineThread(Engine(lm, store), ServerConfig(listen="127.0.0.1:0", auth_tokens=TOKENS))
    yield server
    server.close()
    store.close()


def _prompt_ids(lm) -> list[int]:  # type: ignore[no-untyped-def]
    """The program's first prompt as the executor tokenizes it (messages, then the assistant turn)."""
    text = (
        f"<|im_start|>system\n{SYSTEM_TEXT}<|im_end|>\n<|im_start|>user\n{USER_TEXT}<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    return list(lm.tokenizer.encode(text, add_special_tokens=False))


@pytest.mark.model
@pytest.mark.slow
def test_a_caller_needs_a_valid_token(engine_server: EngineThread) -> None:
    for token in (None, "wrong", "tok-a-but-longer"):
        with pytest.raises(grpc.RpcError) as info:
            engine_server.run(token, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, token


@pytest.mark.model
@pytest.mark.slow
def test_the_namespace_comes_from_the_token(engine_server: EngineThread, sidecar: Sidecar, lm) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(grpc.RpcError) as info:  # tenant A names tenant B's namespace
        engine_server.run("tok-a", namespace="tenant-b", timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    with pytest.raises(grpc.RpcError) as info:  # a token of many namespaces must say which
        engine_server.run("ops", timeout=30)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED and "name one" in info.value.details()
    events = engine_server.run("tok-a")
    assert [e.kind for e in events] == ["yield", "done"] and json.loads(events[0].value_json)
    ids = _prompt_ids(lm)
    assert len(ids) > 32  # at least one full block of the sidecar (32 tokens) was stored
    with KVClient(sidecar.address, token=ENGINE_STORE_TOKEN) as admin:
        found = {ns: admin.lookup(ids, model=lm.spec, namespace=ns).num_tokens
                 for ns in ("tenant-a", "tenant-b", "default")}  # fmt: skip
    assert found["tenant-a"] >= 32 and found["tenant-b"] == 0 and found["default"] == 0


@pytest.mark.model
@pytest.mark.slow
def test_the_stream_ends_with_an_error_when_the_store_dies(
    engine_server: EngineThread, sidecar: Sidecar
) -> None:
    assert sidecar.proc is not None
    sidecar.proc.kill()
    assert sidecar.proc.wait(10) == -9  # really gone: every store call of the run now fails
    events = engine_server.run("tok-b", timeout=120)  # before the fix: DEADLINE_EXCEEDED after 120 s
    assert events and events[-1].kind == "error"
    assert "UNAVAILABLE" in json.loads(events[-1].value_json)
    assert "\n" not in json.loads(events[-1].value_json)


@pytest.mark.model
@pytest.mark.slow
def test_a_network_engine_with_tokens_and_tls_serves_only_tls_clients(lm, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import shutil

    from engine_adapter.runner.engine import Engine

    if shutil.which("openssl") is None:
        pytest.skip("openssl not installed")
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        ["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=localhost",
         "-addext", "subjectAltName=DNS:localhost", "-keyout", str(key), "-out", str(cert)],
        check=True, capture_output=True,
    )  # fmt: skip
    config = ServerConfig(listen="0.0.0.0:0", auth_tokens=TOKENS, tls_cert=cert, tls_key=key)
    server = EngineThread(Engine(lm, None), config, root_cert=cert.read_bytes())
    try:
        assert server.server.address.startswith("0.0.0.0:")  # a network address, accepted with TLS + tokens
        with pytest.raises(grpc.RpcError) as info:
            server.run(None, timeout=30)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert [e.kind for e in server.run("tok-a")] == ["yield", "done"]
        with grpc.insecure_channel(server.target) as plain:  # plaintext is not spoken at all
            request = pb.RunProgramRequest(source=PROGRAM)
            metadata = [("authorization", "Bearer tok-a")]
            with pytest.raises(grpc.RpcError) as info:
                list(pb_grpc.EngineStub(plain).RunProgram(request, metadata=metadata, timeout=10))
            assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    finally:
        server.close()
