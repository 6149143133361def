"""Real components for driving kvsieve's SGLang backend with SGLang's own code.

Imported inside the SGLang environment only (bench/sglang/hicache_driver.py): real
`kvsieve serve` sidecars (run by kvsieve's interpreter), SGLang's host KV pools built
on the CPU, SGLang's storage config and factory, and byte comparisons of pages that
do not go through the backend's own code.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from typing import Any, NamedTuple

import torch
from sglang.srt.mem_cache.device_pool_info import (  # type: ignore[import-not-found]
    KVBufferLayout,
    KVBuffers,
    MHABufferInfo,
    MLABufferInfo,
)
from sglang.srt.mem_cache.hicache_storage import (  # type: ignore[import-not-found]
    HiCacheStorage,
    HiCacheStorageConfig,
)
from sglang.srt.mem_cache.pool_host.mha import (  # type: ignore[import-not-found]
    AsymmetricMHATokenToKVPoolHost,
    MHATokenToKVPoolHost,
)
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # type: ignore[import-not-found]
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory  # type: ignore[import-not-found]

from kvstore.client.kvclient import KVClient
from kvstore.model import ModelSpec


class Geometry(NamedTuple):
    layers: int
    heads: int
    head_dim: int
    page_size: int
    dtype: torch.dtype


SMALL = Geometry(4, 2, 64, 16, torch.bfloat16)
SMOLLM2 = Geometry(30, 3, 64, 64, torch.float16)  # SmolLM2-135M's KV, SGLang's usual page size
BLOCK_TOKENS = 256  # the sidecars' --block-tokens


def check_imports() -> None:
    """Import the backend as SGLang's factory would."""
    from engine_adapter.sglang.backend import KvsieveStorage

    assert issubclass(KvsieveStorage, HiCacheStorage)


# --- real components -------------------------------------------------------------------------


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class Sidecar:
    """A real `kvsieve serve` (kvsieve's interpreter), stoppable, pausable, restartable in place."""

    def __init__(
        self, python: str, data_dir: Path, block_tokens: int = 256, chunk_tokens: int = 16, *extra: str
    ) -> None:
        self.python, self.data_dir = python, data_dir
        self.block_tokens, self.chunk_tokens = block_tokens, chunk_tokens
        self.extra = list(extra)
        self.port = _free_port()
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def start(self) -> Sidecar:
        cmd = [self.python, "-m", "kvstore.cli.main", "serve", "--listen", self.address]
        cmd += ["--metrics-listen", f"127.0.0.1:{_free_port()}", "--data-dir", str(self.data_dir)]
        cmd += ["--block-tokens", str(self.block_tokens), "--chunk-tokens", str(self.chunk_tokens)]
        cmd += ["--max-store-tokens", "65536", *self.extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith("KVSIEVE_") and k != "PYTHONPATH"}
        self.proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env)
        deadline = time.monotonic() + 60
        spec = ModelSpec("probe", 1, 1, 8)
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"kvsieve serve exited with {self.proc.returncode}")
            try:
                with KVClient(self.address, timeout_s=1) as client:
                    client.lookup([1], model=spec)
                return self
            except Exception:
                time.sleep(0.1)
        raise TimeoutError("kvsieve serve did not answer")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def pause(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)


def mha_pool(geom: Geometry, layout: str, pages: int, seed: int | None = None) -> Any:
    """SGLang's MHA host pool on the CPU, `pages` pages, random KV when `seed` is given."""
    device_tokens = geom.page_size
    k = tuple(
        torch.zeros(device_tokens, geom.heads, geom.head_dim, dtype=geom.dtype) for _ in range(geom.layers)
    )
    v = tuple(
        torch.zeros(device_tokens, geom.heads, geom.head_dim, dtype=geom.dtype) for _ in range(geom.layers)
    )
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=geom.page_size,
        head_num=geom.heads,
        head_dim=geom.head_dim,
        v_head_dim=geom.head_dim,
        dtype=geom.dtype,
        device=torch.device("cpu"),
    )
    pool = MHATokenToKVPoolHost(
        info, 2.0, 0, geom.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=geom.layers,
        host_token_capacity=pages * geom.page_size,
    )  # fmt: skip
    return _randomised(pool, seed)


