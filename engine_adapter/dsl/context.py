"""Branch contexts (token history plus KV cache) and one decode step for several branches."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from engine_adapter.batch import left_pad, padding_mask
from engine_adapter.cache import cache_from, share_cache
from engine_adapter.chat import Conversation


def cache_length(cache: Any) -> int:
    """Tokens held by a cache."""
    return int(cache.get_seq_length()) if cache is not None else 0


@dataclass
class Context:
    """One branch's conversation: computed tokens (in `cache`) and tokens still to compute."""

    tokens: list[int] = field(default_factory=list)
    pending: list[int] = field(default_factory=list)
    cache: Any = None
    logits: torch.Tensor | None = None  # of the last computed token
    conversation: Conversation = field(default_factory=Conversation)  # its messages, for the chat template

    @property
    def next_position(self) -> int:
        """Position of the next token to compute."""
        return len(self.tokens)

    def fork(self, config: Any) -> Context:
        """A child context on the same computed tokens, sharing their KV tensors (copy on write)."""
        return Context(
            list(self.tokens), [], share_cache(self.cache, config), self.logits, self.conversation.copy()
        )


def batched_step(
    model: Any, caches: list[Any], tokens: list[int], positions: list[int]
) -> tuple[torch.Tensor, list[Any]]:
    """One decode step for several branches at once.

    Caches of different lengths are left-padded into one batch with an attention
    mask; each branch's new cache is its row of the result (views, no copy).
    Returns logits (batch, vocab) and the new caches.
    """
    lengths = [cache_length(c) for c in caches]
    width = max(lengths)
    pairs = [
        (
            left_pad([cache.layers[index].keys[0] for cache in caches], dim=1),
            left_pad([cache.layers[index].values[0] for cache in caches], dim=1),
        )
        for index in range(len(caches[0].layers))
    ]
    batch = cache_from(model.config, pairs)
    mask = padding_mask(lengths, extra=1)  # and the new token of every row
    out = model(
        input_ids=torch.tensor(tokens).unsqueeze(1), attention_mask=mask,
        position_ids=torch.tensor(positions).unsqueeze(1), past_key_values=batch, use_cache=True,
    )  # fmt: skip
    rows = []
    for row, length in enumerate(lengths):
        start = width - length
        pairs = [
            (layer.keys[row : row + 1, :, start:], layer.values[row : row + 1, :, start:])
            for layer in batch.layers
        ]
        rows.append(cache_from(model.config, pairs))
    return out.logits[:, -1], rows
