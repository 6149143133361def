"""Moving KV between vLLM's paged caches and kvsieve's `(layers, 2, heads, tokens, dim)`.

Each attention backend of vLLM keeps one tensor per layer and reads it its own
way. `CacheLayout` records which way (found from the backend vLLM reports, see
`detect`) and exposes every supported layout through one strided view,
`token_view`: `[num_blocks, block_size, kv_heads, 2, head_dim]` (K at index 0 of
the fourth axis, V at 1), never a copy. A token is then addressed by (block id,
offset), and every transfer is one indexed copy per layer: `index_select` /
`index_copy_` over flattened slots where the view allows it (a token-major
physical layout), one advanced-index gather / `index_put_` otherwise (head-major
layouts). No loop over tokens or blocks, and it runs on whatever device the cache is.

The layouts (vLLM 0.32, `vllm/v1/attention/backends/*`, `vllm/v1/kv_cache_interface.py`):

- `cpu_tiles`: `CPU_ATTN`. Logical `[blocks, heads, block_size, 2*dim]`, physical
  `LBHNC`; the kernel reads each (block, head) tile as `[2*block_size, dim]`: the
  block's keys in the first `block_size` rows, its values in the next.
- `kv_content`: `FLASH_ATTN`, `FLASHINFER`, `TRITON_ATTN`, `FLEX_ATTENTION`. Logical
  `[blocks, heads, block_size, dim_k + dim_v]`, each token's key then its value in
  the last axis (the backends split it with `.split(head_size, dim=-1)`); the
  physical order is any of vLLM's `KVCacheLayout`s (`LBNHC` = NHD, `LBHNC` = HND,
  and the block-outermost ones), which the tensor's strides already carry.
- `kv_axis`: backends of vLLM before 0.32 that publish `get_kv_cache_shape` with a
  separate K/V axis (FlashAttention's `(2, blocks, block_size, heads, dim)`,
  FlashInfer's `(blocks, 2, block_size, heads, dim)`, NHD or HND through their
  stride order): the axes are read off `get_kv_cache_shape` itself (`axes_from_shape_fn`).
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Sequence
from dataclasses import dataclass
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

CPU_TILES = "cpu_tiles"
KV_CONTENT = "kv_content"
KV_AXIS = "kv_axis"

#: vLLM 0.32 backends by `get_name()`, with the module their class must come from
#: (ROCm's AITER FlashAttention also calls itself "FLASH_ATTN" but packs its cache
#: differently, so the name alone is not enough).
BACKENDS: dict[str, tuple[str, str]] = {
    "CPU_ATTN": ("vllm.v1.attention.backends.cpu_attn", CPU_TILES),
    "FLASH_ATTN": ("vllm.v1.attention.backends.flash_attn", KV_CONTENT),
    "FLASHINFER": ("vllm.v1.attention.backends.flashinfer", KV_CONTENT),
    "TRITON_ATTN": ("vllm.v1.attention.backends.triton_attn", KV_CONTENT),
    "FLEX_ATTENTION": ("vllm.v1.attention.backends.flex_attention", KV_CONTENT),
}


class Slots(NamedTuple):
    """Where a run of tokens lives in the paged cache: one (block id, offset) per token."""

    block_ids: torch.Tensor
    offsets: torch.Tensor

    def to(self, device: torch.device) -> Slots:
        """The same slots on `device` (index tensors must sit with the cache they index)."""
        if self.block_ids.device == device:
            return self
        return Slots(self.block_ids.to(device), self.offsets.to(device))


@dataclass(frozen=True)
class CacheLayout:
    """How one backend's per-layer cache tensor holds K and V.

    Attributes:
        backend: vLLM's name of the attention backend ("FLASH_ATTN", ...).
        kind: `CPU_TILES`, `KV_CONTENT` or `KV_AXIS` (module docstring).
        head_dim: size of one head's key (and value).
        axes: `KV_AXIS` only: the layer tensor's axes of (block, offset, head, K/V, dim).
        physical: vLLM's physical layout name where it reports one ("LBNHC", "NHD", ...), for messages.
    """

    backend: str
    kind: str
    head_dim: int
    axes: tuple[int, ...] = (0, 1, 2, 3, 4)
    physical: str = ""

    @property
    def block_axis(self) -> int:
        """Axis of the block id in a layer tensor."""
        return self.axes[0] if self.kind == KV_AXIS else 0

    def token_view(self, cache: torch.Tensor) -> torch.Tensor:
        """`[..., blocks, block_size, heads, 2, head_dim]` view of a layer tensor, or of a stack of
        them (extra leading axes kept), in this layout. Never a copy.

        Raises:
            InvalidInputError: the tensor does not have this layout's shape for `head_dim`.
        """
        d = self.head_dim
        if self.kind == KV_AXIS:
            lead = cache.dim() - 5
            if lead < 0 or cache.shape[lead + self.axes[3]] != 2 or cache.shape[lead + self.axes[4]] != d:
                raise self._mismatch(cache)
            return cache.permute(*range(lead), *(lead + a for a in self.axes))
        lead = cache.dim() - 4
        if lead < 0 or cache.shape[-1] != 2 * d:
            raise self._mismatch(cache)
        blocks, heads, block_size = cache.shape[-4:-1]
        keep = tuple(range(lead))
        if self.kind == CPU_TILES:
            # A (block, head) tile's block_size * 2d elements, reread as [2, block_size, d].
            try:
                tiles = cache.view(*cache.shape[:lead], blocks, heads, 2, block_size, d)
            except RuntimeError as exc:
                raise InvalidInputError(
                    f"{self.backend} cache of shape {tuple(cache.shape)} and strides {cache.stride()} "
                    "does not keep each (block, head) tile contiguous, as its kernel reads it"
                ) from exc
            return tiles.permute(*keep, lead, lead + 3, lead + 1, lead + 2, lead + 4)
        split = cache.unflatten(-1, (2, d))  # [..., blocks, heads, block_size, 2, d]
        return split.permute(*keep, lead, lead + 2, lead + 1, lead + 3, lead + 4)

    def check(self, cache: torch.Tensor, num_kv_heads: int, block_size: int) -> None:
        """Raise unless `cache` is one layer of this layout for the given heads and block size."""
        view = self.token_view(cache)
        if view.dim() != 5 or view.shape[1] != block_size or view.shape[2] != num_kv_heads:
            raise InvalidInputError(
                f"vLLM KV cache layer {tuple(cache.shape)} ({self.describe()}) does not match "
                f"{num_kv_heads} KV heads in blocks of {block_size}"
            )

    def describe(self) -> str:
        """One phrase naming the layout, for logs and errors."""
        physical = f", physical {self.physical}" if self.physical else ""
        return f"backend {self.backend}, {self.kind}{physical}"

    def _mismatch(self, cache: torch.Tensor) -> InvalidInputError:
        return InvalidInputError(
            f"vLLM KV cache layer of shape {tuple(cache.shape)} is not the {self.describe()} "
            f"layout for head_dim {self.head_dim}"
        )


def cpu_layout(head_dim: int) -> CacheLayout:
    """The layout of vLLM's CPU backend (`CPU_ATTN`)."""
    return CacheLayout("CPU_ATTN", CPU_TILES, head_dim, physical="LBHNC")


