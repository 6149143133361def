"""A batch KV cache that persists across decoding steps.

Rows (one per decoding sequence) live right-aligned in preallocated buffers, one
pair (keys, values) of shape (rows, kv_heads, capacity, head_dim) per layer: row
`i` holds its `lengths[i]` tokens in the columns just before `width`, padding
before them. A step writes every row's new token at column `width`, in place, and
attention reads the views `[:, :, :width + 1]` (`padding_mask` masks the padding).
So a step is one batched forward and copies no KV. Rows are copied only when the
set of rows changes (`add`, `take`, `drop` rebuild the buffers once) or when a
row outgrows the capacity reserved for it.

Sharing: a fork that waits or prefills keeps sharing its parent's tensors (see
`engine_adapter.runner.cache`); entering the batch copies its KV once. Sharing a prefix
inside the batch would need an attention kernel over a shared prefix plus
per-row suffixes (cascade attention), which transformers' sdpa path lacks.
"""

from __future__ import annotations

from collections.abc import Hashable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from engine_adapter.runner.batch import padding_mask
from engine_adapter.runner.cache import cache_from, cache_kwargs

#: Per layer (keys, values) of one row, (1, heads, length, dim).
RowKV = list[tuple[torch.Tensor, torch.Tensor]]


@dataclass
class BatchCacheStats:
    """What the batch cache did (for tests and benchmarks)."""

    steps: int = 0
    rows_copied: int = 0  # rows copied into new buffers (adds and rebuilds after a change)
    rebuilds: int = 0  # buffer allocations: changes of the row set, or capacity exhausted


