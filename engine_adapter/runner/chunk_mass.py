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
