"""How far each plan kind's runs fall from what the rates say: `Calibration`, learned from every run
and applied to the estimates of plans not yet measured (engine_adapter/runner/costs.py).

Rates miss two things, and they look different:
- fixed costs, paid by every run whatever its size (opening the read, page-locking new arena
  segments, starting the tail's thread, Python per request): a run takes longer than the rates say,
  by about as much at 4k tokens as at 32k. Learned as `fixed`, added.
- rates that are too slow (a prior, a disk probed cold where the page cache serves the load): a run
  takes a share of what the rates say, the same share at every length. Learned as `scale` (< 1),
  multiplied. Never as a negative fixed cost: rates too slow by 10x would then make every plan of
  the kind look free at the next length, and each of them be tried in turn.

A run slower than its rates counts as fixed cost, one faster as a scale, each a decayed mean per
plan kind and tier state (a cold load opens and page-locks, a warm one does not); a state never
run borrows a neighbouring one's.
"""

from __future__ import annotations

from typing import NamedTuple

#: Weight of the newest run in a kind's fixed cost and scale.
DECAY = 0.3

#: (plan kind, tier bucket) -- the bucket None for recompute, which reads nothing.
Where = tuple[str, int | None]


class Fit(NamedTuple):
    """measured ~ scale * rates + fixed."""

    scale: float = 1.0
    fixed: float = 0.0


class Calibration:
    """`Fit`s per plan kind and tier state (module docstring). Not thread-safe."""

    def __init__(self) -> None:
        self._fits: dict[Where, Fit] = {}

    def learn(self, where: Where, rated_s: float, measured_s: float) -> None:
        """A run the rates put at `rated_s` took `measured_s`."""
        if rated_s <= 0 or measured_s <= 0:
            return
        scale, fixed = min(measured_s / rated_s, 1.0), max(measured_s - rated_s, 0.0)
        old = self._fits.get(where)
        if old is not None:
            scale = (1 - DECAY) * old.scale + DECAY * scale
            fixed = (1 - DECAY) * old.fixed + DECAY * fixed
        self._fits[where] = Fit(scale, fixed)

    def fit(self, where: Where) -> Fit:
        """The fit at `where`, else at a neighbouring tier state of the same kind (a quarter more or
        less of the prefix in memory), else none: (1, 0). Not from further: a cold load's fixed
        costs (opening, page-locking) would make a warm one look as slow, and never be tried."""
        if where in self._fits:
            return self._fits[where]
        kind, tier = where
        near = [f for (k, t), f in self._fits.items() if k == kind and abs((t or 0) - (tier or 0)) <= 1]
        return near[0] if near else Fit()

    def apply(self, where: Where, rated_s: float) -> float:
        """`rated_s` as this kind's runs at `where` turn out: scaled, plus the fixed cost."""
        scale, fixed = self.fit(where)
        return scale * rated_s + fixed