class _BufferLayer:
    """A cache layer over preallocated buffers: `update` writes in place and returns views."""

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, width: int) -> None:
        self.key_buffer, self.value_buffer = keys, values
        self.width = width

    def attach(self, layer: Any) -> None:
        """Make a transformers `DynamicLayer` read and write through this buffer."""
        keys, values = self.key_buffer, self.value_buffer

        def update(key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            end = self.width + key_states.shape[-2]
            keys[:, :, self.width : end].copy_(key_states)
            values[:, :, self.width : end].copy_(value_states)
            self.width = end
            layer.keys, layer.values = keys[:, :, :end], values[:, :, :end]
            return layer.keys, layer.values

        layer.lazy_initialization(keys, values)
        layer.keys, layer.values = keys[:, :, : self.width], values[:, :, : self.width]
        layer.update = update


class BatchCache:
    """Rows of KV decoding together, kept between steps.

    Args:
        config: the model's config (layers, heads).
        dtype: dtype of the buffers.

    Each row has a key (any hashable, e.g. the branch it belongs to). Usage:
    `add` rows from their own caches, `step` once per token for all rows,
    `take` a row back as its own cache when it stops decoding, `drop` a row
    whose sequence is abandoned.
    """

    def __init__(self, config: Any, dtype: torch.dtype = torch.float32) -> None:
        self._config = config
        self._dtype = dtype
        self._keys: list[Hashable] = []
        self._lengths: list[int] = []
        self._layers: list[_BufferLayer] = []
        self._cache: Any = None
        self._capacity = 0
        self.stats = BatchCacheStats()

    # -- rows ---------------------------------------------------------------------

    def __len__(self) -> int:
        return len(self._keys)

    def __contains__(self, key: Hashable) -> bool:
        return key in self._keys

    @property
    def keys(self) -> list[Hashable]:
        """Row keys, in batch order (the order `step` takes tokens and returns logits)."""
        return list(self._keys)

    @property
    def width(self) -> int:
        """Columns in use: the longest row's length."""
        return max(self._lengths, default=0)

    def length(self, key: Hashable) -> int:
        """Tokens held by a row."""
        return self._lengths[self._index(key)]

    @torch.inference_mode()
    def add(self, rows: Sequence[tuple[Hashable, Any]], reserve: int) -> None:
        """Copy rows in from their own caches (batch 1 each), once; `reserve` = steps to leave room for."""
        if not rows:
            return
        for key, _ in rows:
            if key in self._keys:
                raise ValueError(f"row {key!r} is already in the batch")
        entries = [(self._row_kv(i), n) for i, n in enumerate(self._lengths)]
        entries += [(_kv_of(cache), int(cache.get_seq_length())) for _, cache in rows]
        if self._keys:  # rows already here keep the room they had
            reserve = max(reserve, self._capacity - self.width)
        self._keys += [key for key, _ in rows]
        self._rebuild(entries, reserve)

    @torch.inference_mode()
    def take(self, key: Hashable) -> Any:
        """Remove a row; its KV as a cache of its own (views of the old buffers, no copy)."""
        index = self._index(key)
        cache = cache_from(self._config, self._row_kv(index))
        self._remove(index)
        return cache

    @torch.inference_mode()
    def drop(self, key: Hashable) -> None:
        """Remove a row and forget its KV."""
        self._remove(self._index(key))

    def clear(self) -> None:
        """Remove every row and free the buffers."""
        self._keys, self._lengths, self._layers, self._cache, self._capacity = [], [], [], None, 0

    # -- decoding -----------------------------------------------------------------

    @torch.inference_mode()
    def step(self, model: Any, tokens: Sequence[int], positions: Sequence[int]) -> torch.Tensor:
        """One decoding step for every row; logits (rows, vocab).

        Args:
            model: the transformers model.
            tokens: each row's new token, in `keys` order.
            positions: each row's true position for it (padding is not counted).
        """
        if len(tokens) != len(self._keys) or len(positions) != len(self._keys):
            raise ValueError(f"step got {len(tokens)} tokens for {len(self._keys)} rows")
        if self.width + 1 > self._capacity:  # a row outgrew its reserve: grow once, for many steps
            self._rebuild([(self._row_kv(i), n) for i, n in enumerate(self._lengths)], max(64, self.width))
        device = self._layers[0].key_buffer.device  # the rows' own: where the model computes
        out = model(
            input_ids=torch.tensor(list(tokens), device=device).unsqueeze(1),
            attention_mask=padding_mask(self._lengths, extra=1, device=device),  # and every row's new token
            position_ids=torch.tensor(list(positions), device=device).unsqueeze(1),
            **cache_kwargs(model, self._cache),
        )  # fmt: skip
        self._lengths = [n + 1 for n in self._lengths]
        self.stats.steps += 1
        return out.logits[:, -1]

    def buffers(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The (keys, values) buffers per layer (for tests: they stay the same across steps)."""
        return [(layer.key_buffer, layer.value_buffer) for layer in self._layers]

    # -- internals ----------------------------------------------------------------

    def _index(self, key: Hashable) -> int:
        if key not in self._keys:
            raise KeyError(f"no row {key!r} in the batch")
        return self._keys.index(key)

    def _row_kv(self, index: int) -> RowKV:
        """A row's own tokens per layer, (1, heads, length, dim) views of the buffers."""
        width, length = self.width, self._lengths[index]
        start = width - length
        rows = slice(index, index + 1)
        return [
            (layer.key_buffer[rows, :, start:width], layer.value_buffer[rows, :, start:width])
            for layer in self._layers
        ]

    def _remove(self, index: int) -> None:
        entries = [(self._row_kv(i), n) for i, n in enumerate(self._lengths) if i != index]
        del self._keys[index]
        if not entries:
            self.clear()
            return
        # Rows left keep the room they had: the longest row's remaining reserve.
        self._rebuild(entries, self._capacity - self.width)

    def _rebuild(self, entries: list[tuple[RowKV, int]], reserve: int) -> None:
        """New buffers holding these rows right-aligned, `reserve` free columns after them."""
        lengths = [n for _, n in entries]
        width = max(lengths)
        capacity = width + max(reserve, 1)
        first = entries[0][0]
        layers = []
        for index in range(len(first)):
            like = first[index][0]  # the buffers go where the rows' KV is (the model's device)
            heads, dim = like.shape[1], like.shape[3]
            keys = torch.zeros(len(entries), heads, capacity, dim, dtype=self._dtype, device=like.device)
            values = torch.zeros_like(keys)
            for row, (kv, length) in enumerate(entries):
                keys[row, :, width - length : width].copy_(kv[index][0][0])
                values[row, :, width - length : width].copy_(kv[index][1][0])
            layers.append(_BufferLayer(keys, values, width))
        self._install(layers, lengths, capacity)
        self.stats.rows_copied += len(entries)
        self.stats.rebuilds += 1

    def _install(self, layers: list[_BufferLayer], lengths: list[int], capacity: int) -> None:
        from transformers import DynamicCache

        cache = DynamicCache(config=self._config)
        for buffer, layer in zip(layers, cache.layers, strict=True):
            buffer.attach(layer)
        self._layers, self._lengths, self._cache, self._capacity = layers, lengths, cache, capacity


def _kv_of(cache: Any) -> RowKV:
    """A batch-1 cache's (keys, values) per layer."""
    return [(layer.keys, layer.values) for layer in cache.layers]
