"""The extender's periodic reload must not hold its requests for a full garbage collection each time.

Benchmark 12 found the extender's event loop busy for about 1 s of wall time in a collection after each periodic
reload (every 30 s): the reload unfroze the whole heap (modules, classes, the view) and walked it, 115-135 ms of CPU
on an idle core, while admission reviews, filters and binds waited. A reload now walks only what was allocated
since the last one; the whole heap is walked every `FULL_COLLECTION_EVERY`-th reload, so cyclic garbage that a
reload froze is still freed.
"""

from __future__ import annotations

import gc
import weakref
from collections.abc import Iterator
from typing import Any

import pytest

from services.extender.resync import FULL_COLLECTION_EVERY, HeapSettler
from services.extender.service import ExtenderService
from shared.ledger.ledger import Ledger
from tests.extender.conftest import add_node


@pytest.fixture
def collections() -> Iterator[list[tuple[int, int]]]:
    """Every collection that starts while the test runs, as (generation, objects frozen at that moment)."""
    seen: list[tuple[int, int]] = []

    def record(phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            seen.append((info["generation"], gc.get_freeze_count()))

    gc.callbacks.append(record)
    try:
        yield seen
    finally:
        gc.callbacks.remove(record)


async def test_periodic_reloads_do_not_walk_the_whole_heap(
    ledger: Ledger, service: ExtenderService, collections: list[tuple[int, int]]
) -> None:
    await add_node(ledger, "n1", [16, 16])
    reloads = FULL_COLLECTION_EVERY // 2
    for i in range(reloads):
        await service.resync(f"test-{i}")
    whole_heap = [c for c in collections if c[1] == 0]  # nothing frozen: the collection walks every object
    # at most one of these reloads is the periodic full one; before, each reload walked the whole heap
    assert len(whole_heap) <= 1, f"{len(whole_heap)} of {reloads} reloads walked the whole heap: {collections}"
    assert service.sync.settler.settles >= reloads
    assert "n1" in service.view.nodes


def test_every_nth_settle_is_full_and_the_others_young() -> None:
    settler = HeapSettler(full_every=3)
    try:
        assert [settler.settle() for _ in range(7)] == ["full", "young", "young", "full", "young", "young", "full"]
    finally:
        gc.unfreeze()
    with pytest.raises(ValueError, match="full_every"):
        HeapSettler(full_every=0)


class Cycle:
    """An object in a reference cycle with itself: only the cyclic collector frees it."""

    def __init__(self) -> None:
        self.me = self


def test_cyclic_garbage_a_settle_froze_is_freed_by_the_next_full_settle(
    collections: list[tuple[int, int]],
) -> None:
    settler = HeapSettler(full_every=3)
    try:
        cycle = Cycle()
        alive = weakref.ref(cycle)
        gc.collect()  # the cycle survives into the oldest generation, as a long-lived object does
        assert settler.settle() == "full"  # frozen while still in use
        del cycle  # now garbage, but frozen
        for _ in range(2):
            assert settler.settle() == "young"
            gc.collect()  # not even a full automatic collection reaches the frozen heap
            assert alive() is not None
        young = [c for c in collections if c[1] > 0]
        assert young, "no collection ran while the heap was frozen"
        assert settler.settle() == "full"
        assert alive() is None, "the frozen cycle outlived the full settle"
    finally:
        gc.unfreeze()
