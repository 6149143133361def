"""An attention function that can report attention statistics, registered with transformers.

When a forward pass carries `kvsieve_stats=AttentionStats(...)`, each layer
computes attention explicitly and hands its weights to the collector; otherwise
the fast path (sdpa) runs. The mask function is registered under the same name:
without it transformers silently gives a custom attention function no causal mask.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

ATTENTION_NAME = "kvsieve"


def register_attention() -> None:
    """Register the attention function and its (additive, eager-style) mask. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(ATTENTION_NAME, kvsieve_attention)
    AttentionMaskInterface.register(ATTENTION_NAME, eager_mask)


class AttentionStats:
    """Per-layer statistics of one forward pass over `num_queries` new tokens.

    The cache before the pass holds `num_prefix` tokens (possibly a subset of the
    prompt's prefix, in cache order). Two scores per layer:

    - `prefill`: for each new token as a key, its attention mass from the new
      queries that could see it, divided by how many could (raw accumulated
      mass favours early tokens: it measured no better than random here).
    - `history`: for each prefix token, how the new queries attended to it, each
      query's weights normalised over the prefix first (the "history" of real queries).
    """

    def __init__(self, num_prefix: int, num_layers: int) -> None:
        self.num_prefix = num_prefix
        self.prefill_by_layer: list[np.ndarray[Any, Any] | None] = [None] * num_layers
        self.raw_by_layer: list[np.ndarray[Any, Any] | None] = [None] * num_layers
        self.history_by_layer: list[np.ndarray[Any, Any] | None] = [None] * num_layers

    def observe(self, layer: int, weights: torch.Tensor) -> None:
        """Take one layer's weights (batch 1, heads, queries, keys)."""
        w = weights[0].float().mean(dim=0)  # (queries, keys), averaged over heads
        p = self.num_prefix
        new = w[:, p:]
        visible = torch.arange(new.shape[1], 0, -1, dtype=torch.float32)  # queries that see key j
        mass = new.sum(dim=0)
        self.raw_by_layer[layer] = mass.cpu().numpy()
        self.prefill_by_layer[layer] = (mass / visible).cpu().numpy()
        if p:
            prefix = w[:, :p]
            per_query = prefix / prefix.sum(dim=1, keepdim=True).clamp_min(1e-12)
            self.history_by_layer[layer] = per_query.mean(dim=0).cpu().numpy()

    @property
    def prefill(self) -> np.ndarray[Any, Any]:
        """Prefill scores of the new tokens, averaged over layers."""
        return _mean([x for x in self.prefill_by_layer if x is not None])

    @property
    def prefill_raw(self) -> np.ndarray[Any, Any]:
        """Raw accumulated mass of the new tokens (the baseline), averaged over layers."""
        return _mean([x for x in self.raw_by_layer if x is not None])

    @property
    def history(self) -> np.ndarray[Any, Any]:
        """History scores of the prefix tokens, averaged over layers."""
        return _mean([x for x in self.history_by_layer if x is not None])


def _mean(arrays: list[np.ndarray[Any, Any]]) -> np.ndarray[Any, Any]:
    if not arrays:
        return np.zeros(0, np.float32)
    return np.mean(np.stack(arrays), axis=0).astype(np.float32)


def kvsieve_attention(
    module: Any,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    **kwargs: Any,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Attention with optional statistics; same contract as transformers' attention functions."""
    stats: AttentionStats | None = kwargs.get("kvsieve_stats")
    if stats is None:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling, **kwargs)
    groups = query.shape[1] // key.shape[1]
    key = key.repeat_interleave(groups, dim=1)
    value = value.repeat_interleave(groups, dim=1)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    scores = scores + _causal_mask(attention_mask, query.shape[2], key.shape[2], scores)
    weights = torch.softmax(scores, dim=-1, dtype=torch.float32).to(query.dtype)
    stats.observe(module.layer_idx, weights)
    output = torch.matmul(weights, value).transpose(1, 2).contiguous()
    return output, None


def _causal_mask(mask: torch.Tensor | None, q_len: int, kv_len: int, like: torch.Tensor) -> torch.Tensor:
    """The additive mask, or a bottom-right causal one when transformers skipped it."""
    if mask is not None:
        return mask[:, :, :, :kv_len]
    rows = torch.arange(q_len).unsqueeze(1) + (kv_len - q_len)
    allowed = torch.arange(kv_len).unsqueeze(0) <= rows
    return torch.zeros(q_len, kv_len, dtype=like.dtype).masked_fill(~allowed, float("-inf"))
