"""Sampling settings: a plain dataclass, importable without torch (the DSL's planner uses it).

The torch side (choosing tokens from logits) is `engine_adapter.decode.Sampler`.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvstore.errors import InvalidInputError


@dataclass(frozen=True)
class Sampling:
    """How to decode.

    Attributes:
        max_tokens: tokens to generate at most (1..16384).
        temperature: 0 = greedy; otherwise softmax temperature (0, 5].
        top_p: nucleus sampling mass in (0, 1].
        seed: seed of the sampler's generator (same seed, same output).
        stop: strings that end the answer; the answer excludes them.
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 16384:
            raise InvalidInputError(f"max_tokens must be in [1, 16384], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 5.0:
            raise InvalidInputError(f"temperature must be in [0, 5], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if any(not s for s in self.stop):
            raise InvalidInputError("stop strings must not be empty")


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
