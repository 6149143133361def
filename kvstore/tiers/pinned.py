"""Host buffers for the memory tier: page-locked when CUDA exists, plain otherwise.

Pinned buffers let a device copy run asynchronously (DMA) instead of through a
bounce buffer. Everything here degrades to numpy on a machine without CUDA.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import numpy as np


@cache
def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device (checked once per process)."""
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def host_buffer(data: bytes | memoryview, pinned: bool) -> np.ndarray[Any, Any]:
    """A read-only uint8 copy of `data`, page-locked when `pinned` and CUDA exists."""
    src = np.frombuffer(data, dtype=np.uint8)
    if pinned and cuda_available():
        import torch

        out = torch.empty(src.size, dtype=torch.uint8, pin_memory=True).numpy()
        out[:] = src
    else:
        out = src.copy()
    out.flags.writeable = False
    return out