def detect(
    backend: type,
    head_dim: int,
    *,
    head_dim_v: int | None = None,
    physical: str = "",
    sample: torch.Tensor | None = None,
) -> CacheLayout:
    """The layout of the attention backend class vLLM reports (`get_current_attn_backends`).

    vLLM 0.32 backends are known by name and module (`BACKENDS`); an older backend
    that publishes `get_kv_cache_shape` is read from that shape. `sample` (one layer's
    tensor) is checked against the result.

    Raises:
        InvalidInputError: an unknown backend or layout, or keys and values of different sizes;
            the message names the backend and the shape.
    """
    name = str(backend.get_name()) if hasattr(backend, "get_name") else backend.__name__
    module = getattr(backend, "__module__", "")
    shape = tuple(sample.shape) if sample is not None else None
    if head_dim_v is not None and head_dim_v != head_dim:
        raise InvalidInputError(
            f"KVSieveConnector stores keys and values of one size; backend {name} has "
            f"head_size {head_dim} and head_size_v {head_dim_v}"
        )
    known = BACKENDS.get(name)
    if known is not None and module == known[0]:
        found = CacheLayout(name, known[1], head_dim, physical=physical)
    elif hasattr(backend, "get_kv_cache_shape"):
        axes = axes_from_shape_fn(backend.get_kv_cache_shape, name)
        found = CacheLayout(name, KV_AXIS, head_dim, axes, physical)
    else:
        raise InvalidInputError(
            f"KVSieveConnector does not know the KV cache layout of attention backend {name} "
            f"({module}.{backend.__name__}, cache shape {shape}); supported: "
            f"{sorted(BACKENDS)} and backends publishing get_kv_cache_shape with a K/V axis"
        )
    if sample is not None:
        found.token_view(sample)  # raises with the backend and shape named
    return found


