"""Binding a gRPC server to its listen address, with TLS when configured: shared by the sidecar
and by any other server built on `ServerConfig` (the engine's RunProgram server)."""

from __future__ import annotations

import errno
import socket

import grpc

from kvstore.errors import ListenError
from kvstore.server.config import ServerConfig


def bind(server: grpc.aio.Server, config: ServerConfig) -> str:
    """Add `config.listen` to `server` (TLS when `tls_cert` and `tls_key` are set); returns the
    address clients reach (the port filled in when it was 0).

    Raises:
        ListenError: the address is in use, or gRPC cannot listen there (one line that names it).
    """
    check_free(config.listen, "--listen")
    try:
        if config.tls_cert is not None and config.tls_key is not None:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
            )
            port = server.add_secure_port(config.listen, credentials)
        else:
            port = server.add_insecure_port(config.listen)
    except RuntimeError as exc:  # gRPC's "Failed to bind to address" (its C core logs the cause)
        raise ListenError(f"cannot listen on {config.listen}: {exc}") from exc
    if config.listen.startswith("unix:"):
        return config.listen
    if port == 0:
        raise ListenError(f"cannot listen on {config.listen}")
    return f"{config.listen.rsplit(':', 1)[0]}:{port}"


def check_free(listen: str, flag: str) -> None:
    """Raise `ListenError` when "HOST:PORT" `listen` is held by another socket on this machine.

    gRPC binds with SO_REUSEPORT: a second sidecar on the port of a first would share it without a
    word (the kernel spreading connections over two stores), and a port another program holds ends
    in a traceback of gRPC's. A probe of our own without SO_REUSEPORT tells both first. Port 0,
    unix sockets and names that do not resolve are left to gRPC.
    """
    host, _, port = listen.rpartition(":")
    if listen.startswith("unix:") or not port.isdigit() or int(port) == 0:
        return
    try:
        found = socket.getaddrinfo(host.strip("[]") or None, int(port), type=socket.SOCK_STREAM,
                                   flags=socket.AI_PASSIVE)  # fmt: skip
    except socket.gaierror:
        return
    for family, kind, proto, _, address in found:
        with socket.socket(family, kind, proto) as probe:
            probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as gRPC: TIME_WAIT is free
            try:
                probe.bind(address)
            except OSError as exc:
                if exc.errno == errno.EADDRINUSE:
                    continue
                return  # another reason (not this machine's address): gRPC says which
            return  # one address binds: gRPC listens there
    raise ListenError(
        f"{listen} is already in use (another kvsieve serve, or another program, listens there): "
        f"choose another {flag}"
    )
