"""The connector's KV cache layouts: every layout of vLLM's attention backends, on CPU tensors.

Caches of vLLM 0.32's backends are built by vLLM's own allocator code
(`create_kv_cache_views`, in each of its `KVCacheLayout`s), and the layout is
found from vLLM's real backend classes (`layout.detect`). Layouts of the
`get_kv_cache_shape` API of older vLLM (FlashAttention's `(2, blocks, ...)`,
FlashInfer's `(blocks, 2, ...)`, NHD and HND) are built the way that vLLM
allocated them: the physical tensor in the backend's stride order, permuted
back to the logical shape. Every token is checked against a reference that
reads K and V the way the backend's kernel does, written with plain indexing.

The `gpu` tests run the same transfers on a CUDA cache; skipped without CUDA.
"""

from __future__ import annotations

import importlib.util
import os
from collections.abc import Callable
from pathlib import Path

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("KVSIEVE_REQUIRE_VLLM") == "1":
        pytest.fail("vLLM is required (KVSIEVE_REQUIRE_VLLM=1) but not installed", pytrace=False)
    pytest.skip("vLLM not installed (pip install -e '.[vllm]', see docs/vllm.md)", allow_module_level=True)

import numpy as np
import torch
from vllm.v1.kv_cache_interface import (
    FullAttentionSpec,
    KVCacheTensor,
    compute_layout_strides,
    create_kv_cache_views,
)
from vllm.v1.kv_cache_layout import KVCacheLayout

from engine_adapter.vllm import layout
from engine_adapter.vllm.guard import SidecarGuard
from engine_adapter.vllm.plan import LoadOp, SaveOp
from engine_adapter.vllm.staging import CopyStream, HostStaging
from engine_adapter.vllm.worker import WorkerSide
from kvstore.errors import InvalidInputError
from kvstore.model import ModelSpec

LAYERS, HEADS, DIM, NUM_BLOCKS = 3, 2, 8, 12
SPEC = ModelSpec("tiny", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16")
Reference = Callable[[torch.Tensor, int, int], torch.Tensor]  # (layer, block, offset) -> (2, heads, dim)
Built = tuple[layout.CacheLayout, list[torch.Tensor], Reference]  # detected layout, zeroed caches, reader
Case = tuple[str, Callable[[int], Built]]  # id, block_size -> Built


# -- building caches the way vLLM does -------------------------------------------------


def vllm_caches(
    physical: KVCacheLayout, block_size: int, dtype: torch.dtype = torch.bfloat16
) -> list[torch.Tensor]:
    """Per-layer views of one zeroed allocation, made by vLLM 0.32's own code for `physical`."""
    spec = FullAttentionSpec(block_size=block_size, num_kv_heads=HEADS, head_size=DIM, dtype=dtype)
    strides = compute_layout_strides(spec, NUM_BLOCKS, LAYERS, physical)
    size = spec.page_size_bytes * NUM_BLOCKS * LAYERS
    placement = KVCacheTensor(
        size=size,
        layers=[f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)],
        layer_stride=strides[0],
        block_stride=strides[1],
    )
    raw = torch.zeros(size, dtype=torch.int8)
    return create_kv_cache_views(raw, spec, NUM_BLOCKS, physical, placement)


