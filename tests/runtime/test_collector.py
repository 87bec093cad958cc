"""collection_paused: no collection inside, the collector as it was after, and the garbage made
inside still collected by the next collection."""
from __future__ import annotations

import gc

import pytest

from scaleloop.runtime.collector import collection_paused


class _Cycle:
    finalized: list[str] = []

    def __init__(self, name: str) -> None:
        self.name, self.me = name, self

    def __del__(self) -> None:
        _Cycle.finalized.append(self.name)


def test_no_collection_runs_inside_and_the_garbage_made_there_is_collected_after() -> None:
    _Cycle.finalized.clear()
    full_passes: list[int] = []

    def note(phase: str, info: dict) -> None:
        if phase == "start":
            full_passes.append(info["generation"])

    gc.callbacks.append(note)
    try:
        with collection_paused():
            assert not gc.isenabled()
            for i in range(3):
                _Cycle(f"cycle-{i}")       # garbage at once, but only the collector frees a cycle
            kept = [[] for _ in range(10 * gc.get_threshold()[0])]   # would start collections
            inside = list(full_passes)
            assert _Cycle.finalized == [] and len(kept) > 0
        assert gc.isenabled()
        gc.collect()
    finally:
        gc.callbacks.remove(note)
    assert inside == []                                   # no collection while paused
    assert sorted(_Cycle.finalized) == ["cycle-0", "cycle-1", "cycle-2"]


@pytest.mark.parametrize("enabled", [True, False])
def test_the_collector_is_left_as_it_was_even_after_an_error(enabled: bool) -> None:
    (gc.enable if enabled else gc.disable)()
    try:
        with pytest.raises(RuntimeError), collection_paused():
            raise RuntimeError("while building")
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
