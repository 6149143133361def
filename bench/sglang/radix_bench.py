"""`kvsieve bench radix`: kvsieve's radix index against SGLang's `RadixCache` on one trace.

The trace (20,000 requests; `--quick`: 1,000) is a chat service over shared
context: each request is one of 8 system prompts, then (80 % of the time) one of
500 documents drawn with Zipf-like popularity, then a question of its own.
Segments are not block-aligned, so a document's blocks are shared only among
requests with the same system prompt, as in real traffic. Blocks are 256 tokens.

Each request is matched, then its new full blocks are inserted, in trace order,
through both trees; match and insert are timed separately per request. kvsieve's
tree is keyed by block keys: they are computed before the timed insert (the store
computes them anyway for its tiers) and their cost is reported as `keys_us_kvsieve`.
SGLang's side runs in a throwaway environment built by `bench/sglang/setup_sglang.sh`, as
a subprocess (`bench/sglang/radix_driver.py`) replaying the same trace file; if
that environment is missing or SGLang cannot be imported, the kvsieve figures are
still reported and `sglang_unavailable` says why.

Memory per cached block: bytes still allocated (tracemalloc) after building the
tree from the whole trace and dropping the inputs, over the blocks it holds; for
SGLang the driver adds the storage of the torch tensors (per-token KV indices) that
tracemalloc cannot see.
"""

from __future__ import annotations

import gc
import json
import os
import subprocess
import tempfile
import time
import tracemalloc
from pathlib import Path
from typing import Any, NamedTuple

import numpy as np

from bench.sglang.environment import sglang_python
from kvstore.keys import block_keys
from radix import RadixTree

BLOCK_TOKENS = 256
VOCAB = 49_152
_DRIVER = Path(__file__).with_name("radix_driver.py")
_ROOT = "bench"
_FINGERPRINT = bytes(16)
_NAMESPACE = bytes(16)
_BLOCK_BYTES = 256 * 23_040  # a SmolLM2 block: only `evict` reads it


class Trace(NamedTuple):
    """Token segments and, per request, the segments it concatenates (both flattened)."""

    segments: np.ndarray[Any, Any]  # uint32 tokens of every segment, back to back
    segment_offsets: np.ndarray[Any, Any]  # segment i is segments[off[i]:off[i+1]]
    request_segments: np.ndarray[Any, Any]  # segment ids of every request, back to back
    request_offsets: np.ndarray[Any, Any]  # request j is request_segments[off[j]:off[j+1]]

    @property
    def num_requests(self) -> int:
        """Requests in the trace."""
        return len(self.request_offsets) - 1

    def request(self, j: int) -> np.ndarray[Any, Any]:
        """Tokens of request `j` (uint32)."""
        ids = self.request_segments[self.request_offsets[j] : self.request_offsets[j + 1]]
        off = self.segment_offsets
        return np.concatenate([self.segments[off[i] : off[i + 1]] for i in ids])


def make_trace(num_requests: int, num_documents: int, seed: int = 0) -> Trace:
    """The shared-context chat trace described in the module docstring."""
    rng = np.random.default_rng(seed)
    lengths = [int(n) for n in rng.integers(200, 1200, 8)]  # system prompts
    lengths += [int(n) for n in rng.integers(300, 6000, num_documents)]
    lengths += [int(n) for n in rng.integers(50, 700, num_requests)]  # one question each
    first_doc, first_question = 8, 8 + num_documents
    popularity = 1.0 / np.arange(1, num_documents + 1) ** 0.8
    docs = rng.choice(num_documents, size=num_requests, p=popularity / popularity.sum())
    systems = rng.integers(0, 8, num_requests)
    with_doc = rng.random(num_requests) < 0.8
    parts: list[list[int]] = []
    for j in range(num_requests):
        doc = [first_doc + int(docs[j])] if with_doc[j] else []
        parts.append([int(systems[j]), *doc, first_question + j])
    return Trace(
        rng.integers(0, VOCAB, sum(lengths), dtype=np.uint32),
        np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64),
        np.array([i for p in parts for i in p], dtype=np.int64),
        np.concatenate([[0], np.cumsum([len(p) for p in parts])]).astype(np.int64),
    )


