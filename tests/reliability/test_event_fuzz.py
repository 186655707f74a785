"""Bad input on the bus: event decoding refuses anything malformed with `EventDecodeError` and a clear
message, and a real consumer parks poison messages and keeps applying the good ones."""

from __future__ import annotations

import asyncio
import json
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.events.bus import EventBus
from shared.events.catalogue import (
    EVENT_KINDS,
    MAX_EVENT_BYTES,
    BoundEvent,
    EventDecodeError,
    decode_event,
    encode_event,
)
from shared.events.consumer import DurableConsumer
from tests.reliability.profile import PROFILE

FUZZ = settings(
    max_examples=PROFILE.fuzz_examples,
    deadline=None,
    derandomize=not PROFILE.soak,
    database=None,
    suppress_health_check=[HealthCheck.too_slow],
)

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=20,
)


def _refused(payload: bytes | str) -> str:
    """Decode `payload`, which must be refused; returns the message (which must be short and say why)."""
    with pytest.raises(EventDecodeError) as info:
        decode_event(payload)
    message = str(info.value)
    assert message and len(message) < 2000, f"unclear or unbounded error message: {message[:200]!r}"
    return message


def _valid_bound() -> dict:
    return json.loads(encode_event(BoundEvent(allocation_id=uuid.uuid4(), pod_uid="u", node="n")))


@FUZZ
@given(st.binary(max_size=512))
def test_random_bytes_are_refused_cleanly(data: bytes) -> None:
    try:
        decode_event(data)
    except EventDecodeError as exc:
        assert str(exc)
    # any other exception type fails the test; a random byte string that decodes is astronomically unlikely


@FUZZ
@given(json_values)
def test_random_json_values_are_refused_cleanly(value: object) -> None:
    assert _refused(json.dumps(value).encode())


@FUZZ
@given(kind=st.sampled_from(EVENT_KINDS), body=st.dictionaries(st.text(max_size=12), json_values, max_size=6))
def test_known_kinds_with_garbage_fields_are_refused(kind: str, body: dict) -> None:
    body = {**body, "kind": kind, "version": 1}
    message = _refused(json.dumps(body).encode())
    assert f"invalid {kind} event" in message


@FUZZ
@given(kind=st.text(max_size=30).filter(lambda k: k not in EVENT_KINDS))
def test_unknown_kinds_are_named(kind: str) -> None:
    message = _refused(json.dumps({"kind": kind, "version": 1}).encode())
    assert "unknown event kind" in message


@FUZZ
@given(version=json_values.filter(lambda v: v != 1))
def test_unknown_versions_are_refused_before_validation(version: object) -> None:
    body = {**_valid_bound(), "version": version}
    message = _refused(json.dumps(body).encode())
    assert "version" in message


@FUZZ
@given(field=st.sampled_from(["allocation_id", "pod_uid", "node", "occurred_at", "event_id"]), value=json_values)
def test_wrong_types_in_a_valid_event_are_refused_or_coerced_safely(field: str, value: object) -> None:
    body = {**_valid_bound(), field: value}
    try:
        event = decode_event(json.dumps(body).encode())
    except EventDecodeError as exc:
        assert field in str(exc) or "invalid bound event" in str(exc)
    else:  # pydantic may accept a value of the right shape: it must then round-trip
        assert decode_event(encode_event(event)) == event


@pytest.mark.parametrize(
    "payload",
    [
        b"",
        b"\xff\xfe\x00",
        b"{" * 100_000,
        b"[" * 100_000 + b"]" * 100_000,
        ("{" + '"a":{' * 50_000 + "}" * 50_001).encode(),
        b"x" * (MAX_EVENT_BYTES + 1),
        json.dumps({**_valid_bound(), "version": True}).encode(),
        json.dumps({"kind": "bound", "version": 1.0000001}).encode(),
        json.dumps({"kind": "bound", "version": 2**70}).encode(),
        json.dumps({"kind": None, "version": 1}).encode(),
        json.dumps({"kind": ["bound"], "version": 1}).encode(),
        b'{"kind": "bound", "version": 1, "kind": "nope"}',
        b"NaN",
        b'"\\ud800"',
    ],
    ids=[
        "empty",
        "not-utf8",
        "open-braces-100k",
        "nested-arrays-100k",
        "nested-objects-50k",
        "over-size-limit",
        "version-true",
        "version-float",
        "version-huge",
        "kind-null",
        "kind-list",
        "duplicate-kind",
        "nan",
        "lone-surrogate",
    ],
)
def test_boundary_messages_are_refused(payload: bytes) -> None:
    assert _refused(payload)


