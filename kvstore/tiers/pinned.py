"""Host buffers for the memory tier: page-locked when CUDA exists, plain otherwise.

Pinned buffers let a device copy run asynchronously (DMA) instead of through a
bounce buffer. Everything here degrades to numpy on a machine without CUDA.
"""

from __future__ import annotations

from functools import cache
from pathlib import Path
from typing import Any

import numpy as np


@cache
def cuda_available() -> bool:
    """Whether torch is importable and sees a CUDA device (checked once per process).

    Without an NVIDIA device node there is no CUDA, and importing torch (seconds) is skipped.
    """
    if not any(Path("/dev").glob("nvidia*")):
        return False
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


def host_buffer(data: bytes | memoryview, pinned: bool) -> np.ndarray[Any, Any]:
    """`data` as a read-only uint8 array, page-locked when `pinned` and CUDA exists.

    An immutable buffer (bytes) is kept without a copy unless it must be pinned.
    """
    src = np.frombuffer(data, dtype=np.uint8)
    if memoryview(data).readonly and not (pinned and cuda_available()):
        return src
    if pinned and cuda_available():
        import torch

        out = torch.empty(src.size, dtype=torch.uint8, device="cpu", pin_memory=True).numpy()
        out[:] = src
    else:
        out = src.copy()
    out.flags.writeable = False
    return out
