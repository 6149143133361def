"""The background layer reader of layer-by-layer loads (kvstore/load/ahead.py)."""

from __future__ import annotations

import threading

import pytest

from kvstore.errors import ChecksumError
from kvstore.load.ahead import LayersAhead


def test_results_come_in_order_and_the_thread_stays_within_its_lookahead() -> None:
    started: list[int] = []
    gate = threading.Event()

    def work(layer: int) -> int:
        started.append(layer)
        if layer == 1:
            gate.set()
        return layer * 10

    ahead = LayersAhead(work, num_layers=30, ahead=2)
    try:
        assert gate.wait(10)  # layers 0 and 1 start before anyone asks (ahead 2)
        assert ahead.get(0) == 0
        assert ahead.get(1) == 10 and ahead.get(5) == 50
        assert max(started) <= 5 + 2  # never more than `ahead` past the last layer asked for
        assert started == sorted(started) and len(set(started)) == len(started)
    finally:
        ahead.stop()


def test_a_failed_layer_raises_for_its_asker_and_stops_the_thread() -> None:
    def work(layer: int) -> int:
        if layer == 3:
            raise ChecksumError("summary of layer 3 is corrupt")
        return layer

    ahead = LayersAhead(work, num_layers=10, ahead=8)
    try:
        assert [ahead.get(layer) for layer in range(3)] == [0, 1, 2]
        with pytest.raises(ChecksumError, match="layer 3"):
            ahead.get(3)
    finally:
        ahead.stop()


def test_stop_ends_a_waiting_thread_and_bad_arguments_are_refused() -> None:
    ahead = LayersAhead(lambda layer: layer, num_layers=100, ahead=1)
    ahead.stop()
    ahead.stop()  # idempotent
    with pytest.raises(RuntimeError, match="stopped"):
        ahead.get(50)
    two = LayersAhead(lambda layer: layer, num_layers=2)
    with pytest.raises(IndexError, match="outside"):
        two.get(2)
    two.stop()
    with pytest.raises(ValueError, match="ahead"):
        LayersAhead(lambda layer: layer, num_layers=2, ahead=0)
