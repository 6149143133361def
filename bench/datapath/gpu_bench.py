"""`kvsieve bench gpu`: the engine's device path, host buffers to GPU memory (issue #25).

Always, on the CPU: the staged path (a pooled buffer per layer, then the copy into the
cache's dtype, `kvstore.load.device.DeviceCopier`) against the bare conversion that
`--device cpu` does (one `copy_` from the loaded array), over the same 8B-shaped KV;
and the pool's allocations after warm-up (0 when buffers are reused).

With CUDA, also (models with random weights, fp16, built on the device: one from
SmolLM2-135M's config and one shaped like an 8B Llama):
- `h2d_gb_s`: loaded KV in pageable host memory to the GPU through the older staged path
  (`KVTransfer.upload`: pooled pinned staging, copy stream, event per layer), which loads of
  other layouts than packs still take; `h2d_staged_vs_pinned_floor`: that over a bare `copy_`
  of the same bytes from one already-pinned tensor; `overlap_hidden_fraction_staged`: of its
  copy time, the share hidden behind the new tokens' compute.
- `ttft_gpu_recompute_s_N` / `ttft_gpu_load_s_N` (8B-shaped) and `..._smol_N`: the prompt's
  first-token time computing all N tokens, against copying N-64 tokens' KV from host memory
  through that staged path and computing the last 64 (no store: the raw model).
- Through `Engine` from a real store, in `dtype` (bench/datapath/gpu_engine.py): recompute, full loads
  warm and cold, query-aware loads, the split, storing during prefill, and from the memory
  tier's own buffers `h2d_vs_pinned_floor` (target >= 0.8) and `overlap_hidden_fraction`
  (target >= 0.8).

Always, on the CPU's staged path (the one a GPU takes, run on the CPU; bench/datapath/gpu_choice.py):
the engine's own choice between loading and computing, request after request, against the best of
recompute and a full load measured beside it, cold and warm (`cpu_seq_*`); on a GPU the same for
the 8B shape and SmolLM2's (`seq_*`).

Without CUDA the GPU keys are absent and `cuda_unavailable` says why.
"""

from __future__ import annotations

import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bench.datapath.gpu_choice import choice_figures
from bench.datapath.gpu_engine import shape_figures
from bench.datapath.store_inline import store_inline_figures
from engine_adapter.runner.device import KVTransfer
from engine_adapter.runner.model import LoadedModel, kv_dtype, random_llama, spec_from_config
from kvstore.load.device import DeviceCopier

#: (hidden, intermediate, layers, attention heads, KV heads, vocabulary) of the timed models.
SMOL_SHAPE = (576, 1536, 30, 9, 3, 49152)
LLAMA_8B_SHAPE = (4096, 14336, 32, 32, 8, 128256)
#: Two layers, one KV head of 64: on this 2-core VM it computes 2k tokens in 0.05-0.1 s, about as
#: fast as a cold load of their 1 MB opens and reads: the fixed costs decide (as on an H200 at 4k).
TINY_SHAPE = (64, 128, 2, 1, 1, 1000)
NEW_TOKENS = 64
HEAD_DIM = 128  # the 8B shape's (4096 / 32)