@pytest.mark.parametrize(
    ("mutate", "field"),
    [
        (lambda b: b.update(pod_uid=""), "pod_uid"),
        (lambda b: b.update(node="n" * 254), "node"),
        (lambda b: b.update(allocation_id="not-a-uuid"), "allocation_id"),
        (lambda b: b.update(extra_field=1), "extra_field"),
        (lambda b: b.pop("pod_uid"), "pod_uid"),
    ],
)
def test_boundary_fields_are_named_in_the_error(mutate, field: str) -> None:  # type: ignore[no-untyped-def]
    body = _valid_bound()
    mutate(body)
    assert field in _refused(json.dumps(body).encode())


def test_reserved_event_quantities_are_bounded() -> None:
    part = {"container": "c", "container_index": 0, "gpu_uuid": "G", "gpu_index": 0}
    base = {
        "kind": "reserved",
        "version": 1,
        "allocation_id": str(uuid.uuid4()),
        "pod_uid": "u",
        "namespace": "ns",
        "pod_name": "p",
        "node": "n",
    }
    for memory in (-1, 2**31, 2**63, 10**100, 1.5, [], None):
        message = _refused(json.dumps({**base, "parts": [{**part, "memory_mib": memory}]}).encode())
        assert "memory_mib" in message, message
    assert "parts" in _refused(json.dumps({**base, "parts": []}).encode())
    assert "parts" in _refused(json.dumps({**base, "parts": [{**part, "memory_mib": 1}] * 1025}).encode())


async def test_consumer_parks_poison_messages_and_keeps_going(bus: EventBus) -> None:
    """Interleave good events with undecodable, unknown-kind, unknown-version and handler-rejected ones."""
    good = [BoundEvent(allocation_id=uuid.uuid4(), pod_uid=f"pod-{i}", node="n1") for i in range(20)]
    poison = [
        b"not json at all",
        json.dumps({"kind": "exploded", "version": 1}).encode(),
        json.dumps({**_valid_bound(), "version": 99}).encode(),
        b"[" * 500 + b"x",  # nested but not deep enough to hit the RecursionError bug (see above)
        json.dumps({"kind": "bound", "version": 1, "pod_uid": ""}).encode(),
    ]
    applied: list[str] = []
    for i, event in enumerate(good):
        await bus.publish(event)
        if i % 4 == 0 and poison:
            await bus.publish_raw(bus.names.subject("bound", "n1"), poison.pop(0), f"poison-{i}")
    assert not poison

    async def handler(event) -> None:  # type: ignore[no-untyped-def]
        applied.append(event.pod_uid)

    consumer = DurableConsumer(bus, "reliability-poison", handler, max_deliver=2, backoff_s=0.05)
    stop = asyncio.Event()
    task = asyncio.create_task(consumer.run(stop))
    try:
        async with asyncio.timeout(30):
            while len(applied) < len(good) or consumer.parked < 5:  # noqa: ASYNC110 - polling two counters
                await asyncio.sleep(0.05)
    except TimeoutError:
        pytest.fail(f"consumer stalled: applied {len(applied)}/{len(good)}, parked {consumer.parked}/5")
    finally:
        stop.set()
        await asyncio.wait_for(task, 10)
    assert applied == [e.pod_uid for e in good], "good events must all be applied, in order, once"
    assert consumer.parked == 5
    info = await bus.js.stream_info(bus.names.parked_stream)
    assert info.state.messages == 5
    parked = await bus.js.get_msg(bus.names.parked_stream, seq=1)
    assert parked.headers and "undecodable" in parked.headers.get("Gpushare-Parked-Reason", "")
