"""Ledger snapshots: exact round trip, rebuild from the newest snapshot plus the tail, trimming the ledger stream
only behind what a snapshot covers and every durable consumer read, and a clear stop when events are gone."""

from __future__ import annotations

import asyncio
import re
import uuid
import zlib
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from nats.js.api import AckPolicy, ConsumerConfig
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import EmbeddedNats
from services.cli import main as gpushare
from services.ledger_tool import GAP_EXIT, UNAVAILABLE_EXIT
from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import AllocationPart, BoundEvent, GpuInfo, InventoryEvent, ReservedEvent
from shared.ledger import replay, snapshots
from shared.ledger.replay import differences, load_state
from shared.ledger.reservations import ReservationRequest
from shared.ledger.snapshot import Snapshot, SnapshotError, decode_snapshot, encode_snapshot
from shared.ledger.snapshots import SnapshotStore, StreamGap, replay_tail, take_snapshot
from shared.ledger.state import LedgerState

from .test_replay import _busy_ledger


def _cli_args(action: str, database_url: str, nats_url: str, bus: EventBus, *extra: str) -> list[str]:
    names = bus.names
    urls = ["--database-url", database_url, "--nats-url", nats_url]
    return ["ledger", action, *urls, "--stream-name", names.stream, "--subject-prefix", names.prefix, *extra]


async def _live(engine: AsyncEngine) -> LedgerState:
    async with engine.connect() as conn:
        return await load_state(conn)


def test_a_snapshot_round_trips_exactly_including_what_canonical_leaves_out() -> None:
    state = LedgerState()
    state.apply(InventoryEvent(node="n", gpus=[GpuInfo(uuid="G0", index=0, memory_mib=16384, memory_total_mib=16384)]))
    a, b = uuid.uuid4(), uuid.uuid4()
    part = AllocationPart(container="c", container_index=0, gpu_uuid="G0", gpu_index=0, memory_mib=4096, compute=10)
    state.apply(
        ReservedEvent(
            allocation_id=a,
            pod_uid="pa",
            namespace="ns",
            pod_name="p",
            node="n",
            parts=[part],
            pod_created_at=datetime(2026, 1, 2, 3, 4, 5, 678901, tzinfo=UTC),
        )
    )
    state.apply(BoundEvent(allocation_id=a, pod_uid="pa", node="n"))
    state.apply(BoundEvent(allocation_id=b, pod_uid="pb", node="n"))  # before its reservation: waits in `early`
    state.apply(BoundEvent(allocation_id=a, pod_uid="pa", node="n", event_id=next(iter(state.seen))))  # a copy
    snapshot = Snapshot(state, "GPUSHARE", 42, datetime.now(UTC))
    back = decode_snapshot(encode_snapshot(snapshot))
    assert (back.stream, back.sequence, back.taken_at) == ("GPUSHARE", 42, snapshot.taken_at)
    assert differences(state, back.state) == [] and back.state.canonical() == state.canonical()
    assert back.state.early == state.early and list(back.state.early) == [b]
    assert back.state.live_by_pod == state.live_by_pod == {"pa": a}
    assert back.state.seen == state.seen and len(back.state.seen) == 4
    assert (back.state.applied, back.state.duplicates) == (state.applied, state.duplicates)
    assert state.duplicates == 1
    # the waiting transition still applies when its reservation arrives after the snapshot
    reserved_b = ReservedEvent(allocation_id=b, pod_uid="pb", namespace="ns", pod_name="q", node="n", parts=[part])
    state.apply(reserved_b)
    back.state.apply(reserved_b)
    assert differences(state, back.state) == [] and back.state.allocations[b].state.value == "bound"


def test_bytes_that_are_not_a_snapshot_are_refused_with_the_reason() -> None:
    with pytest.raises(SnapshotError, match="not a ledger snapshot"):
        decode_snapshot(b"garbage")
    with pytest.raises(SnapshotError, match="unsupported ledger snapshot format 99"):
        decode_snapshot(zlib.compress(b'{"format": 99}'))
    with pytest.raises(SnapshotError, match="damaged"):
        decode_snapshot(zlib.compress(b'{"format": 1, "nodes": {}}'))


