"""Moving KV between vLLM's paged CPU cache and kvsieve's `(layers, 2, heads, tokens, dim)`.

vLLM's CPU attention backend keeps one tensor per layer of shape
`[num_blocks, kv_heads, block_size, 2 * head_dim]`; its kernel reads each
(block, head) tile as `[2 * block_size, head_dim]`: the block's keys in the first
`block_size` rows, its values in the next. `paged_view` exposes exactly that as
`[num_blocks, kv_heads, 2, block_size, head_dim]`, so a token is addressed by
(block id, offset) and every transfer is one indexed copy per layer: no loop over
tokens or blocks.
"""

from __future__ import annotations

import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np
import torch

from kvstore.errors import InvalidInputError

Array = np.ndarray[Any, Any]

#: torch dtypes of vLLM's KV cache and their kvsieve names (kvstore.model.DTYPE_IDS).
DTYPE_NAMES: dict[torch.dtype, str] = {
    torch.float16: "float16",
    torch.bfloat16: "bfloat16",
    torch.float32: "float32",
}


class Slots(NamedTuple):
    """Where a run of tokens lives in the paged cache: one (block id, offset) per token."""

    block_ids: torch.Tensor
    offsets: torch.Tensor


def paged_view(layer: torch.Tensor, head_dim: int) -> torch.Tensor:
    """`[num_blocks, heads, 2, block_size, head_dim]` view of one layer's CPU cache (no copy).

    Raises:
        InvalidInputError: the tensor is not the CPU backend's 4-D layout for `head_dim`.
    """
    if layer.dim() != 4 or layer.shape[3] != 2 * head_dim:
        raise InvalidInputError(
            f"vLLM KV cache layer must be [blocks, heads, block_size, 2*head_dim={2 * head_dim}] "
            f"(the CPU backend's layout), got shape {tuple(layer.shape)}"
        )
    num_blocks, heads, block_size, _ = layer.shape
    return layer.view(num_blocks, heads, 2, block_size, head_dim)


def slots_of(positions: Array | Sequence[int], block_table: Sequence[int], block_size: int) -> Slots:
    """Block id and offset of each token position, given the request's block table."""
    pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    table = torch.as_tensor(np.asarray(block_table, dtype=np.int64))
    if len(pos) and int(pos.max()) >= len(table) * block_size:
        raise InvalidInputError(
            f"token position {int(pos.max())} is past the request's {len(table)} blocks of {block_size}"
        )
    return Slots(table[pos // block_size], pos % block_size)


def gather(layers: Sequence[torch.Tensor], slots: Slots, head_dim: int) -> torch.Tensor:
    """KV of the tokens at `slots`, shape `(layers, 2, heads, tokens, head_dim)`, in cache dtype."""
    per_layer = []
    for layer in layers:
        # Indexing dims 0 and 3 puts the token dim first: [tokens, heads, 2, head_dim].
        picked = paged_view(layer, head_dim)[slots.block_ids, :, :, slots.offsets]
        per_layer.append(picked.permute(2, 1, 0, 3))
    return torch.stack(per_layer)


def copy_blocks(layers: Sequence[torch.Tensor], block_ids: Sequence[int]) -> torch.Tensor:
    """A copy of whole cache blocks, `(layers, len(block_ids), heads, block_size, 2 * head_dim)`.

    One indexed copy per layer into one new tensor, in vLLM's own layout (no
    reordering): the fast part of a save, done before vLLM may reuse the blocks.
    `blocks_to_kv` puts the copy in kvsieve's layout later.
    """
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64))
    first = layers[0]
    out = torch.empty((len(layers), len(ids), *first.shape[1:]), dtype=first.dtype)
    for i, layer in enumerate(layers):
        torch.index_select(layer, 0, ids, out=out[i])
    return out


def blocks_to_kv(blocks: torch.Tensor, head_dim: int, start: int, num_tokens: int) -> Array:
    """KV `(layers, 2, heads, num_tokens, head_dim)` of tokens [start, start + num_tokens) of
    the run of blocks that `copy_blocks` copied (token 0 is offset 0 of its first block).

    Done in numpy, which runs on the calling thread alone: the save sender calls this,
    and a torch op there would start a second OpenMP team of threads beside vLLM's,
    on the same cores (with torch here, later forward passes of one 2-core run were
    ~50% slower; with numpy the gap shrank, though not to nothing: docs/performance.md).
    """
    layers, num_blocks, heads, block_size, width = blocks.shape
    if width != 2 * head_dim or not 0 <= start <= start + num_tokens <= num_blocks * block_size:
        raise InvalidInputError(
            f"tokens [{start}, {start + num_tokens}) of {tuple(blocks.shape)} copied blocks "
            f"with head_dim {head_dim}"
        )
    tiles = to_numpy(blocks).reshape(layers, num_blocks, heads, 2, block_size, head_dim)
    kv = tiles.transpose(0, 3, 2, 1, 4, 5).reshape(layers, 2, heads, num_blocks * block_size, head_dim)
    return np.ascontiguousarray(kv[:, :, :, start : start + num_tokens])


def scatter(layers: Sequence[torch.Tensor], kv: torch.Tensor, slots: Slots, head_dim: int) -> None:
    """Write `kv` `(layers, 2, heads, tokens, head_dim)` into the cache at `slots` (mutates `layers`)."""
    if kv.shape[0] != len(layers) or kv.shape[3] != len(slots.offsets):
        raise InvalidInputError(
            f"kv of shape {tuple(kv.shape)} does not fit {len(layers)} layers and {len(slots.offsets)} slots"
        )
    for layer, layer_kv in zip(layers, kv, strict=True):
        view = paged_view(layer, head_dim)
        view[slots.block_ids, :, :, slots.offsets] = layer_kv.permute(2, 1, 0, 3).to(layer.dtype)


def to_numpy(kv: torch.Tensor) -> Array:
    """A numpy array of `kv` in kvsieve's dtype (bfloat16 through ml_dtypes), sharing memory."""
    kv = kv.contiguous()
    if kv.dtype == torch.bfloat16:
        import ml_dtypes

        return kv.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return kv.numpy()


def from_numpy(kv: Array) -> torch.Tensor:
    """A tensor over numpy KV (bfloat16 from ml_dtypes included), sharing its memory.

    The array may be a read-only view of a shared-memory arena: the tensor must only
    be read (torch's warning about that is silenced; copying 47 MB to quiet it is not worth it).
    """
    raw = kv.view(np.uint16) if kv.dtype.name == "bfloat16" else kv
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        tensor = torch.from_numpy(raw)
    return tensor.view(torch.bfloat16) if kv.dtype.name == "bfloat16" else tensor


def dtype_name(dtype: torch.dtype) -> str:
    """kvsieve's name of a KV cache dtype.

    Raises:
        InvalidInputError: a dtype kvsieve does not store (fp8 caches, for instance).
    """
    if dtype not in DTYPE_NAMES:
        raise InvalidInputError(
            f"KVSieveConnector stores KV caches of dtype {sorted(DTYPE_NAMES.values())}, got {dtype}"
        )
    return DTYPE_NAMES[dtype]
