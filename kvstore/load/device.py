"""Moving loaded KV to an accelerator: through a pinned staging buffer, asynchronously.

Behind a device check: without CUDA (tests, this machine) the KV becomes a CPU
tensor and nothing else changes.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from kvstore.tiers.pinned import cuda_available


def to_device(kv: np.ndarray[Any, Any], device: str = "cuda") -> Any:
    """A torch tensor of `kv` on `device`.

    On CUDA the array is copied once into page-locked memory and from there by
    DMA (`non_blocking=True`), so the copy overlaps with the caller's work; call
    `torch.cuda.current_stream().synchronize()` (or use the tensor on the same
    stream) before reading it. Elsewhere it returns a CPU tensor that owns its data.
    """
    import torch

    if device == "cpu" or not cuda_available():
        return torch.from_numpy(np.array(kv))  # owns its data: the arena may be reused
    host = (
        torch.from_numpy(np.ascontiguousarray(kv)) if kv.flags.writeable else torch.from_numpy(np.array(kv))
    )
    staging = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staging.copy_(host)
    return staging.to(device, non_blocking=True)
