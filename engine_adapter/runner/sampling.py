"""Sampling settings: a plain dataclass, importable without torch (the DSL's planner uses it).

The torch side (choosing tokens from logits) is `engine_adapter.runner.decode.Sampler`.
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
        no_repeat_ngram: the repetition guard: no run of this many tokens appears twice in
            the answer (the last token of a repeat is never chosen); 0 = off. Off by default
            here, so benchmarks that compare tokens and DSL programs decode the plain model;
            `kvsieve generate` turns it on (GENERATE_NO_REPEAT_NGRAM).
    """

    max_tokens: int = 128
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int | None = None
    stop: tuple[str, ...] = ()
    no_repeat_ngram: int = 0

    def __post_init__(self) -> None:
        if not 1 <= self.max_tokens <= 16384:
            raise InvalidInputError(f"max_tokens must be in [1, 16384], got {self.max_tokens}")
        if not 0.0 <= self.temperature <= 5.0:
            raise InvalidInputError(f"temperature must be in [0, 5], got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidInputError(f"top_p must be in (0, 1], got {self.top_p}")
        if self.no_repeat_ngram != 0 and not 2 <= self.no_repeat_ngram <= 64:
            raise InvalidInputError(
                f"no_repeat_ngram must be 0 (off) or in [2, 64], got {self.no_repeat_ngram}"
            )
        if any(not s for s in self.stop):
            raise InvalidInputError("stop strings must not be empty")


#: `kvsieve generate`'s repetition guard. Greedy SmolLM2 answers loop ("It is designed to
#: learn from data" six times over): with no 4-token run allowed twice the answer moves on
#: after the first words of a repeat. 3 also forbids common phrases used twice
#: ("artificial intelligence" came out as "artificial Intelligence").
GENERATE_NO_REPEAT_NGRAM = 4


def cut_at_stop(text: str, stop: tuple[str, ...]) -> tuple[str, bool]:
    """`text` up to the first stop string, and whether one was found."""
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)
