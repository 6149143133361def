"""Simulating partial loads by masking, layer by layer, inside the model's attention.

The whole prefix stays in the cache at its true positions; a forward pre-hook on
every attention module replaces the additive mask the registered attention
function (`kvsieve`, engine_adapter/runner/attention.py) applies with one that also
hides the prefix tokens a selection leaves out, per layer and, if the selection
says so, per KV head. The selection runs inside the forward pass, when the layer's
queries exist: the first `observe` new tokens' queries (post-RoPE) choose the
chunks, as a store loading layer by layer would. Tests check that this masking
gives the same logits as a real partial cache built from the kept tokens.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from engine_adapter.runner.layered import layer_queries

#: (layer, queries (query_heads, observed, head_dim) post-RoPE) -> keep (rows, prefix) bool,
#: rows = 1 (the whole layer) or the number of KV heads.
Chooser = Callable[[int, np.ndarray], np.ndarray]
#: (layer, every new token's queries (query_heads, new, head_dim), the chooser's keep (1, prefix))
#: -> keep per query row (new, prefix) bool: what each new token sees (e.g. chunks fetched mid-decode).
RowExtender = Callable[[int, np.ndarray, np.ndarray], np.ndarray]


@dataclass
class MaskPlan:
    """What one forward pass keeps of a prefix of `prefix_len` tokens.

    Attributes:
        prefix_len: cached tokens before the new ones.
        observe: how many leading new tokens' queries the chooser sees.
        choose: the selection (see `Chooser`).
        kept: filled per layer during the pass: the keep mask used.
        extend: if set, per query row masks (see `RowExtender`) over the chooser's layer-wide choice.
        row_kept: filled per layer when `extend` is set: the (new, prefix) masks used.
    """

    prefix_len: int
    observe: int
    choose: Chooser
    kept: dict[int, np.ndarray] = field(default_factory=dict)
    extend: RowExtender | None = None
    row_kept: dict[int, np.ndarray] = field(default_factory=dict)

    def delivered_tokens_fraction(self) -> float:
        """Mean share of the prefix's tokens kept (by any query row), over layers and rows."""
        return float(np.mean([self._delivered(layer).mean() for layer in self.kept]))

    def _delivered(self, layer: int) -> np.ndarray:
        if layer in self.row_kept:
            return np.asarray(self.row_kept[layer].any(axis=0))
        return self.kept[layer]


class _Active:
    plans: list[MaskPlan | None] | None = None


_ACTIVE = _Active()


@contextmanager
def masking(model: Any) -> Iterator[None]:
    """Install the pre-hooks on every attention module for the duration of the block."""
    handles = [
        layer.self_attn.register_forward_pre_hook(_pre_hook, with_kwargs=True) for layer in model.model.layers
    ]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextmanager
def plans_active(plans: list[MaskPlan | None]) -> Iterator[None]:
    """Make `plans` the selections of the forward passes run inside the block, one per batch row.

    A row whose plan is None sees the full prefix.
    """
    _ACTIVE.plans = plans
    try:
        yield
    finally:
        _ACTIVE.plans = None


def _pre_hook(module: Any, args: tuple[Any, ...], kwargs: dict[str, Any]) -> tuple[Any, dict[str, Any]]:
    plans = _ACTIVE.plans
    if plans is None or all(p is None for p in plans):
        return args, kwargs
    layer = module.layer_idx
    hidden = kwargs["hidden_states"]
    if len(plans) != hidden.shape[0]:
        raise ValueError(f"{len(plans)} plans for a batch of {hidden.shape[0]}")
    cos, sin = kwargs["position_embeddings"]
    heads = module.config.num_attention_heads
    prefix = next(p.prefix_len for p in plans if p is not None)
    total = prefix + hidden.shape[1]
    per_row = any(p is not None and p.extend is not None for p in plans)
    hide = torch.zeros(len(plans), heads, hidden.shape[1] if per_row else 1, total, dtype=torch.bool)
    for row, plan in enumerate(plans):
        if plan is None:
            continue
        if layer not in plan.kept:
            obs = plan.observe
            queries = layer_queries(module, hidden[row : row + 1, :obs], cos[:1, :obs], sin[:1, :obs])[0]
            plan.kept[layer] = np.asarray(plan.choose(layer, queries.float().numpy()), dtype=bool)
        if plan.extend is not None:
            if layer not in plan.row_kept:
                every = layer_queries(module, hidden[row : row + 1], cos[:1], sin[:1])[0].float().numpy()
                plan.row_kept[layer] = np.asarray(plan.extend(layer, every, plan.kept[layer]), dtype=bool)
            hide[row, :, :, :prefix] = ~torch.from_numpy(plan.row_kept[layer])[None]
            continue
        keep = torch.from_numpy(plan.kept[layer])  # (1 or kv heads, prefix)
        if keep.shape[0] > 1:  # per KV head: every query head of a group sees its KV head's choice
            keep = keep.repeat_interleave(module.num_key_value_groups, dim=0)
        hide[row, :, :, :prefix] = ~keep[:, None]
    kwargs["attention_mask"] = _causal(kwargs.get("attention_mask"), prefix, hidden.shape[1]).masked_fill(
        hide, torch.finfo(torch.float32).min
    )
    return args, kwargs


def _causal(mask: torch.Tensor | None, prefix: int, new: int) -> torch.Tensor:
    """The model's additive mask (1 or batch, 1, new, prefix + new), or a causal one if it gave none."""
    total = prefix + new
    if mask is not None:
        return mask[:, :, :, :total]
    rows = torch.arange(new).unsqueeze(1) + prefix
    allowed = torch.arange(total).unsqueeze(0) <= rows
    return torch.zeros(new, total).masked_fill(~allowed, torch.finfo(torch.float32).min)[None, None]
