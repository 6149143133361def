"""Left-padded batches: rows of different lengths, right-aligned, with their attention mask.

Used wherever several sequences run as one batch (`Engine.generate_batch`'s prompts,
the DSL's parallel branches), so the padding and its mask are built one way.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def left_pad(rows: Sequence[torch.Tensor], dim: int, fill: float = 0) -> torch.Tensor:
    """Stack `rows` (equal shapes except along `dim`) into a batch, right-aligned along `dim`.

    The result has a new leading batch axis; each row's padding sits before it and
    holds `fill`. Row tensors are copied, never aliased.
    """
    width = max(row.shape[dim] for row in rows)
    shape = list(rows[0].shape)
    shape[dim] = width
    batch = rows[0].new_full((len(rows), *shape), fill)
    for index, row in enumerate(rows):
        length = row.shape[dim]
        batch[index].narrow(dim, width - length, length).copy_(row)
    return batch


def padding_mask(lengths: Sequence[int], extra: int = 0, *, device: torch.device | str) -> torch.Tensor:
    """The attention mask (batch, max length + extra) of left-padded rows of these lengths, on
    `device` (the model's: no default, a mask left on the CPU fails a model on a GPU).

    1 on each row's own tokens and on `extra` new positions after the widest row, 0 on padding.
    """
    width = max(lengths)
    mask = torch.zeros(len(lengths), width + extra, dtype=torch.long, device=device)
    for row, length in enumerate(lengths):
        mask[row, width - length :] = 1
    return mask
