"""The event catalogue: round trips, subjects, and clear refusals of bad messages."""

from __future__ import annotations

import json
import uuid

import pytest
from hypothesis import given
from hypothesis import strategies as st

from shared.events.catalogue import (
    EVENT_KINDS,
    AllocationPart,
    EventDecodeError,
    GpuInfo,
    InventoryEvent,
    ReservedEvent,
    UsageEvent,
    decode_event,
    encode_event,
    subject_for,
)


def _reserved() -> ReservedEvent:
    return ReservedEvent(
        allocation_id=uuid.uuid4(),
        pod_uid="uid-1",
        namespace="ml",
        pod_name="bert-0",
        node="gpu-node.example.com",
        parts=[AllocationPart(container="main", container_index=0, gpu_uuid="GPU-1", gpu_index=0, memory_mib=4096)],
    )


def test_round_trip_keeps_every_field() -> None:
    event = _reserved()
    assert decode_event(encode_event(event)) == event


def test_subject_is_namespaced_by_kind_and_node_with_safe_tokens() -> None:
    event = _reserved()
    assert subject_for("gpushare", event) == "gpushare.reserved.gpu-node_example_com"
    inv = InventoryEvent(node="n1", gpus=[GpuInfo(uuid="G", index=0, memory_mib=1024, memory_total_mib=1100)])
    assert subject_for("p", inv) == "p.inventory.n1"


@pytest.mark.parametrize(
    ("payload", "message"),
    [
        (b"not json", "not JSON"),
        (b"[1, 2]", "JSON object"),
        (json.dumps({"kind": "exploded", "version": 1}).encode(), "unknown event kind"),
        (json.dumps({"kind": "bound", "version": 7}).encode(), "unsupported bound event version 7"),
        (json.dumps({"kind": "bound", "version": 1}).encode(), "invalid bound event"),
    ],
)
def test_bad_messages_are_refused_with_a_reason(payload: bytes, message: str) -> None:
    with pytest.raises(EventDecodeError, match=message):
        decode_event(payload)


def test_negative_and_overflowing_quantities_are_refused() -> None:
    raw = json.loads(encode_event(_reserved()))
    raw["parts"][0]["memory_mib"] = -1
    with pytest.raises(EventDecodeError, match="memory_mib"):
        decode_event(json.dumps(raw))
    raw["parts"][0]["memory_mib"] = 10**30
    with pytest.raises(EventDecodeError, match="memory_mib"):
        decode_event(json.dumps(raw))


def test_sidecar_parts_round_trip_and_older_payloads_still_decode() -> None:
    # as the release before sidecar shares wrote it: no `sidecar` key -> a regular app or init share
    old = {
        "kind": "reserved",
        "version": 1,
        "event_id": str(uuid.uuid4()),
        "occurred_at": "2026-11-01T00:00:00Z",
        "allocation_id": str(uuid.uuid4()),
        "pod_uid": "uid-1",
        "namespace": "ml",
        "pod_name": "bert-0",
        "node": "n1",
        "parts": [
            {"container": "setup", "container_index": 0, "gpu_uuid": "G", "gpu_index": 0, "memory_mib": 1, "init": True}
        ],
    }
    decoded = decode_event(json.dumps(old))
    assert isinstance(decoded, ReservedEvent) and decoded.parts[0].init and not decoded.parts[0].sidecar
    # shares without a sidecar serialise as before (a reader from the previous release forbids unknown keys)
    assert "sidecar" not in json.loads(encode_event(_reserved()))["parts"][0]
    side = AllocationPart(
        container="proxy", container_index=1, gpu_uuid="G", gpu_index=0, memory_mib=1, init=True, sidecar=True
    )
    event = _reserved().model_copy(update={"parts": [side]})
    assert json.loads(encode_event(event))["parts"][0]["sidecar"] is True
    assert decode_event(encode_event(event)) == event
    old["parts"][0].update(init=False, sidecar=True)
    with pytest.raises(EventDecodeError, match="init container"):
        decode_event(json.dumps(old))


def test_usage_samples_carry_sm_utilization_and_older_payloads_still_decode() -> None:
    old = {
        "kind": "usage",
        "version": 1,
        "event_id": str(uuid.uuid4()),
        "occurred_at": "2026-11-01T00:00:00Z",
        "node": "n1",
        "samples": [{"gpu_uuid": "G", "pod_uid": "u", "used_memory_mib": 5, "utilization_pct": 40.0}],
    }
    decoded = decode_event(json.dumps(old))  # as agents before the field wrote it: no SM figure (unknown)
    assert isinstance(decoded, UsageEvent) and decoded.samples[0].sm_utilization_pct is None
    # a sample without the figure serialises as before: accounting from the previous release reads it
    assert "sm_utilization_pct" not in json.loads(encode_event(decoded))["samples"][0]
    known = decoded.model_copy(update={"samples": [decoded.samples[0].model_copy(update={"sm_utilization_pct": 0.0})]})
    assert json.loads(encode_event(known))["samples"][0]["sm_utilization_pct"] == 0.0  # idle is a figure, not absent
    assert decode_event(encode_event(known)) == known
    old["samples"][0]["sm_utilization_pct"] = 101
    with pytest.raises(EventDecodeError, match="sm_utilization_pct"):
        decode_event(json.dumps(old))


@given(st.binary(max_size=300))
def test_arbitrary_bytes_never_escape_as_anything_but_decode_errors(data: bytes) -> None:
    try:
        event = decode_event(data)
    except EventDecodeError as exc:
        assert str(exc)
    else:
        assert event.kind in EVENT_KINDS