def axes_from_shape_fn(get_kv_cache_shape: Callable[..., Sequence[int]], backend: str) -> tuple[int, ...]:
    """(block, offset, head, K/V, dim) axes of a backend's `get_kv_cache_shape(num_blocks,
    block_size, num_kv_heads, head_size)`, found by asking it for a shape whose sizes differ.

    Raises:
        InvalidInputError: the shape is not those five axes (MLA's 3-D cache, a packed layout...).
    """
    probe = {"block": 7, "offset": 48, "head": 5, "kv": 2, "dim": 80}
    try:
        asked = get_kv_cache_shape(probe["block"], probe["offset"], probe["head"], probe["dim"])
        shape = tuple(int(s) for s in asked)
    except Exception as exc:
        raise InvalidInputError(f"backend {backend}: get_kv_cache_shape failed ({exc})") from exc
    if sorted(shape) != sorted(probe.values()):
        raise InvalidInputError(
            f"KVSieveConnector does not know the KV cache layout of attention backend {backend}: "
            f"get_kv_cache_shape(blocks=7, block_size=48, kv_heads=5, head_size=80) gives {shape}, "
            "not one axis each for blocks, tokens, heads, K/V and head size"
        )
    return tuple(shape.index(probe[k]) for k in ("block", "offset", "head", "kv", "dim"))