def run(quick: bool = False) -> dict[str, Any]:
    """Run the benchmark; returns the JSON object `kvsieve bench radix --json` prints."""
    trace = make_trace(1_000 if quick else 20_000, 50 if quick else 500)
    out: dict[str, Any] = {"requests": trace.num_requests, "block_tokens": BLOCK_TOKENS}
    out |= replay_kvsieve(trace)
    out["bytes_per_block_kvsieve"] = round(kvsieve_bytes_per_block(trace))
    sglang = run_sglang(trace)
    out |= sglang
    if "match_us_sglang" in sglang:
        # Both trees replayed the same trace: they must hold and hit the same blocks.
        ours_blocks = (out["cached_blocks"], out["hit_blocks"])
        if (sglang["cached_blocks_sglang"], sglang["hit_blocks_sglang"]) != ours_blocks:
            raise RuntimeError(f"the trees disagree on (cached, hit) blocks: {sglang} vs {ours_blocks}")
        ours = out["match_us_kvsieve"] + out["insert_us_kvsieve"]
        theirs = sglang["match_us_sglang"] + sglang["insert_us_sglang"]
        out["radix_speedup_vs_sglang"] = round(theirs / ours, 2)
    return out


def replay_kvsieve(trace: Trace) -> dict[str, Any]:
    """Match then insert every request through a fresh `RadixTree`; mean µs per request."""
    tree = RadixTree(BLOCK_TOKENS)
    match_ns = insert_ns = keys_ns = hit_blocks = 0
    for j in range(trace.num_requests):
        tokens = trace.request(j)
        t0 = time.perf_counter_ns()
        matched = tree.match(_ROOT, tokens)
        t1 = time.perf_counter_ns()
        keys = block_keys(tokens, BLOCK_TOKENS, _FINGERPRINT, _NAMESPACE)
        t2 = time.perf_counter_ns()
        _insert_new(tree, tokens, keys, len(matched.nodes))
        t3 = time.perf_counter_ns()
        match_ns, keys_ns, insert_ns = match_ns + t1 - t0, keys_ns + t2 - t1, insert_ns + t3 - t2
        hit_blocks += len(matched.nodes)
    n = trace.num_requests
    return {
        "match_us_kvsieve": round(match_ns / n / 1e3, 2),
        "insert_us_kvsieve": round(insert_ns / n / 1e3, 2),
        "keys_us_kvsieve": round(keys_ns / n / 1e3, 2),
        "cached_blocks": tree.num_blocks,
        "hit_blocks": hit_blocks,
    }


def _insert_new(tree: RadixTree, tokens: np.ndarray[Any, Any], keys: list[bytes], start: int) -> None:
    """Insert the blocks of `tokens` from block `start` on (the ones the match did not find)."""
    b = BLOCK_TOKENS
    for i in range(start, len(keys)):
        parent = keys[i - 1] if i else None
        tree.insert(_ROOT, parent, tokens[i * b : (i + 1) * b], keys[i], _BLOCK_BYTES)


def kvsieve_bytes_per_block(trace: Trace) -> float:
    """Bytes the tree keeps per block after building it from the trace (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        tree = RadixTree(BLOCK_TOKENS)
        for j in range(trace.num_requests):
            tokens = trace.request(j)
            keys = block_keys(tokens, BLOCK_TOKENS, _FINGERPRINT, _NAMESPACE)
            _insert_new(tree, tokens, keys, len(tree.match(_ROOT, tokens).nodes))
            del tokens, keys
        gc.collect()
        kept = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    return kept / tree.num_blocks


def run_sglang(trace: Trace) -> dict[str, Any]:
    """Replay `trace` through SGLang's RadixCache in its own environment.

    Returns its figures, or {"sglang_unavailable": reason} when it cannot run.
    """
    python = sglang_python()
    if not python.exists():
        reason = f"no SGLang environment at {python}: build it with bash bench/sglang/setup_sglang.sh"
        return {"sglang_unavailable": reason}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "trace.npz"
        np.savez(path, **trace._asdict(), block_tokens=BLOCK_TOKENS)
        env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
        result = subprocess.run(
            [str(python), str(_DRIVER), str(path)], capture_output=True, text=True, env=env, timeout=1800
        )
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return {"sglang_unavailable": f"the SGLang driver failed (exit {result.returncode}): {last}"}
    figures: dict[str, Any] = json.loads(result.stdout.strip().splitlines()[-1])
    return figures
