"""What the connector's worker half passes around: a load's outcome, a save's copy, layer order."""

from __future__ import annotations

import re
import threading
from dataclasses import dataclass
from typing import NamedTuple

import torch

from kvstore.errors import InvalidInputError


class LoadOutcome(NamedTuple):
    """What one load wrote: the tokens placed and the vLLM blocks that must be recomputed."""

    written_tokens: int
    failed_blocks: frozenset[int]


@dataclass
class SaveJob:
    """One save, copied out of vLLM's cache: what the sender thread stores.

    Attributes:
        tokens: the prefix stored (whole kvsieve blocks).
        kv_start: first position whose KV is sent.
        blocks: copy of the vLLM blocks holding [kv_start, len(tokens)) (`layout.copy_blocks`),
            in host memory (pinned, from the worker's pool, when the cache is on CUDA).
        offset: where kv_start lies in the copy (its offset in the first copied block).
        block_ids: the vLLM blocks copied (CUDA: filled layer by layer).
        ready: CUDA only: set once every layer's copy is queued and `copied` recorded.
        copied: CUDA only: done when the device-to-host copies have landed in `blocks`.
        layers_done: CUDA only: which layers are copied (or queued) so far.
        device_block_ids: CUDA only: `block_ids` on the cache's device.
    """

    tokens: tuple[int, ...]
    kv_start: int
    blocks: torch.Tensor
    offset: int
    block_ids: tuple[int, ...] = ()
    ready: threading.Event | None = None
    copied: torch.cuda.Event | None = None
    layers_done: set[int] | None = None
    device_block_ids: torch.Tensor | None = None


def layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by the layer number they contain ("model.layers.12.self_attn.attn")."""

    def number(name: str) -> int:
        found = re.findall(r"\.(\d+)\.", f".{name}.")
        if len(found) != 1:
            raise InvalidInputError(f"cannot tell the layer number of KV cache layer {name!r}")
        return int(found[0])

    return sorted(names, key=number)