def slots_of(positions: Array | Sequence[int], block_table: Sequence[int], block_size: int) -> Slots:
    """Block id and offset of each token position, given the request's block table."""
    pos = torch.as_tensor(np.asarray(positions, dtype=np.int64))
    table = torch.as_tensor(np.asarray(block_table, dtype=np.int64))
    if len(pos) and int(pos.max()) >= len(table) * block_size:
        raise InvalidInputError(
            f"token position {int(pos.max())} is past the request's {len(table)} blocks of {block_size}"
        )
    return Slots(table[pos // block_size], pos % block_size)


def _flat_slots(view: torch.Tensor) -> torch.Tensor | None:
    """`view` `[blocks, block_size, ...]` as `[blocks * block_size, ...]` when that is a view, else None."""
    if view.stride(0) != view.shape[1] * view.stride(1):
        return None
    return view.view(view.shape[0] * view.shape[1], *view.shape[2:])


def gather_layer(cache: torch.Tensor, slots: Slots, layout: CacheLayout) -> torch.Tensor:
    """KV of the tokens at `slots` in one layer, `(2, heads, tokens, head_dim)`, on the cache's device."""
    view = layout.token_view(cache)
    slots = slots.to(cache.device)
    flat = _flat_slots(view)
    if flat is not None:
        picked = torch.index_select(flat, 0, slots.block_ids * view.shape[1] + slots.offsets)
    else:
        picked = view[slots.block_ids, slots.offsets]  # one gather: [tokens, heads, 2, dim]
    return picked.permute(2, 1, 0, 3)


def scatter_layer(cache: torch.Tensor, layer_kv: torch.Tensor, slots: Slots, layout: CacheLayout) -> None:
    """Write `layer_kv` `(2, heads, tokens, head_dim)` into one layer at `slots` (mutates `cache`).

    `layer_kv` must be on the cache's device; it is converted to the cache's dtype.
    """
    view = layout.token_view(cache)
    slots = slots.to(cache.device)
    source = layer_kv.permute(2, 1, 0, 3).to(cache.dtype)  # [tokens, heads, 2, dim]
    flat = _flat_slots(view)
    if flat is not None:
        flat.index_copy_(0, slots.block_ids * view.shape[1] + slots.offsets, source)
    else:
        view.index_put_((slots.block_ids, slots.offsets), source)


def gather(layers: Sequence[torch.Tensor], slots: Slots, layout: CacheLayout) -> torch.Tensor:
    """KV of the tokens at `slots`, shape `(layers, 2, heads, tokens, head_dim)`, in cache dtype."""
    return torch.stack([gather_layer(layer, slots, layout) for layer in layers])


def scatter(layers: Sequence[torch.Tensor], kv: torch.Tensor, slots: Slots, layout: CacheLayout) -> None:
    """Write `kv` `(layers, 2, heads, tokens, head_dim)` into the cache at `slots` (mutates `layers`)."""
    if kv.shape[0] != len(layers) or kv.shape[3] != len(slots.offsets):
        raise InvalidInputError(
            f"kv of shape {tuple(kv.shape)} does not fit {len(layers)} layers and {len(slots.offsets)} slots"
        )
    for layer, layer_kv in zip(layers, kv, strict=True):
        scatter_layer(layer, layer_kv.to(layer.device), slots, layout)


def copy_blocks(
    layers: Sequence[torch.Tensor],
    block_ids: Sequence[int],
    layout: CacheLayout,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """A copy of whole cache blocks, one layer tensor per leading index, in vLLM's own axis order
    (the layer tensor with `len(block_ids)` blocks).

    One `index_select` per layer into one tensor (`out`, else a new one on the cache's
    device): the fast part of a save, done before vLLM may reuse the blocks.
    `blocks_to_kv` puts the copy in kvsieve's layout later.
    """
    first = layers[0]
    ids = torch.as_tensor(np.asarray(block_ids, dtype=np.int64)).to(first.device)
    if out is None:
        out = torch.empty(block_copy_shape(first, len(ids), layout, len(layers)), dtype=first.dtype,
                          device=first.device)  # fmt: skip
    for i, layer in enumerate(layers):
        torch.index_select(layer, layout.block_axis, ids, out=out[i])
    return out


def block_copy_shape(
    layer: torch.Tensor, num_blocks: int, layout: CacheLayout, num_layers: int
) -> tuple[int, ...]:
    """Shape of `copy_blocks`' result for `num_blocks` blocks of `num_layers` layers like `layer`."""
    shape = list(layer.shape)
    shape[layout.block_axis] = num_blocks
    return (num_layers, *shape)


def blocks_to_kv(blocks: torch.Tensor, layout: CacheLayout, start: int, num_tokens: int) -> Array:
    """KV `(layers, 2, heads, num_tokens, head_dim)` of tokens [start, start + num_tokens) of
    the run of blocks that `copy_blocks` copied (token 0 is offset 0 of its first block).

    Only views are taken in torch; the copy is numpy's, which runs on the calling
    thread alone: the save sender calls this, and a torch op there would start a
    second OpenMP team of threads beside vLLM's, on the same cores (with torch here,
    later forward passes of one 2-core run were ~50% slower; with numpy the gap
    shrank, though not to nothing: docs/performance.md).
    """
    view = layout.token_view(blocks)  # [layers, blocks, block_size, heads, 2, dim]
    layers, num_blocks, block_size, heads, _, dim = view.shape
    if not 0 <= start <= start + num_tokens <= num_blocks * block_size:
        raise InvalidInputError(
            f"tokens [{start}, {start + num_tokens}) of {tuple(blocks.shape)} copied blocks "
            f"({layout.describe()})"
        )
    tiles = np.ascontiguousarray(_strided_numpy(view).transpose(0, 4, 3, 1, 2, 5))
    kv = tiles.reshape(layers, 2, heads, num_blocks * block_size, dim)
    return np.ascontiguousarray(kv[:, :, :, start : start + num_tokens])


def _strided_numpy(tensor: torch.Tensor) -> Array:
    """A numpy view of a CPU tensor with its strides (no copy, no torch kernel)."""
    if tensor.dtype == torch.bfloat16:
        import ml_dtypes

        return tensor.view(torch.uint16).numpy().view(ml_dtypes.bfloat16)
    return tensor.numpy()


def to_numpy(kv: torch.Tensor) -> Array:
    """A numpy array of `kv` in kvsieve's dtype (bfloat16 through ml_dtypes), sharing memory."""
    return _strided_numpy(kv.contiguous())


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
