"""Binding a gRPC server to its listen address, with TLS when configured: shared by the sidecar
and by any other server built on `ServerConfig` (the engine's RunProgram server)."""

from __future__ import annotations

import grpc

from kvstore.server.config import ServerConfig


def bind(server: grpc.aio.Server, config: ServerConfig) -> str:
    """Add `config.listen` to `server` (TLS when `tls_cert` and `tls_key` are set); returns the
    address clients reach (the port filled in when it was 0). Raises OSError if it cannot bind."""
    if config.tls_cert is not None and config.tls_key is not None:
        credentials = grpc.ssl_server_credentials(
            [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
        )
        port = server.add_secure_port(config.listen, credentials)
    else:
        port = server.add_insecure_port(config.listen)
    if config.listen.startswith("unix:"):
        return config.listen
    if port == 0:
        raise OSError(f"cannot listen on {config.listen}")
    return f"{config.listen.rsplit(':', 1)[0]}:{port}"
