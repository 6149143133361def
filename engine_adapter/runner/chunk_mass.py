"""The query-aware chunk score of one layer, in torch: what the engine runs inside the forward pass.

Same arithmetic as `importance.query_select.query_chunk_mass` (numpy, which the quality
benchmark's simulated methods call): per query head and query, logsumexp of q.k_hat over each
chunk's tokens, softmax over chunks, mean over queries and heads. Here it is one batched matmul
over all heads at once (grouped-query attention folded into the batch), one softmax and one
sum over a (chunks, chunk_tokens) view: at 4,096 prefix tokens the numpy version spent
~80 ms a layer, mostly in a stacked matmul and `np.add.reduceat` (issue #27, item 5).
tests/test_chunk_mass.py holds the two equal, and the chunks chosen from them identical.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

Array = np.ndarray[Any, Any]


def chunk_mass(queries: torch.Tensor, keys: torch.Tensor, chunk_tokens: int, scale: float) -> Array:
    """Each chunk's estimated share of the queries' attention: float64 (chunks,), summing to 1.

    Args:
        queries: (query_heads, m, head_dim), post-RoPE; query head h reads KV head
            h // (query_heads // kv_heads).
        keys: (kv_heads, n, head_dim) approximate keys (e.g. a decoded summary), prompt order.
        chunk_tokens: tokens per chunk (the last chunk may be partial).
        scale: the attention's softmax scale.

    Raises:
        ValueError: shapes that do not fit together.
    """
    if queries.dim() != 3 or keys.dim() != 3 or queries.shape[2] != keys.shape[2]:
        raise ValueError(
            f"queries {tuple(queries.shape)} and keys {tuple(keys.shape)} must be (heads, tokens, dim)"
        )
    heads, m, dim = queries.shape
    kv_heads, n, _ = keys.shape
    if heads % kv_heads or chunk_tokens < 1 or n < 1:
        raise ValueError(
            f"query heads ({heads}) must be a multiple of kv heads ({kv_heads}), with tokens ({n}) and "
            f"chunk_tokens ({chunk_tokens}) >= 1"
        )
    q = (queries.float() * scale).reshape(kv_heads, (heads // kv_heads) * m, dim)
    logits = torch.bmm(q, keys.float().transpose(1, 2))  # (kv_heads, group x m, n)
    # softmax over chunks of each chunk's logsumexp = the chunk's share of a softmax over all
    # tokens: one softmax over n, then sums over (chunks, chunk_tokens): no logsumexp over
    # 8-wide rows (20 ms a layer at 4,096 tokens, more than everything else here together)
    # The mean over heads and queries commutes with the sum over a chunk's tokens: average the
    # (n,) attention first, then sum n / chunk_tokens short rows, not heads x queries x n.
    weights = logits.softmax(-1).mean(dim=(0, 1))
    chunks = -(-n // chunk_tokens)
    if chunks * chunk_tokens != n:  # a partial last chunk: pad with tokens that weigh nothing
        weights = torch.nn.functional.pad(weights, (0, chunks * chunk_tokens - n))
    return weights.view(chunks, chunk_tokens).sum(-1).double().cpu().numpy()


def device_keys(packed: Any, device: torch.device) -> torch.Tensor:
    """A layer's key summaries (`kvstore.load.summaries.PackedLayer`) unpacked and dequantised on
    `device`: float32 (kv_heads, tokens, head_dim) over all blocks, equal to the CPU's decoding
    (`importance.lowbit.dequantize` of the unpacked codes: the same multiply, then add, in float32).

    One copy of the packed codes (a quarter of a byte per channel at 2 bits, against four bytes of
    float32 decoded on the host), then a few element-wise ops there.

    Raises:
        ValueError: codes that do not fill whole bytes, or partial groups (decode on the host).
    """
    blocks = packed.codes.shape[0]
    heads, tokens, dim = packed.shape
    if 8 % packed.bits or tokens % packed.group_tokens:
        raise ValueError(f"{packed.bits}-bit codes or groups of {packed.group_tokens} of {tokens} tokens")
    codes = torch.from_numpy(packed.codes).to(device, non_blocking=True)
    shifts = torch.arange(0, 8, packed.bits, dtype=torch.uint8, device=device)
    unpacked = (codes.unsqueeze(-1) >> shifts) & ((1 << packed.bits) - 1)  # (blocks, bytes, per_byte)
    count = heads * tokens * dim
    values = unpacked.reshape(blocks, -1)[:, :count].reshape(blocks, heads, -1, packed.group_tokens, dim)
    low = torch.from_numpy(packed.low.astype(np.float32)).to(device)[:, :, :, None]
    step = torch.from_numpy(packed.step.astype(np.float32)).to(device)[:, :, :, None]
    keys = values.float() * step + low  # (blocks, heads, groups, group tokens, dim)
    return keys.reshape(blocks, heads, tokens, dim).permute(1, 0, 2, 3).reshape(heads, blocks * tokens, dim)
