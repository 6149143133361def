"""What server and client agree on about the connection itself."""

from __future__ import annotations

import ipaddress
from typing import Any


def channel_options(max_message_bytes: int) -> list[tuple[str, Any]]:
    """gRPC options shared by server and client: message limits and large HTTP/2 windows.

    The default 4 MiB message limit is below one block of SmolLM2 KV (5.9 MB).
    """
    return [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
        # Large flow-control windows keep a 47 MB load from stalling on window updates.
        ("grpc.http2.lookahead_bytes", 16 << 20),
        ("grpc.http2.bdp_probe", 1),
    ]


def is_loopback(target: str) -> bool:
    """Whether "HOST:PORT" or "unix:PATH" stays on this machine."""
    if target.startswith("unix:"):
        return True
    host = target.rsplit(":", 1)[0].strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