def split_width_pool(geom: Geometry, pages: int) -> Any:
    """SGLang's MHA host pool with V half as wide as K (its own K and V buffers), page-first."""
    ps = geom.page_size
    k = tuple(torch.zeros(ps, geom.heads, geom.head_dim, dtype=geom.dtype) for _ in range(geom.layers))
    v = tuple(torch.zeros(ps, geom.heads, geom.head_dim // 2, dtype=geom.dtype) for _ in range(geom.layers))
    info = MHABufferInfo(
        buffers=KVBuffers(k=k, v=v, k_data_ptrs=_ptrs(k), v_data_ptrs=_ptrs(v), layout=KVBufferLayout.NHD),
        page_size=ps, head_num=geom.heads, head_dim=geom.head_dim, v_head_dim=geom.head_dim // 2,
        dtype=geom.dtype, device=torch.device("cpu"),
    )  # fmt: skip
    return AsymmetricMHATokenToKVPoolHost(
        info, 2.0, 0, ps, "page_first", pin_memory=False, device="cpu", device_capacity_tokens=ps,
        start_layer=0, end_layer=geom.layers, host_token_capacity=pages * ps,
    )  # fmt: skip


def mla_pool(geom: Geometry, layout: str, pages: int, seed: int | None = None) -> Any:
    """SGLang's MLA host pool on the CPU (latent rank `head_dim`, rope 16)."""
    rope, device_tokens = 16, geom.page_size
    rows = tuple(
        torch.zeros(device_tokens, 1, geom.head_dim + rope, dtype=geom.dtype) for _ in range(geom.layers)
    )
    info = MLABufferInfo(
        buffers=rows, data_ptrs=_ptrs(rows), layer_indices=tuple(range(geom.layers)),
        device_layer_num=geom.layers, page_size=geom.page_size, kv_lora_rank=geom.head_dim,
        qk_rope_head_dim=rope, kv_cache_dim=geom.head_dim + rope, dtype=geom.dtype,
        device=torch.device("cpu"),
    )  # fmt: skip
    pool = MLATokenToKVPoolHost(
        info, 2.0, 0, geom.page_size, layout, pin_memory=False, device="cpu",
        device_capacity_tokens=device_tokens, start_layer=0, end_layer=geom.layers,
        target_layer_num=geom.layers, host_token_capacity=pages * geom.page_size,
    )  # fmt: skip
    return _randomised(pool, seed)


def _ptrs(tensors: tuple[torch.Tensor, ...]) -> torch.Tensor:
    return torch.tensor([t.data_ptr() for t in tensors], dtype=torch.uint64)


def _randomised(pool: Any, seed: int | None) -> Any:
    ints = pool.kv_buffer.view(torch.int16)
    if seed is None:
        ints.zero_()
    else:
        ints.random_(-(1 << 15), (1 << 15) - 1, generator=torch.Generator().manual_seed(seed))
    return pool


def token_major(pool: Any, page: int) -> torch.Tensor:
    """Page `page` of a pool as (K/V, layer, token, ...) bit patterns, read by SGLang's dims
    (`init_kv_buffer`): the order in which two layouts must agree, independent of the backend."""
    start = page * pool.page_size
    raw = pool.get_data_page(start, flat=False).view(torch.int16)
    if pool.layout == "layer_first":
        return raw.clone()
    if pool.layout == "page_first_direct":  # (2, 1, L, ps, H, D) or (1, L, ps, 1, D)
        return (raw[0] if pool.kv_buffer.dim() == 5 else raw[:, 0]).clone()
    mla = pool.kv_buffer.dim() == 4
    return (raw.transpose(0, 1) if mla else raw.transpose(1, 2)).clone()  # page_first


def storage_config(address: str, **overrides: Any) -> HiCacheStorageConfig:
    """SGLang's storage config for the dynamic backend; `kvsieve_*` and identity overrides."""
    extra = {
        "backend_name": "kvsieve",
        "module_path": "engine_adapter.sglang.backend",
        "class_name": "KvsieveStorage",
        "interface_v1": 1,
        "kvsieve_address": address,
        "kvsieve_timeout_s": 1.0,
        "kvsieve_retry_s": 0.2,
    }
    identity = {
        "tp_rank": 0,
        "tp_size": 1,
        "model_name": "HuggingFaceTB/SmolLM2-135M-Instruct",
        "is_mla_model": False,
    }
    for key, value in overrides.items():
        (extra if key.startswith("kvsieve_") else identity)[key] = value
    return HiCacheStorageConfig(
        pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1, enable_storage_metrics=False,
        is_page_first_layout=False, extra_config=extra, **identity,
    )  # fmt: skip


def attach(config: HiCacheStorageConfig, pool: Any) -> Any:
    """What SGLang's cache controller does: the factory by name, then the host pool."""
    backend = StorageBackendFactory.create_backend("dynamic", config, pool)
    backend.register_mem_pool_host(pool)
    return backend


def slots(pool: Any, first_page: int, count: int) -> torch.Tensor:
    """The host slots (token indices) of pages [first_page, first_page + count)."""
    ps = pool.page_size
    return torch.arange(first_page * ps, (first_page + count) * ps, dtype=torch.int64)


def pages_equal(a: Any, a_pages: range, b: Any, b_pages: range) -> list[bool]:
    return [torch.equal(token_major(a, i), token_major(b, j)) for i, j in zip(a_pages, b_pages, strict=True)]
