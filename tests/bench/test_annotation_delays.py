"""Benchmark 11's arithmetic: when a pod first showed an exchange's record version, and the delays from events."""

from __future__ import annotations

import json
from datetime import UTC, datetime

from bench.annotations import PodLog, delays, last_exchanges
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_IDX


def pod(name: str, alloc: str, version: int, idx: str, assigned: bool = False) -> dict:
    notes = {ALLOCATION: json.dumps({"id": alloc, "node": "n", "parts": [], "version": version}), GPU_MEM_IDX: idx}
    if assigned:
        notes[GPU_MEM_ASSIGNED] = "true"
    return {"metadata": {"name": name, "annotations": notes}}


def at(seconds: float) -> str:
    return datetime.fromtimestamp(seconds, UTC).isoformat()


def test_an_exchange_is_timed_to_the_first_record_of_its_version_or_later() -> None:
    log = PodLog()
    log.saw(pod("a", "A", 1, "0"), 100.0)
    log.saw(pod("a", "A", 3, "1"), 107.5)  # version 2 was never seen alone: 3 covers it
    log.saw(pod("a", "A", 3, "1", assigned=True), 108.0)
    log.saw(pod("b", "B", 1, "1"), 100.0)  # B's exchange never reached its pod
    events = [
        {"kind": "exchanged", "occurred_at": at(105.0), "versions": {"A": 2, "B": 2}},
        {"kind": "assigned", "occurred_at": at(106.0), "allocation_id": "A"},
    ]
    exchange, assign, missing = delays(events, log)
    assert exchange == [2.5] and missing == 1 and assign == [2.0]
    assert log.idx == {"a": "1", "b": "1"} and log.allocation_of == {"a": "A", "b": "B"}
    assert last_exchanges(events) == {"A": 105.0, "B": 105.0}
