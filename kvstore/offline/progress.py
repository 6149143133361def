"""A progress bar for the offline jobs (fsck, relayout) when a person watches them."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TypeVar

T = TypeVar("T")


def progress_bar(items: Iterable[T], enabled: bool, desc: str, total: int | None = None) -> Iterable[T]:
    """`items`, counted on stderr by tqdm when `enabled` (imported only then: it is slow to load)."""
    if not enabled:
        return items
    from tqdm import tqdm

    return tqdm(items, total=total, desc=desc, unit="block")