async def test_rebuild_starts_from_the_newest_snapshot_after_the_stream_was_trimmed(
    engine: AsyncEngine, bus: EventBus, database_url: str, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _busy_ledger(engine, bus, seed=5)
    before = (await bus.js.stream_info(bus.names.stream)).state.messages
    first = await take_snapshot(bus)
    assert first.written and first.trimmed == before, "no durable consumer: everything covered is trimmed"
    assert (await bus.js.stream_info(bus.names.stream)).state.messages == 0
    # more changes after the snapshot, then rebuild from snapshot + tail
    await _busy_ledger(engine, bus, seed=6)
    live = await _live(engine)
    newest = await SnapshotStore(bus).newest()
    assert newest is not None and newest.sequence == first.sequence
    replayed, stats = await replay_tail(bus, newest)
    assert 0 < stats.events < before * 2
    assert differences(live, replayed) == []
    code = await asyncio.to_thread(gpushare, _cli_args("rebuild", database_url, nats_url, bus))
    err = capsys.readouterr().err
    assert code == 0, err
    assert f"match snapshot ledger-{first.sequence:020d}" in err
    # replaying from the first event is impossible now, and says so instead of producing a wrong ledger
    code = await asyncio.to_thread(gpushare, _cli_args("rebuild", database_url, nats_url, bus, "--from-start"))
    assert code == GAP_EXIT
    assert "events 1.." in capsys.readouterr().err
    # a second snapshot keeps the chain; the first one is kept too (keep=3)
    second = await take_snapshot(bus)
    assert second.sequence > first.sequence and await SnapshotStore(bus).names() == [first.name, second.name]
    assert differences(live, (await SnapshotStore(bus).newest()).state) == []  # type: ignore[union-attr]
    assert not (await take_snapshot(bus)).written, "nothing new: nothing written"


async def test_a_durable_consumer_behind_holds_the_trim_back(engine: AsyncEngine, bus: EventBus) -> None:
    await _busy_ledger(engine, bus, seed=8)
    sub = await bus.js.pull_subscribe(
        f"{bus.names.prefix}.>",
        durable="slow-reader",
        stream=bus.names.stream,
        config=ConsumerConfig(ack_policy=AckPolicy.EXPLICIT),
    )
    msgs = await sub.fetch(10, timeout=5)
    for msg in msgs:
        await msg.ack()
    await asyncio.sleep(0)  # acks are fire-and-forget: make sure the server has them before asking
    await bus.nc.flush()
    total = (await bus.js.stream_info(bus.names.stream)).state.messages
    result = await take_snapshot(bus)
    assert result.written and result.trimmed == 10, "only what the slow reader acknowledged"
    info = (await bus.js.stream_info(bus.names.stream)).state
    assert (info.first_seq, info.messages) == (11, total - 10)
    await sub.unsubscribe()


async def test_an_unreadable_newest_snapshot_falls_back_to_the_one_before(engine: AsyncEngine, bus: EventBus) -> None:
    await _busy_ledger(engine, bus, seed=9)
    good = await take_snapshot(bus, trim=False)
    store = SnapshotStore(bus)
    object_store = await bus.js.object_store(bus.names.snapshot_bucket)
    await object_store.put(f"ledger-{good.sequence + 1:020d}", b"torn write")
    newest = await store.newest()
    assert newest is not None and newest.sequence == good.sequence
    assert differences(await _live(engine), (await replay_tail(bus, newest))[0]) == []


async def test_a_gap_stops_the_snapshot_and_a_base_from_the_database_restarts_the_chain(
    engine: AsyncEngine, bus: EventBus, database_url: str, nats_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    await _busy_ledger(engine, bus, seed=10)
    last = (await bus.js.stream_info(bus.names.stream)).state.last_seq
    await bus.js.purge_stream(bus.names.stream, seq=last - 5)  # an age limit took events no snapshot covered
    with pytest.raises(StreamGap, match="there is no snapshot"):
        await take_snapshot(bus)
    code = await asyncio.to_thread(gpushare, _cli_args("snapshot", database_url, nats_url, bus))
    assert code == GAP_EXIT and "--from-database" in capsys.readouterr().err
    code = await asyncio.to_thread(gpushare, _cli_args("snapshot", database_url, nats_url, bus, "--from-database"))
    assert code == 0, capsys.readouterr().err
    await _busy_ledger(engine, bus, seed=12)
    code = await asyncio.to_thread(gpushare, _cli_args("rebuild", database_url, nats_url, bus))
    assert code == 0, capsys.readouterr().err


async def test_rebuild_waits_out_a_nats_server_that_does_not_answer(
    engine: AsyncEngine, bus_names: BusNames, database_url: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """`gpushare ledger rebuild` run while NATS does not answer (here: its server frozen; in CI, the snapshot
    store's stream electing a leader after a server was killed) tries again until `--wait` ends, and then says so
    in one line with exit 4. Before, the first timeout ended it with a traceback."""
    server = EmbeddedNats(tmp_path / "nats")
    await asyncio.to_thread(server.start)
    try:
        bus = await EventBus.connect(server.url, bus_names, name="gpushare-test")
        try:
            await _busy_ledger(engine, bus, seed=7)
            assert (await take_snapshot(bus, trim=False)).written
        finally:
            await bus.close()
        args = _cli_args("rebuild", database_url, server.url, bus)
        server.pause()
        rebuilding = asyncio.create_task(asyncio.to_thread(gpushare, [*args, "--wait", "60"]))
        await asyncio.sleep(3)  # the command meets the frozen server first
        assert not rebuilding.done()
        server.resume()
        code = await asyncio.wait_for(rebuilding, 90)
        err = capsys.readouterr().err
        assert code == 0 and "ledger verified" in err, err
        server.pause()
        code = await asyncio.to_thread(gpushare, [*args, "--wait", "2"])
        err = capsys.readouterr().err
        assert code == UNAVAILABLE_EXIT, err
        assert "cannot rebuild: connecting to NATS: no answer for 2s" in err and "Traceback" not in err, err
    finally:
        server.resume()
        await asyncio.to_thread(server.stop)


async def test_a_snapshot_from_the_database_is_one_moment_of_the_ledger(
    engine: AsyncEngine, bus: EventBus, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`snapshot --from-database` reads the tables one after another. Under READ COMMITTED each read saw the commits
    made before it, so a reservation that committed between the GPUs' read and the allocations' read was in the
    snapshot without its GPU's charge: a ledger rebuilt from it held a share its GPU did not count (and the tail's
    copy of the reservation, found recorded, charged nothing either). The tables are now read in one REPEATABLE
    READ transaction: the snapshot is the ledger before that commit, or after it, never a mixture."""
    ledger = await _busy_ledger(engine, bus, seed=21)
    request = ReservationRequest(
        pod_uid=str(uuid.uuid4()),
        namespace="team-b",
        pod_name="between",
        node="node-0",
        owner_kind="Deployment",
        owner_name="bert",
        parts=(AllocationPart(container="main", container_index=0, gpu_uuid="GPU-0-0", gpu_index=0, memory_mib=1024),),
    )
    taken: list[LedgerState] = []
    real_load_state = replay.load_state

    class CommitBeforeAllocations:
        """The snapshot's connection: the reservation commits elsewhere right before the allocations are read."""

        def __init__(self, conn: Any) -> None:
            self.conn, self.fired = conn, False

        async def execute(self, statement: Any, *args: Any, **kwargs: Any) -> Any:
            if not self.fired and re.search(r"\bFROM allocations\b", str(statement)):
                self.fired = True
                await ledger.reserve(request)
            return await self.conn.execute(statement, *args, **kwargs)

    async def racing_load_state(conn: Any) -> LedgerState:
        racing = CommitBeforeAllocations(conn)
        taken.append(await real_load_state(racing))  # type: ignore[arg-type]
        assert racing.fired
        return taken[-1]

    before = await _live(engine)
    monkeypatch.setattr(replay, "load_state", racing_load_state)
    monkeypatch.setattr(snapshots, "load_state", racing_load_state, raising=False)  # where it was called before
    await snapshots.snapshot_from_database(bus, engine)
    after = await _live(engine)
    assert differences(before, after), "the reservation committed meanwhile"
    (snapshot,) = taken
    assert not differences(before, snapshot) or not differences(after, snapshot), differences(before, snapshot)