def run(quick: bool = False, dtype: str = "float16") -> dict[str, Any]:
    """The figures as one flat dict (see module docstring and bench/datapath/gpu_engine.py)."""
    result: dict[str, Any] = {"cuda_available": torch.cuda.is_available()}
    result.update(_cpu_side(tokens=512 if quick else 4096))
    result.update(_cpu_choice(quick))
    result.update(store_inline_figures(quick))  # what storing runs in line, on the CPU (issue 47)
    if not torch.cuda.is_available():
        result["cuda_unavailable"] = f"torch {torch.__version__} sees no CUDA device"
        return result
    sizes = (1024,) if quick else (1024, 4096, 16384, 32768)
    result.update(_h2d(tokens=sizes[-1]))
    result.update(_ttft("", LLAMA_8B_SHAPE, sizes))
    result.update(_ttft("_smol", SMOL_SHAPE, sizes[:2]))
    half = {"float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
    e2e = (1024,) if quick else (4096, 16384, 32768)
    result["e2e_dtype"] = dtype
    with tempfile.TemporaryDirectory(prefix="kvsieve-bench-gpu-") as work:
        result.update(shape_figures("", LLAMA_8B_SHAPE, e2e, half, Path(work), 1 if quick else 2))
        result.update(shape_figures("_smol", SMOL_SHAPE, e2e, half, Path(work), 1 if quick else 2))
        for tag, shape in (("", LLAMA_8B_SHAPE), ("_smol", SMOL_SHAPE)):
            lm = _loaded(shape, "cuda", half, Path(work) / f"choice{tag}")
            result.update(choice_figures(lm, tag, e2e[:2], Path(work), 2 if quick else 5))
            del lm
    return result


def _cpu_choice(quick: bool) -> dict[str, Any]:
    """The engine's choice request after request on the CPU's staged path (bench/datapath/
    gpu_choice.py): a shape small enough that loading and computing are close there (where the
    fixed costs decide), and SmolLM2's (where loading wins by far)."""
    out: dict[str, Any] = {}
    threads = torch.get_num_threads()
    # One intra-op thread: on two cores shared with other jobs, torch's second thread waits for a
    # core, and a 45 ms recompute measured 0.1-0.8 s (10x noise is no ground to compare plans on).
    torch.set_num_threads(1)
    try:
        with tempfile.TemporaryDirectory(prefix="kvsieve-bench-choice-", dir=Path.home()) as work:
            tiny = _loaded(TINY_SHAPE, "cpu", torch.float32, Path(work) / "tiny")
            sizes = (512,) if quick else (512, 2048, 8192)
            out |= choice_figures(tiny, "_tiny", sizes, Path(work), 3 if quick else 6)
            if not quick:
                smol = _loaded(SMOL_SHAPE, "cpu", torch.float32, Path(work) / "smol")
                out |= choice_figures(smol, "_smol", (1024,), Path(work), 5)
    finally:
        torch.set_num_threads(threads)
    out["cpu_seq_intra_op_threads"] = 1
    return out


def _loaded(shape: tuple[int, ...], device: str, dtype: torch.dtype, source: Path) -> LoadedModel:
    """A Llama of `shape` with random weights on `device`, its KV in half precision."""
    torch.manual_seed(0)
    model = random_llama(shape, device, dtype)  # type: ignore[arg-type]
    return LoadedModel(model, None, spec_from_config(model.config, source, kv_dtype(dtype)), source)


def _kv(layers: int, kv_heads: int, tokens: int, seed: int = 0) -> np.ndarray[Any, Any]:
    rng = np.random.default_rng(seed)
    return rng.standard_normal((layers, 2, kv_heads, tokens, HEAD_DIM), dtype=np.float32).astype(np.float16)


def _best(fn: Callable[[], None], repeats: int) -> float:
    """Least seconds of `repeats` runs (after one warm-up run)."""
    fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return min(times)


def _cpu_side(tokens: int) -> dict[str, Any]:
    kv = _kv(LLAMA_8B_SHAPE[2], LLAMA_8B_SHAPE[4], tokens)
    targets = [torch.empty(layer.shape, dtype=torch.float32) for layer in kv]
    copier = DeviceCopier("cpu")

    def bare() -> None:
        for layer, target in zip(kv, targets, strict=True):
            target.copy_(torch.from_numpy(layer))

    def staged() -> None:
        for layer, target in zip(kv, targets, strict=True):
            copier.upload(layer, target)

    bare_s = _best(bare, 3)
    staged_s = _best(staged, 3)
    warm = copier.pool.allocations
    staged()
    return {
        "cpu_bare_copy_gb_s": round(kv.nbytes / bare_s / 1e9, 3),
        "cpu_staged_copy_gb_s": round(kv.nbytes / staged_s / 1e9, 3),
        "cpu_staged_vs_bare": round(bare_s / staged_s, 3),
        "cpu_pool_allocations_after_warmup": copier.pool.allocations - warm,
    }


def _h2d(tokens: int) -> dict[str, Any]:
    """Our staged upload against a bare pinned copy of the same bytes, and the overlap share."""
    kv = _kv(LLAMA_8B_SHAPE[2], LLAMA_8B_SHAPE[4], tokens)
    transfer = KVTransfer(torch.device("cuda"))

    def ours() -> None:
        upload = transfer.upload(kv, None, torch.float16)
        upload.wait_all()
        torch.cuda.synchronize()

    pinned = torch.from_numpy(kv).pin_memory()
    device = torch.empty(pinned.shape, dtype=pinned.dtype, device="cuda")

    def floor() -> None:
        device.copy_(pinned, non_blocking=True)
        torch.cuda.synchronize()

    ours_s, floor_s = _best(ours, 3), _best(floor, 3)
    return {
        "h2d_gb_s": round(kv.nbytes / ours_s / 1e9, 3),
        "h2d_pinned_floor_gb_s": round(kv.nbytes / floor_s / 1e9, 3),
        "h2d_staged_vs_pinned_floor": round(floor_s / ours_s, 3),
    }


def _model(shape: tuple[int, int, int, int, int, int]) -> Any:
    """A Llama of `shape` with random weights, fp16, built on the GPU."""
    from engine_adapter.runner.model import random_llama

    return random_llama(shape, "cuda", torch.float16)


@torch.inference_mode()
def _ttft(tag: str, shape: tuple[int, int, int, int, int, int], sizes: tuple[int, ...]) -> dict[str, Any]:
    model = _model(shape)
    transfer = KVTransfer(torch.device("cuda"))
    figures: dict[str, Any] = {}
    for n in sizes:
        recompute_s, load_s, hidden = _ttft_at(model, transfer, n)
        figures[f"ttft_gpu_recompute_s{tag}_{n}"] = round(recompute_s, 4)
        figures[f"ttft_gpu_load_s{tag}_{n}"] = round(load_s, 4)
        if not tag:  # the 8B shape's, at its largest N (the last one written)
            figures["overlap_hidden_fraction_staged"] = round(hidden, 3)
    return figures


def _ttft_at(model: Any, transfer: KVTransfer, n: int) -> tuple[float, float, float]:
    """(recompute s, load s, share of the copy hidden behind compute) for an N-token prompt."""
    from engine_adapter.runner.cache import cache_from, cache_kwargs, empty_cache

    config = model.config
    ids = torch.randint(0, config.vocab_size, (1, n), device="cuda")
    prefix = n - NEW_TOKENS
    shape = (config.num_hidden_layers, 2, config.num_key_value_heads, prefix, config.head_dim)
    kv = np.random.default_rng(n).standard_normal(shape, dtype=np.float32).astype(np.float16)
    new_ids, positions = ids[:, prefix:], torch.arange(prefix, n, device="cuda").unsqueeze(0)

    def recompute() -> None:
        model(input_ids=ids, logits_to_keep=1, **cache_kwargs(model, empty_cache(config)))
        torch.cuda.synchronize()

    def load() -> None:
        upload = transfer.upload(kv, None, torch.float16)
        with upload.attached(model):
            cache = cache_from(config, upload.pairs)
            model(input_ids=new_ids, position_ids=positions, logits_to_keep=1, **cache_kwargs(model, cache))
        torch.cuda.synchronize()

    recompute_s, load_s = _best(recompute, 2), _best(load, 2)
    copy_s, compute_s = _copy_only(transfer, kv), _compute_only(model, kv, new_ids, positions)
    hidden = (copy_s + compute_s - load_s) / copy_s if copy_s > 0 else 0.0
    return recompute_s, load_s, min(max(hidden, 0.0), 1.0)


def _copy_only(transfer: KVTransfer, kv: np.ndarray[Any, Any]) -> float:
    def copy() -> None:
        transfer.upload(kv, None, torch.float16).wait_all()
        torch.cuda.synchronize()

    return _best(copy, 2)


def _compute_only(model: Any, kv: np.ndarray[Any, Any], ids: torch.Tensor, positions: torch.Tensor) -> float:
    from engine_adapter.runner.cache import cache_from, cache_kwargs

    resident = torch.from_numpy(kv).to("cuda")
    pairs = [(layer[0].unsqueeze(0), layer[1].unsqueeze(0)) for layer in resident]

    def compute() -> None:
        cache = cache_from(model.config, pairs)
        model(input_ids=ids, position_ids=positions, logits_to_keep=1, **cache_kwargs(model, cache))
        torch.cuda.synchronize()

    return _best(compute, 2)
