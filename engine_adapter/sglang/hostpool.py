"""Pages of SGLang's host KV pool in one canonical order, whatever the pool's layout.

SGLang keeps host KV in one tensor per pool (`kv_buffer`), laid out "layer_first"
(token index after the layer), "page_first" (token index before the layer) or
"page_first_direct" (one slot per page). Its own flat page (`get_data_page`)
follows the layout, so bytes written by a page-first process would be misread by
a layer-first one. Pages are therefore stored in one canonical order, that of
SGLang's default layout (page_first), so that its pages move as plain copies:

- MHA: (2 for K/V, page tokens, layers, heads, head_dim);
- MLA: (page tokens, layers, 1, latent dim).

(With the layer-major order first chosen, filling a page-first pool was a strided
copy and `batch_get_v1` reached 0.7 of kvsieve's own shared-memory load.)

`PoolPages.read` copies a page from the pool into a canonical byte buffer and
`write` copies one back: one copy each way, the only copies the v1 methods make
on this side of the sidecar (the sidecar's shared-memory arena is the other end).
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch

Array = np.ndarray[Any, Any]

SUPPORTED_LAYOUTS = ("layer_first", "page_first", "page_first_direct")
# torch has no numpy view for bfloat16 or fp8: copy through an integer type of the same size.
_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PoolPages:
    """Canonical views of one SGLang host pool's pages (MHA or MLA).

    Args:
        pool: an SGLang `HostKVCache` with a single `kv_buffer` tensor on the CPU.

    Raises:
        ValueError: a layout or pool kind this adapter does not handle (named).
    """

    def __init__(self, pool: Any) -> None:
        self.layout = str(pool.layout)
        if self.layout not in SUPPORTED_LAYOUTS:
            raise ValueError(
                f"kvsieve's SGLang backend handles host layouts {SUPPORTED_LAYOUTS}, not {self.layout!r}"
            )
        buffer = getattr(pool, "kv_buffer", None)
        if not isinstance(buffer, torch.Tensor):
            raise ValueError(
                f"kvsieve's SGLang backend needs a host pool with one kv_buffer tensor; "
                f"{type(pool).__name__} has none (split K/V widths and hybrid pools are not handled)"
            )
        if buffer.device.type != "cpu":
            raise ValueError(f"the host pool's kv_buffer must be in host memory, got {buffer.device}")
        self.page_size = int(pool.page_size)
        self.is_mla = self._mla_shape(buffer)
        self._pool = pool
        self._ints = buffer.view(_INT_OF_SIZE[buffer.element_size()])
        self.dtype = str(buffer.dtype).removeprefix("torch.")
        self.canonical_shape = tuple(int(d) for d in self._canonical_view(0).shape)
        self.page_bytes = int(np.prod(self.canonical_shape)) * buffer.element_size()

    @property
    def geometry(self) -> str:
        """The canonical shape as text, e.g. "2x64x30x3x64" (part of the page identity)."""
        return "x".join(str(d) for d in self.canonical_shape)

    def read(self, index: int, out: Array) -> None:
        """Copy the page starting at token slot `index` into `out` (uint8, page_bytes). Reads the pool."""
        source = self._canonical_view(index)
        target = torch.from_numpy(out.view(self._np_int)).view(self.canonical_shape)
        target.copy_(source)

    def write(self, index: int, page: Array) -> None:
        """Copy canonical `page` bytes into the page starting at token slot `index`. Mutates the pool."""
        source = torch.from_numpy(np.ascontiguousarray(page).view(self._np_int)).view(self.canonical_shape)
        self._canonical_view(index).copy_(source)

    def canonical_of_flat(self, flat: torch.Tensor) -> torch.Tensor:
        """A canonical view of one of the pool's own flat pages (`get_data_page(i, flat=True)`,
        or a page buffer SGLang hands the generic `get`); a view, so writing it writes `flat`.

        Raises:
            ValueError: `flat` is not one page of this pool (size or dtype).
        """
        if (
            flat.numel() * flat.element_size() != self.page_bytes
            or flat.element_size() != self._ints.element_size()
        ):
            raise ValueError(
                f"a page of this pool is {self.page_bytes} bytes of {self.dtype}, "
                f"got {flat.numel()} elements of {flat.dtype}"
            )
        ints = flat.view(self._ints.dtype)
        if self.layout == "page_first":  # its pages are in the canonical order already
            return ints.view(self.canonical_shape)
        return ints.view(self._layer_major_shape).permute(*self._swap)  # layer_first, page_first_direct

    def canonical_bytes(self, canonical: torch.Tensor, out: Array) -> None:
        """Copy a canonical page (from `canonical_of_flat`) into `out` (uint8, page_bytes)."""
        torch.from_numpy(out.view(self._np_int)).view(self.canonical_shape).copy_(canonical)

    def fill_canonical(self, canonical: torch.Tensor, page: Array) -> None:
        """Copy canonical `page` bytes into a canonical view (from `canonical_of_flat`). Mutates it."""
        canonical.copy_(
            torch.from_numpy(np.ascontiguousarray(page).view(self._np_int)).view(self.canonical_shape)
        )

    @property
    def _np_int(self) -> np.dtype[Any]:
        return np.dtype(f"<i{self._ints.element_size()}") if self._ints.element_size() > 1 else np.dtype("u1")

    def _mla_shape(self, buffer: torch.Tensor) -> bool:
        # MHA buffers carry a leading K/V axis of 2 (4 dims + 1, or 5 + 1 for page_first_direct).
        return buffer.dim() == (5 if self.layout == "page_first_direct" else 4)

    def _canonical_view(self, index: int) -> torch.Tensor:
        """A view of the pool's page at token slot `index`, permuted to the canonical order."""
        ps, buf = self.page_size, self._ints
        if self.layout == "page_first":  # (2, ps, L, H, D) or (ps, L, 1, D): canonical
            return buf[index : index + ps] if self.is_mla else buf[:, index : index + ps]
        if self.layout == "page_first_direct":  # one slot per page, layer-major inside
            slot = index // ps
            layer_major = buf[slot] if self.is_mla else buf[:, slot]
        else:  # layer_first
            layer_major = buf[:, index : index + ps] if self.is_mla else buf[:, :, index : index + ps]
        return layer_major.permute(*self._swap)

    @property
    def _swap(self) -> tuple[int, ...]:
        """The permutation that exchanges the page-token and layer axes (its own inverse)."""
        return (1, 0, 2, 3) if self.is_mla else (0, 2, 1, 3, 4)

    @property
    def _layer_major_shape(self) -> tuple[int, ...]:
        return tuple(self.canonical_shape[i] for i in self._swap)
