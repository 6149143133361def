"""The backend's settings, read from SGLang's `--hicache-storage-backend-extra-config` JSON.

SGLang hands the parsed JSON to the backend as `HiCacheStorageConfig.extra_config`;
its own keys (`backend_name`, `module_path`, `class_name`, `interface_v1`, and
SGLang's prefetch tuning keys) are left to SGLang. Ours are listed in
`BackendSettings`; `KVSIEVE_SGLANG_*` variables of the same names (upper case)
fill what the JSON leaves out, so a token need not appear on a command line.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

_ENV_PREFIX = "KVSIEVE_SGLANG_"


@dataclass(frozen=True)
class BackendSettings:
    """Where the sidecar is and how pages are named there.

    Attributes:
        address: "HOST:PORT" or "unix:PATH" of a `kvsieve serve`.
        token: bearer token, when the sidecar requires one.
        tls_ca_file: PEM CA bundle: TLS to the sidecar (none: plaintext).
        namespace: kvsieve namespace of the pages (tenant / cache salt).
        use_shm: "auto" (shared memory when the sidecar is on this host), "true" or "false".
        timeout_s: deadline of every sidecar call; a call past it is a miss.
        retry_s: after the sidecar failed, calls are misses without trying for this long.
        tokens_per_page: synthetic tokens per page: a multiple of the sidecar's block_tokens.
        workers: parallel sidecar calls of one batch.
    """

    address: str = "127.0.0.1:50051"
    token: str = ""
    tls_ca_file: str = ""
    namespace: str = "sglang"
    use_shm: str = "auto"
    timeout_s: float = 5.0
    retry_s: float = 1.0
    tokens_per_page: int = 256
    workers: int = 4

    def __post_init__(self) -> None:
        if not self.address:
            raise ValueError("kvsieve_address must name the sidecar, e.g. 127.0.0.1:50051")
        if self.use_shm not in ("auto", "true", "false"):
            raise ValueError(f"kvsieve_use_shm must be 'auto', 'true' or 'false', got {self.use_shm!r}")
        if not 0 < self.timeout_s <= 600:
            raise ValueError(f"kvsieve_timeout_s must be in (0, 600], got {self.timeout_s}")
        if not 0 <= self.retry_s <= 600:
            raise ValueError(f"kvsieve_retry_s must be in [0, 600], got {self.retry_s}")
        if not 4 <= self.tokens_per_page <= 65536:  # the first 4 tokens carry the key's digest
            raise ValueError(f"kvsieve_tokens_per_page must be in [4, 65536], got {self.tokens_per_page}")
        if not 1 <= self.workers <= 64:
            raise ValueError(f"kvsieve_workers must be in [1, 64], got {self.workers}")
        if not self.namespace or len(self.namespace) > 256:
            raise ValueError(f"kvsieve_namespace must be 1..256 characters, got {self.namespace!r}")

    @property
    def shm(self) -> bool | str:
        """`KVClient`'s use_shm argument."""
        return "auto" if self.use_shm == "auto" else self.use_shm == "true"

    def root_certificates(self) -> bytes | None:
        """The CA bundle's bytes, or None for plaintext."""
        if not self.tls_ca_file:
            return None
        with open(self.tls_ca_file, "rb") as handle:
            return handle.read()

    @classmethod
    def from_extra_config(
        cls, extra: Mapping[str, Any] | None, env: Mapping[str, str] | None = None
    ) -> BackendSettings:
        """Settings from the extra config's `kvsieve_*` keys, then `KVSIEVE_SGLANG_*` variables.

        Raises:
            ValueError: a value of the wrong type or out of range (the key is named).
        """
        extra = extra or {}
        env = os.environ if env is None else env
        values: dict[str, Any] = {}
        for field in fields(cls):
            key = f"kvsieve_{field.name}"
            raw = extra.get(key, env.get(_ENV_PREFIX + field.name.upper()))
            if raw is None:
                continue
            kind: type[Any] = type(field.default)
            try:
                values[field.name] = str(raw).lower() if field.name == "use_shm" else kind(raw)
            except (TypeError, ValueError):
                raise ValueError(f"{key}: cannot read {raw!r} as {kind.__name__}") from None
        return cls(**values)
