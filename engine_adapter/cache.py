"""Building DynamicCaches from tensors without copying them.

A fork shares its parent's KV tensors; appending to a DynamicCache concatenates
into new tensors, so the parent's are never written: copy on write for free.
"""

from __future__ import annotations

from typing import Any

import torch


def cache_from(config: Any, pairs: list[tuple[torch.Tensor, torch.Tensor]]) -> Any:
    """A DynamicCache holding exactly these (keys, values) tensors per layer, uncopied.

    `DynamicCache.update` on an empty layer would concatenate onto an empty tensor,
    copying the whole prefix; setting the layer's tensors directly does not.
    """
    from transformers import DynamicCache

    cache = DynamicCache(config=config)
    for layer, (keys, values) in zip(cache.layers, pairs, strict=True):
        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys, values
    return cache


def share_cache(cache: Any, config: Any) -> Any:
    """A new DynamicCache whose layers reference `cache`'s tensors (no copy)."""
    return cache_from(config, [(layer.keys, layer.values) for layer in cache.layers])