def content_reference(layer: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """K and V of a token as FlashAttention/FlashInfer/Triton/Flex read them: `.split(head_size, -1)`."""
    token = layer[block, :, offset]  # [heads, 2 * dim]
    return torch.stack([token[:, :DIM], token[:, DIM:]])


def cpu_reference(layer: torch.Tensor, block: int, offset: int) -> torch.Tensor:
    """K and V of a token as the CPU kernel reads a (block, head) tile: K rows, then V rows."""
    block_size = layer.shape[2]
    tile = layer[block].reshape(HEADS, 2 * block_size, DIM)
    return torch.stack([tile[:, offset], tile[:, block_size + offset]])


# The get_kv_cache_shape contract of vLLM's backends before 0.32 (num_blocks, block_size,
# num_kv_heads, head_size) and the stride orders they allocated in (NHD: identity; HND: heads
# before tokens). Older vLLM handed connectors the physical tensor permuted to this logical shape.
def flash_attn_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (2, num_blocks, block_size, num_kv_heads, head_size)


def flashinfer_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
    return (num_blocks, 2, block_size, num_kv_heads, head_size)


LEGACY_STRIDE_ORDERS = {
    ("FLASH_ATTN", "NHD"): (0, 1, 2, 3, 4),
    ("FLASH_ATTN", "HND"): (0, 1, 3, 2, 4),
    ("FLASHINFER", "NHD"): (0, 1, 2, 3, 4),
    ("FLASHINFER", "HND"): (0, 1, 3, 2, 4),
}


def legacy_backend(name: str, shape_fn: Callable[..., tuple[int, ...]]) -> type:
    """A backend class of vLLM before 0.32 as the connector sees one: a name and `get_kv_cache_shape`."""
    return type(
        f"Legacy{name}",
        (),
        {"get_name": staticmethod(lambda: name), "get_kv_cache_shape": staticmethod(shape_fn)},
    )


def legacy_caches(name: str, order: str, block_size: int) -> list[torch.Tensor]:
    shape_fn = flash_attn_shape if name == "FLASH_ATTN" else flashinfer_shape
    logical = shape_fn(NUM_BLOCKS, block_size, HEADS, DIM)
    stride_order = LEGACY_STRIDE_ORDERS[(name, order)]
    physical = [logical[i] for i in stride_order]
    inverse = [stride_order.index(i) for i in range(5)]
    return [torch.zeros(physical, dtype=torch.bfloat16).permute(*inverse) for _ in range(LAYERS)]


def legacy_reference(name: str) -> Reference:
    def read(layer: torch.Tensor, block: int, offset: int) -> torch.Tensor:
        if name == "FLASH_ATTN":
            return torch.stack([layer[0, block, offset], layer[1, block, offset]])
        return layer[block, :, offset]

    return read


def backend_class(module: str, cls: str) -> type:
    return getattr(importlib.import_module(f"vllm.v1.attention.backends.{module}"), cls)


def layout_cases() -> list[
    tuple[str, Callable[[int], tuple[layout.CacheLayout, list[torch.Tensor], Reference]]]
]:
    """(id, block_size -> (detected layout, zeroed caches, reference reader)) for every supported layout."""
    cases: list[Case] = []
    gpu_backends = [
        ("flash_attn", "FlashAttentionBackend"),
        ("triton_attn", "TritonAttentionBackend"),
        ("flex_attention", "FlexAttentionBackend"),
    ]
    for module, cls in gpu_backends:
        for physical in KVCacheLayout:

            def make(
                bs: int, module: str = module, cls: str = cls, physical: KVCacheLayout = physical
            ) -> Built:
                caches = vllm_caches(physical, bs)
                found = layout.detect(
                    backend_class(module, cls), DIM, physical=physical.name, sample=caches[0]
                )
                return found, caches, content_reference

            cases.append((f"{module}-{physical.name}", make))

    def flashinfer(bs: int) -> Built:
        # flashinfer's module imports the flashinfer package, absent from a CPU install: its layout
        # (same kind as FlashAttention's, vllm/v1/attention/backends/flashinfer.py) is named here.
        caches = vllm_caches(KVCacheLayout.LBHNC, bs)
        return (
            layout.CacheLayout("FLASHINFER", layout.KV_CONTENT, DIM, physical="LBHNC"),
            caches,
            content_reference,
        )

    cases.append(("flashinfer-LBHNC", flashinfer))

    def cpu(bs: int) -> Built:
        caches = vllm_caches(KVCacheLayout.LBHNC, bs)
        found = layout.detect(
            backend_class("cpu_attn", "CPUAttentionBackend"), DIM, physical="LBHNC", sample=caches[0]
        )
        return found, caches, cpu_reference

    cases.append(("cpu_attn-LBHNC", cpu))
    for name, order in LEGACY_STRIDE_ORDERS:

        def legacy(bs: int, name: str = name, order: str = order) -> Built:
            caches = legacy_caches(name, order, bs)
            shape_fn = flash_attn_shape if name == "FLASH_ATTN" else flashinfer_shape
            found = layout.detect(legacy_backend(name, shape_fn), DIM, physical=order, sample=caches[0])
            return found, caches, legacy_reference(name)

        cases.append((f"legacy-{name}-{order}", legacy))
    return cases


CASES = layout_cases()


def fill(caches: list[torch.Tensor], seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for cache in caches:
        cache.copy_(torch.randn(cache.shape, generator=g).to(cache.dtype))


# -- layouts ------------------------------------------------------------------------------


def test_backends_are_detected_by_class_not_by_shape() -> None:
    fa = layout.detect(backend_class("flash_attn", "FlashAttentionBackend"), DIM)
    cpu = layout.detect(backend_class("cpu_attn", "CPUAttentionBackend"), DIM)
    assert (fa.backend, fa.kind) == ("FLASH_ATTN", layout.KV_CONTENT)
    assert (cpu.backend, cpu.kind) == ("CPU_ATTN", layout.CPU_TILES)
    # Both keep [blocks, heads, block_size, 2 * dim]: only the backend tells how K and V lie in it.
    fa_cache, cpu_cache = vllm_caches(KVCacheLayout.LBHNC, 16), vllm_caches(KVCacheLayout.LBHNC, 16)
    assert fa_cache[0].shape == cpu_cache[0].shape
    fill(fa_cache, 1)
    slots = layout.slots_of([3], [0], 16)
    assert not torch.equal(layout.gather(fa_cache, slots, fa), layout.gather(fa_cache, slots, cpu))
    legacy = layout.detect(legacy_backend("FLASHINFER", flashinfer_shape), DIM)
    assert legacy.kind == layout.KV_AXIS and legacy.axes == (0, 2, 3, 1, 4) and legacy.block_axis == 0
    assert layout.detect(legacy_backend("FLASH_ATTN", flash_attn_shape), DIM).block_axis == 1


ROUND_TRIPS = [pytest.param(case, 16, id=case[0]) for case in CASES]
ROUND_TRIPS += [pytest.param(CASES[1], bs, id=f"{CASES[1][0]}-block{bs}") for bs in (32, 128)]


@pytest.mark.parametrize(("case", "block_size"), ROUND_TRIPS)
def test_round_trip_is_bit_exact_in_every_layout(
    case: tuple[str, Callable[[int], tuple[layout.CacheLayout, list[torch.Tensor], Reference]]],
    block_size: int,
) -> None:
    found, source, read = case[1](block_size)
    fill(source, seed=3)
    src_table, dst_table = [4, 9, 1, 7], [11, 0, 5, 2]
    positions = np.random.default_rng(0).permutation(np.arange(5, 3 * block_size + 7))  # any order
    kv = layout.gather(source, layout.slots_of(positions, src_table, block_size), found)
    assert kv.shape == SPEC.kv_shape(len(positions))
    for i, p in enumerate(positions):
        for li, layer in enumerate(source):
            assert torch.equal(kv[li, :, :, i], read(layer, src_table[p // block_size], p % block_size))

    _, target, _ = case[1](block_size)  # a fresh, zeroed cache in the same layout
    layout.scatter(target, kv, layout.slots_of(positions, dst_table, block_size), found)
    written = {(dst_table[p // block_size], p % block_size): i for i, p in enumerate(positions)}
    for li, layer in enumerate(target):
        for block in range(NUM_BLOCKS):
            for offset in range(block_size):
                got = read(layer, block, offset)
                i = written.get((block, offset))
                want = kv[li, :, :, i] if i is not None else torch.zeros_like(got)
                assert torch.equal(got, want), (li, block, offset)

    # The save path: whole blocks copied in vLLM's layout, put in kvsieve's later.
    blocks = layout.copy_blocks(source, src_table, found)
    got = layout.blocks_to_kv(blocks, found, 5, len(positions))
    order = np.argsort(positions)
    want = layout.to_numpy(kv[:, :, :, torch.as_tensor(order)])
    assert np.array_equal(got.view(np.uint16), want.view(np.uint16))


@pytest.mark.parametrize("block_size", [16, 32, 128])
def test_slot_mapping_across_block_sizes(block_size: int) -> None:
    rng = np.random.default_rng(block_size)
    table = rng.permutation(NUM_BLOCKS)[:5].tolist()
    positions = rng.permutation(5 * block_size)[:200]
    slots = layout.slots_of(positions, table, block_size)
    for p, b, o in zip(positions, slots.block_ids.tolist(), slots.offsets.tolist(), strict=True):
        assert (b, o) == (table[p // block_size], p % block_size)
    # vLLM's flat slot (block * block_size + offset) addresses the same token in an NHD cache.
    caches = vllm_caches(KVCacheLayout.LBNHC, block_size)
    found = layout.CacheLayout("FLASH_ATTN", layout.KV_CONTENT, DIM, physical="LBNHC")
    kv = torch.randn(SPEC.kv_shape(len(positions))).to(torch.bfloat16)
    layout.scatter(caches, kv, slots, found)
    flat = caches[0].transpose(1, 2).reshape(NUM_BLOCKS * block_size, HEADS, 2, DIM)  # vLLM's slot view
    vllm_slots = np.array(table)[positions // block_size] * block_size + positions % block_size
    assert torch.equal(flat[torch.as_tensor(vllm_slots)].permute(2, 1, 0, 3), kv[0])
    with pytest.raises(InvalidInputError, match="past the request"):
        layout.slots_of([5 * block_size], table, block_size)


def test_unknown_layouts_are_refused_naming_backend_and_shape() -> None:
    diffkv = backend_class("flash_attn_diffkv", "FlashAttentionDiffKVBackend")
    with pytest.raises(InvalidInputError, match=r"FLASH_ATTN_DIFFKV.*\(12, 2, 16, 16\)"):
        layout.detect(diffkv, DIM, sample=vllm_caches(KVCacheLayout.LBHNC, 16)[0])
    mla = legacy_backend("FLASHMLA", lambda blocks, block_size, heads, dim: (blocks, block_size, dim))
    with pytest.raises(InvalidInputError, match=r"FLASHMLA.*\(7, 48, 80\)"):
        layout.detect(mla, DIM)
    fa = backend_class("flash_attn", "FlashAttentionBackend")
    with pytest.raises(InvalidInputError, match=r"\(12, 2, 16, 12\).*FLASH_ATTN.*head_dim 8"):
        layout.detect(fa, DIM, sample=torch.zeros(12, 2, 16, 12))
    with pytest.raises(InvalidInputError, match="head_size 8 and head_size_v 4"):
        layout.detect(fa, DIM, head_dim_v=4)
    cpu = layout.cpu_layout(DIM)
    nhd = vllm_caches(KVCacheLayout.LBNHC, 16)[0]  # the CPU kernel needs contiguous (block, head) tiles
    with pytest.raises(InvalidInputError, match=r"CPU_ATTN.*tile"):
        cpu.token_view(nhd)


def test_worker_stores_and_loads_through_a_gpu_layout_on_cpu(tmp_path: Path) -> None:
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    found, source, _ = CASES[1][1](16)  # FlashAttention, NHD (LBNHC)
    assert found.physical == "LBNHC"
    fill(source, seed=5)
    _, target, _ = CASES[1][1](16)
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=16, chunk_tokens=8, memory_bytes=1 << 20)
    tokens = tuple(range(1, 49))
    with TieredStore(config) as store:
        saver = _worker(store, source, found)
        assert saver.save((SaveOp("a", tokens[:32], 0, (4, 6)),)) == 1
        assert saver.flush(30) and saver.close(5) and saver.saved_blocks == 2
        loader = _worker(store, target, found)
        outcome = loader.start_load((LoadOp("b", tokens[:32], 0, 32, (9, 3)),))
        assert outcome[0].written_tokens == 32 and not outcome[0].failed_blocks
        positions = np.arange(32)
        got = layout.gather(target, layout.slots_of(positions, (9, 3), 16), found)
        want = layout.gather(source, layout.slots_of(positions, (4, 6), 16), found)
        assert torch.equal(got, want)
        assert loader.close(5)


def _worker(store: object, caches: list[torch.Tensor], found: layout.CacheLayout) -> WorkerSide:
    worker = WorkerSide(store, SPEC, "default", 16, SidecarGuard(30))  # type: ignore[arg-type]
    worker.register({f"model.layers.{i}.self_attn.attn": t for i, t in enumerate(caches)}, found)
    return worker


def test_staging_pool_reuses_its_buffers_across_sizes() -> None:
    staging = HostStaging(pin=False)  # on a CPU cache nothing is pinned
    for tokens in (300, 341, 257, 320):  # loads of varying length, one size class (64 KiB)
        buffer = staging.take((LAYERS, 2, HEADS, tokens, DIM), torch.bfloat16)
        assert buffer.shape == (LAYERS, 2, HEADS, tokens, DIM) and not buffer.is_pinned()
        staging.give(buffer)
    assert staging.allocated == 1
    held = [staging.take((1024,), torch.float32) for _ in range(3)]  # taken at once: three buffers
    assert len({b.data_ptr() for b in held}) == 3


# -- on a GPU ----------------------------------------------------------------------------

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.gpu
@needs_cuda
def test_pinned_staging_is_pinned_reused_and_copies_run_off_the_compute_stream() -> None:
    staging = HostStaging(pin=True)
    buffer = staging.take((4, 1024), torch.bfloat16)
    assert buffer.is_pinned()
    staging.give(buffer)
    for _ in range(3):
        again = staging.take((4, 1024), torch.bfloat16)
        staging.give(again)
    assert staging.allocated == 1  # warm: nothing more allocated
    copies = CopyStream(torch.device("cuda"))
    assert copies.stream != torch.cuda.current_stream()
    assert not HostStaging(pin=False).take((4,), torch.float32).is_pinned()


@pytest.mark.gpu
@needs_cuda
def test_worker_round_trip_on_a_cuda_cache(tmp_path: Path) -> None:
    from kvstore.config import StoreConfig
    from kvstore.store.tiered import TieredStore

    found, source, _ = CASES[1][1](16)
    fill(source, seed=6)
    source = [t.cuda() for t in source]
    target = [torch.zeros_like(t) for t in source]
    config = StoreConfig(data_dir=tmp_path / "d", block_tokens=16, chunk_tokens=8, memory_bytes=1 << 20)
    tokens = tuple(range(1, 33))
    names = [f"model.layers.{i}.self_attn.attn" for i in range(LAYERS)]
    with TieredStore(config) as store:
        saver = _worker(store, source, found)
        assert saver.copies is not None and saver.staging.pin
        ops = (SaveOp("a", tokens, 0, (4, 6)),)
        for name in names:
            saver.save_layer(name, ops)  # vLLM's save_kv_layer, one call per layer
        assert saver.save(ops) == 1  # vLLM's wait_for_save
        assert saver.flush(30) and saver.close(5) and saver.saved_blocks == 2
        loader = _worker(store, target, found)
        loader.start_load((LoadOp("b", tokens, 0, 32, (9, 3)),))
        for name in names:
            loader.wait_layer(name)  # vLLM's wait_for_layer_load
        torch.cuda.synchronize()
        positions = np.arange(32)
        got = layout.gather(target, layout.slots_of(positions, (9, 3), 16), found)
        want = layout.gather(source, layout.slots_of(positions, (4, 6), 16), found)
        assert torch.equal(got.cpu(), want.cpu())
        assert loader.close(5)
