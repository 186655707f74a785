"""Usage and refusals live on their own age-limited stream; the ledger stream keeps the kinds a rebuild needs.
Against a real NATS server, including the in-place migration of a stream created by an earlier release."""

from __future__ import annotations

import typing
import uuid
from collections.abc import AsyncIterator

import nats
import pytest
from nats.js.api import RetentionPolicy, StorageType, StreamConfig

from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import (
    EVENT_KINDS,
    GpuInfo,
    HealthEvent,
    InventoryEvent,
    QuotaEvent,
    RefusedEvent,
    UsageEvent,
    UsageSample,
    kind_of,
)
from shared.events.streams import LEDGER_KINDS, SAMPLE_KINDS, StreamLimits
from shared.ledger.ledger import LedgerEvent
from shared.ledger.replay import read_events, replay_state
from shared.settings import Settings
from tests.waiting import eventually


def _usage(node: str = "n") -> UsageEvent:
    return UsageEvent(node=node, samples=[UsageSample(gpu_uuid="G0", pod_uid="p", used_memory_mib=512)])


def test_every_kind_has_exactly_one_stream_and_the_ledger_stream_has_every_ledger_kind() -> None:
    assert set(LEDGER_KINDS) | SAMPLE_KINDS == set(EVENT_KINDS)
    assert not set(LEDGER_KINDS) & SAMPLE_KINDS
    ledger_kinds = {kind_of(t) for t in typing.get_args(LedgerEvent)}
    assert ledger_kinds == set(LEDGER_KINDS), "every kind the ledger applies must be replayable from its stream"
    assert "health" in LEDGER_KINDS and {"usage", "refused", "unallocated"} == SAMPLE_KINDS


def test_limits_come_from_settings_written_as_people_write_them() -> None:
    settings = Settings(samples_max_age="12h", samples_max_bytes="2GiB", ledger_max_age="30d", ledger_max_bytes=0)
    assert StreamLimits.from_settings(settings) == StreamLimits(12 * 3600, 2 * 2**30, 30 * 86400, 0)
    assert Settings().samples_max_age == 86400
    with pytest.raises(ValueError, match="not a duration"):
        Settings(samples_max_age="a day")
    with pytest.raises(ValueError, match="not a size"):
        Settings(samples_max_bytes="lots")
    with pytest.raises(ValueError, match="at least one second"):
        StreamLimits(samples_max_age_s=0.5)


@pytest.fixture
async def names() -> BusNames:
    tag = uuid.uuid4().hex[:10]
    return BusNames(stream=f"GPUSHARE_M{tag}", prefix=f"gsm{tag}")


@pytest.fixture
async def old_stream(nats_url: str, names: BusNames) -> AsyncIterator[nats.NATS]:
    """The stream as the previous release created it: every subject under the prefix, usage included."""
    nc = await nats.connect(nats_url)
    js = nc.jetstream()
    await js.add_stream(
        StreamConfig(
            name=names.stream,
            subjects=[f"{names.prefix}.>"],
            retention=RetentionPolicy.LIMITS,
            storage=StorageType.FILE,
            duplicate_window=120,
        )
    )
    yield nc
    bus = EventBus(nc, names)
    await bus.delete_streams()
    await nc.close()


async def test_an_old_stream_is_migrated_in_place_and_usage_moves_to_the_samples_stream(
    old_stream: nats.NATS, nats_url: str, names: BusNames
) -> None:
    old = EventBus(old_stream, names)
    inventory = InventoryEvent(node="n", gpus=[GpuInfo(uuid="G0", index=0, memory_mib=1024, memory_total_mib=1024)])
    await old.publish(inventory)
    await old.publish(_usage())  # stored by the old release in the one stream

    bus = await EventBus.connect(nats_url, names, limits=StreamLimits(samples_max_age_s=3600))
    try:
        ledger_info = await bus.js.stream_info(names.stream)
        samples_info = await bus.js.stream_info(names.samples_stream)
        assert sorted(ledger_info.config.subjects) == names.stream_subjects(samples=False)
        assert f"{names.prefix}.usage.>" not in ledger_info.config.subjects
        assert sorted(samples_info.config.subjects) == [
            f"{names.prefix}.{kind}.>" for kind in ("refused", "unallocated", "usage")
        ]
        assert samples_info.config.max_age == 3600
        assert ledger_info.state.messages == 2, "what the old stream held stays (replay skips the usage)"

        await bus.publish(_usage())
        await bus.publish(RefusedEvent(pod_uid="u", namespace="ns", pod_name="p", summary="no GPU fits"))
        await bus.publish(HealthEvent(node="n", gpu_uuid="G0", healthy=False, reason="XID 79"))
        await bus.publish(QuotaEvent(namespace="ns", memory_mib=4096))
        assert (await bus.js.stream_info(names.samples_stream)).state.messages == 2
        assert (await bus.js.stream_info(names.stream)).state.messages == 4
        samples = [e.kind async for e in read_events(bus, stream=names.samples_stream)]
        assert samples == ["usage", "refused"]
        state, stats = await replay_state(bus)
        assert stats.events == 4
        assert state.gpus["G0"].healthy is False and state.quotas == {"ns": (4096, None)}

        # a second start changes nothing; a process without settings of its own leaves the limits alone
        again = await EventBus.connect(nats_url, names)
        assert (await again.js.stream_info(names.samples_stream)).config.max_age == 3600
        await again.close()
    finally:
        await bus.close()


async def test_the_samples_stream_forgets_old_samples_and_the_ledger_stream_keeps_everything(
    nats_url: str, names: BusNames
) -> None:
    bus = await EventBus.connect(nats_url, names, limits=StreamLimits(samples_max_age_s=1))
    try:
        assert (await bus.js.stream_info(names.samples_stream)).config.duplicate_window == 1, "window <= max age"
        for _ in range(5):
            await bus.publish(_usage())
        await bus.publish(QuotaEvent(namespace="ns", memory_mib=1))

        async def samples_left() -> bool:
            return (await bus.js.stream_info(names.samples_stream)).state.messages == 0

        await eventually(samples_left, what="the samples to age out", within=15)
        assert (await bus.js.stream_info(names.stream)).state.messages == 1

        # limits given again are applied to the existing streams
        await bus.ensure_streams(StreamLimits(samples_max_age_s=7200, ledger_max_bytes=10**9))
        assert (await bus.js.stream_info(names.samples_stream)).config.max_age == 7200
        assert (await bus.js.stream_info(names.stream)).config.max_bytes == 10**9
    finally:
        await bus.delete_streams()
        await bus.close()
