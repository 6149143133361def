"""What a request may run and where it stands: `Request`, `Option`, and the keys that measurements
and estimates are filed under (engine_adapter/runner/costs.py, measured.py, choice.py).

An option is one of the plans the engine runs: recompute the prefix, load all of it (`full`),
compute its first k/16 while the rest loads (`split k/16`), or load it layer by layer with chunks
chosen by the question's queries at a budget (`query-aware 0.25`). Splits come in sixteenths of the
prefix, not at every block boundary, so that a split measured at one request is found again at the
next request of a similar length (at 32k tokens of 256-token blocks, a sixteenth is 8 blocks).

A measurement is filed under what decides how long the plan takes and nothing else:
- the option;
- the prompt's length in powers of two (`length_bucket`): within a bucket, lengths differ by at most
  2x, and measurements are kept per prompt token, so that one at 4,100 tokens speaks for 8,000;
- for loads, the prefix's length in powers of two, and where the prefix lies: the share of its
  blocks in the memory tier, in quarters (`tier_bucket`: 0 cold from disk, 4 all in memory). A cold
  load and a warm one of the same prefix differ by 10-20x on a GPU (issue 47's figures).
Recomputing reads nothing: its key has neither the prefix nor the tier, so a miss (a prompt with
nothing cached, computed whole) measures recompute for every request of that length.
"""

from __future__ import annotations

from dataclasses import dataclass

#: A split computes k sixteenths of the prefix (k = 1..15), rounded to whole blocks.
SPLIT_STEPS = 16
#: The memory tier's share of a prefix's blocks, in quarters.
TIER_STEPS = 4

RECOMPUTE, FULL, SPLIT, QUERY_AWARE = "recompute", "full", "split", "query-aware"

#: What measurements are filed under: (label, prompt bucket) for recompute; (label, prompt bucket,
#: prefix bucket, tier bucket) for a load.
Key = tuple[str, int] | tuple[str, int, int, int]


def length_bucket(tokens: int) -> int:
    """floor(log2(tokens)): 4,096-8,191 tokens are bucket 12."""
    return max(int(tokens), 1).bit_length() - 1


def tier_bucket(memory_fraction: float) -> int:
    """The memory tier's share of the prefix in quarters: 0 (cold) .. 4 (warm)."""
    return round(min(max(memory_fraction, 0.0), 1.0) * TIER_STEPS)


@dataclass(frozen=True)
class Option:
    """A plan a request may run.

    Attributes:
        kind: RECOMPUTE, FULL, SPLIT or QUERY_AWARE.
        step: a split's k: it computes k/16 of the prefix (0 for the other kinds).
        budget: a query-aware load's budget fraction (None for the other kinds).
    """

    kind: str
    step: int = 0
    budget: float | None = None

    @property
    def label(self) -> str:
        """ "recompute", "full", "split 5/16" or "query-aware 0.25": the name measurements go under."""
        if self.kind == SPLIT:
            return f"{SPLIT} {self.step}/{SPLIT_STEPS}"
        if self.kind == QUERY_AWARE:
            return f"{QUERY_AWARE} {self.budget:g}"
        return self.kind


@dataclass(frozen=True)
class Request:
    """Where a request stands: its lengths, where its cached prefix lies, and what it may run.

    Attributes:
        prompt_tokens: the whole prompt.
        prefix_tokens: the cached prefix (whole blocks); 0 when nothing is cached.
        memory_fraction: share of the prefix's blocks the memory tier holds (the rest is on disk).
        token_bytes: KV bytes per token.
        block_tokens: split points lie on whole blocks.
        split: recompute and splits may be chosen (the engine's `split`); else only loads.
        query_aware: the budget fraction of a query-aware load that may be chosen; None: not one.
    """

    prompt_tokens: int
    prefix_tokens: int = 0
    memory_fraction: float = 1.0
    token_bytes: int = 0
    block_tokens: int = 1
    split: bool = True
    query_aware: float | None = None

    @property
    def question_tokens(self) -> int:
        """Tokens computed after the prefix whatever the plan."""
        return self.prompt_tokens - self.prefix_tokens

    @property
    def place(self) -> tuple[int, int, int]:
        """(prompt bucket, prefix bucket, tier bucket): where loads of this request are filed."""
        prefix = length_bucket(self.prefix_tokens)
        return length_bucket(self.prompt_tokens), prefix, tier_bucket(self.memory_fraction)

    def key(self, option: Option) -> Key:
        """What a measurement of `option` at this request is filed under (module docstring)."""
        if option.kind == RECOMPUTE:
            return (option.label, length_bucket(self.prompt_tokens))
        return (option.label, *self.place)

    def compute_tokens(self, option: Option) -> int:
        """Prefix tokens `option` computes from scratch: all for recompute, the head for a split."""
        if option.kind == RECOMPUTE:
            return self.prefix_tokens
        if option.kind != SPLIT:
            return 0
        blocks = round(option.step * self.prefix_tokens / SPLIT_STEPS / self.block_tokens)
        return blocks * self.block_tokens

    def options(self) -> list[Option]:
        """Every plan this request may run: a full load always; recompute and the splits (each
        sixteenth that falls on a distinct block boundary inside the prefix) where `split`; the
        query-aware load where `query_aware`."""
        found = [Option(FULL)]
        if self.split:
            found.append(Option(RECOMPUTE))
            heads = set()
            for step in range(1, SPLIT_STEPS):
                head = self.compute_tokens(Option(SPLIT, step))
                if 0 < head < self.prefix_tokens and head not in heads:
                    heads.add(head)
                    found.append(Option(SPLIT, step))
        if self.query_aware is not None:
            found.append(Option(QUERY_AWARE, budget=self.query_aware))
        return found
