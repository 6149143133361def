"""Replays a `bench/sglang/radix_bench.py` trace through SGLang's RadixCache; prints one JSON line.

Runs inside the throwaway SGLang environment (`bench/sglang/setup_sglang.sh`), never in
kvsieve's: it imports only numpy, torch and sglang. Usage: `python THIS TRACE.npz`
(`--check`: only import).

Each request is matched (`match_prefix`), then inserted whole (`insert`, which
walks the matched part and adds the rest), as SGLang's scheduler does after a
prefill. The value inserted is an int64 tensor with one entry per token (the
token ids standing in for KV indices, built before the timer starts, as a
server already holds them): the same size as the KV indices a server keeps.
"""

from __future__ import annotations

import gc
import json
import sys
import time
import tracemalloc
from array import array
from typing import Any

import numpy as np
import torch


def _declare_torchvision_ops() -> Any:
    """Let torchvision's Python side import against the CPU torch.

    PyPI's torchvision is linked against CUDA torch, so its native ops cannot load
    here, and importing it then fails on registering fake kernels for `nms`/`qnms`.
    SGLang's config modules import torchvision.transforms at import time; the radix
    cache never calls an op. Declaring the two schemas is enough to import.
    """
    lib = torch.library.Library("torchvision", "DEF")
    lib.define("nms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    lib.define("qnms(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    return lib  # must stay alive


_TORCHVISION_OPS = _declare_torchvision_ops()

from sglang.srt.mem_cache.base_prefix_cache import (  # type: ignore[import-not-found]  # noqa: E402
    InsertParams,
    MatchPrefixParams,
)
from sglang.srt.mem_cache.radix_cache import RadixCache, RadixKey  # type: ignore[import-not-found]  # noqa: E402


def _requests(trace: Any) -> Any:
    """(tokens as array('q'), int64 tensor of as many KV indices) per request, built lazily."""
    seg, seg_off = trace["segments"], trace["segment_offsets"]
    req, req_off = trace["request_segments"], trace["request_offsets"]
    for j in range(len(req_off) - 1):
        ids = req[req_off[j] : req_off[j + 1]]
        tokens = np.concatenate([seg[seg_off[i] : seg_off[i + 1]] for i in ids]).astype(np.int64)
        yield array("q", tokens.tobytes()), torch.from_numpy(tokens)


def replay(trace: Any, block_tokens: int) -> dict[str, Any]:
    """Mean µs per request of match and insert, in trace order."""
    cache = RadixCache.create_simulated(page_size=block_tokens)
    match_ns = insert_ns = hit_tokens = 0
    n = 0
    for tokens, indices in _requests(trace):
        t0 = time.perf_counter_ns()
        matched = cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        t1 = time.perf_counter_ns()
        cache.insert(InsertParams(key=RadixKey(tokens), value=indices))
        t2 = time.perf_counter_ns()
        match_ns, insert_ns = match_ns + t1 - t0, insert_ns + t2 - t1
        hit_tokens += matched.device_prefix_len
        n += 1
    return {
        "match_us_sglang": round(match_ns / n / 1e3, 2),
        "insert_us_sglang": round(insert_ns / n / 1e3, 2),
        "cached_blocks_sglang": cache.total_size() // block_tokens,
        "hit_blocks_sglang": hit_tokens // block_tokens,
    }


def bytes_per_block(trace: Any, block_tokens: int) -> float:
    """Python heap (tracemalloc) plus tensor storage kept per cached block."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    cache = RadixCache.create_simulated(page_size=block_tokens)
    for tokens, indices in _requests(trace):
        cache.match_prefix(MatchPrefixParams(key=RadixKey(tokens)))
        cache.insert(InsertParams(key=RadixKey(tokens), value=indices))
        del tokens, indices
    gc.collect()
    heap = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    tensors = sum(v.untyped_storage().nbytes() for v in _values(cache.root_node))
    return (heap + tensors) / (cache.total_size() // block_tokens)


def _values(root: Any) -> Any:
    stack = [root]
    while stack:
        node = stack.pop()
        if isinstance(node.value, torch.Tensor):
            yield node.value
        stack.extend(node.children.values())


def main(path: str) -> None:
    """Replay the trace at `path` and print the figures as one JSON line."""
    with np.load(path) as data:
        trace = {k: data[k] for k in data.files}
    block_tokens = int(trace["block_tokens"])
    out = replay(trace, block_tokens)
    out["bytes_per_block_sglang"] = round(bytes_per_block(trace, block_tokens))
    out["sglang_version"] = __import__("sglang").__version__
    print(json.dumps(out))


if __name__ == "__main__":
    if sys.argv[1] == "--check":  # the imports above succeeded
        print(f"sglang {__import__('sglang').__version__}: RadixCache imports")
    else:
        main(sys.argv[1])
