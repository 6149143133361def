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

    Each layer's scores stay on the device its attention ran on: a copy to the host per layer
    would make the forward pass wait for the device at every layer. The first read of a
    property averages the layers there and copies the three results to the host in one copy.
    """

    def __init__(self, num_prefix: int, num_layers: int) -> None:
        self.num_prefix = num_prefix
        self.num_layers = num_layers
        #: Per observed layer, on the attention's device: (raw mass, prefill scores, history or None).
        self._layers: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]] = {}
        self._host: tuple[np.ndarray[Any, Any], ...] | None = None

    def observe(self, layer: int, weights: torch.Tensor) -> None:
        """Take one layer's weights (batch 1, heads, queries, keys); nothing leaves their device."""
        w = weights[0].float().mean(dim=0)  # (queries, keys), averaged over heads
        p = self.num_prefix
        new = w[:, p:]
        # How many new queries see key j (causal: all from j on). Made where the weights are: a
        # tensor made without a device lands on the CPU, and dividing a GPU tensor by it fails.
        visible = torch.arange(new.shape[1], 0, -1, dtype=torch.float32, device=w.device)
        mass = new.sum(dim=0)
        history = None
        if p:
            prefix = w[:, :p]
            history = (prefix / prefix.sum(dim=1, keepdim=True).clamp_min(1e-12)).mean(dim=0)
        self._layers[layer] = (mass, mass / visible, history)
        self._host = None

    @property
    def prefill(self) -> np.ndarray[Any, Any]:
        """Prefill scores of the new tokens, averaged over layers."""
        return self._on_host()[1]

    @property
    def prefill_raw(self) -> np.ndarray[Any, Any]:
        """Raw accumulated mass of the new tokens (the baseline), averaged over layers."""
        return self._on_host()[0]

    @property
    def history(self) -> np.ndarray[Any, Any]:
        """History scores of the prefix tokens, averaged over layers."""
        return self._on_host()[2]

    def _on_host(self) -> tuple[np.ndarray[Any, Any], ...]:
        """(raw, prefill, history), each averaged over the observed layers on their device, then
        brought to the host in one copy (the one place statistics leave the device)."""
        if self._host is None:
            layers = [self._layers[layer] for layer in sorted(self._layers)]
            means = [_mean([scores[kind] for scores in layers]) for kind in range(3)]
            sizes = [0 if m is None else int(m.numel()) for m in means]
            parts = [m for m in means if m is not None]
            joined = torch.cat(parts).cpu().numpy() if parts else np.zeros(0, np.float32)
            ends = np.cumsum(sizes)
            self._host = tuple(
                joined[end - size : end].astype(np.float32) for size, end in zip(sizes, ends, strict=True)
            )
        return self._host


def _mean(tensors: list[torch.Tensor | None]) -> torch.Tensor | None:
    """The element-wise mean of the layers' tensors (None where no layer has one), on their device."""
    present = [t for t in tensors if t is not None]
    return torch.stack(present).mean(dim=0) if present else None


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
    device = like.device
    rows = torch.arange(q_len, device=device).unsqueeze(1) + (kv_len - q_len)
    allowed = torch.arange(kv_len, device=device).unsqueeze(0) <= rows
    return torch.zeros(q_len, kv_len, dtype=like.dtype, device=device).masked_fill(~allowed, float("-inf"))
