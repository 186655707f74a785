"""Ledger snapshots in a JetStream object store, replay from the newest one, and trimming the ledger stream.

`take_snapshot` folds the newest stored snapshot and the ledger stream's events after it into a new snapshot
and stores it in the object store `<stream>_SNAPSHOTS` (beside the streams, so a lost database does not lose
it; it has the streams' replicas). Then it trims the ledger stream: events that the new snapshot covers and
that every durable consumer has acknowledged are purged. So the ledger stream keeps exactly what a rebuild
needs (the events after the newest snapshot) plus what a lagging consumer still has to read, and `gpushare
ledger rebuild` replays only that tail.

A snapshot taken by replay reproduces the live ledger only if the chain of events behind it is unbroken: a
replay that finds the stream starting after the snapshot's sequence + 1 (an age limit on the ledger stream
removed events no snapshot covered) stops with `StreamGap` instead of producing a wrong ledger. The way out is
`gpushare ledger snapshot --from-database`, which takes the live tables as the new base.
"""

from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass
from datetime import UTC, datetime

from nats.js.api import ObjectStoreConfig, StorageType
from nats.js.errors import BucketNotFoundError, NotFoundError
from nats.js.object_store import ObjectStore
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.ledger.replay import Progress, ReplayStats, read_events, read_live_state
from shared.ledger.snapshot import Snapshot, SnapshotError, decode_snapshot, encode_snapshot, snapshot_name
from shared.ledger.state import LedgerState

log = logging.getLogger(__name__)

DEFAULT_KEEP = 3
DEFAULT_DEDUPE_HORIZON_S = 7 * 86_400.0


class StreamGap(Exception):
    """The ledger stream no longer holds events that no snapshot covers: a replay would be wrong."""


class SnapshotStore:
    """The object store that keeps ledger snapshots, one object per snapshot."""

    def __init__(self, bus: EventBus) -> None:
        self.bus = bus
        self.bucket = bus.names.snapshot_bucket
        self._store: ObjectStore | None = None

    async def _open(self, *, create: bool) -> ObjectStore | None:
        if self._store is None:
            try:
                self._store = await self.bus.js.object_store(self.bucket)
                await self.bus.ensure_replicas(f"OBJ_{self.bucket}")  # made before the cluster had more servers
            except BucketNotFoundError:
                if not create:
                    return None
                config = ObjectStoreConfig(
                    description="gpushare ledger snapshots", storage=StorageType.FILE, replicas=self.bus.replicas
                )
                self._store = await self.bus.js.create_object_store(self.bucket, config=config)
        return self._store

    async def names(self) -> list[str]:
        """The stored snapshots' names, oldest first."""
        store = await self._open(create=False)
        if store is None:
            return []
        try:
            infos = await store.list(ignore_deletes=True)
        except NotFoundError:
            return []
        return sorted(i.name for i in infos if i.name.startswith("ledger-") and not i.deleted)

    async def newest(self) -> Snapshot | None:
        """The newest readable snapshot (a damaged one is logged and the one before it tried), or None."""
        store = await self._open(create=False)
        for name in reversed(await self.names()):
            assert store is not None
            try:
                data = (await store.get(name)).data or b""
                snapshot = await asyncio.to_thread(decode_snapshot, data)  # seconds for a large ledger
            except (SnapshotError, NotFoundError) as exc:
                log.error("ledger snapshot %s is unreadable (%s); trying an older one", name, exc)
                continue
            if snapshot.stream != self.bus.names.stream:
                log.warning("ledger snapshot %s is of stream %s, not %s", name, snapshot.stream, self.bus.names.stream)
            return snapshot
        return None

    async def put(self, snapshot: Snapshot) -> int:
        """Store a snapshot; returns its size in bytes."""
        store = await self._open(create=True)
        assert store is not None
        data = await asyncio.to_thread(encode_snapshot, snapshot)  # off the event loop: the service keeps serving
        await store.put(snapshot.name, data)
        return len(data)

    async def prune(self, keep: int) -> list[str]:
        """Delete all but the `keep` newest snapshots; returns the deleted names."""
        names = await self.names()
        doomed = names[: max(0, len(names) - keep)]
        store = await self._open(create=False)
        for name in doomed:
            assert store is not None
            await store.delete(name)
        return doomed


async def replay_tail(
    bus: EventBus, base: Snapshot | None, *, progress: Progress | None = None
) -> tuple[LedgerState, ReplayStats]:
    """`base`'s state (or an empty ledger) with every ledger stream event after its sequence folded in.

    Raises `StreamGap` when the stream no longer starts right after what `base` covers.
    """
    state, after = (base.state, base.sequence) if base is not None else (LedgerState(), 0)
    info = (await bus.js.stream_info(bus.names.stream)).state
    if info.messages > 0 and info.first_seq > after + 1:
        covered = f"the newest snapshot covers up to {after}" if base is not None else "there is no snapshot"
        raise StreamGap(
            f"the ledger stream {bus.names.stream} starts at sequence {info.first_seq} and {covered}: events "
            f"{after + 1}..{info.first_seq - 1} are gone, so a replay cannot reproduce the ledger. Take a new "
            "base from the live tables with `gpushare ledger snapshot --from-database`"
        )
    stats = ReplayStats(last_sequence=after)
    async for event in read_events(bus, after=after, stats=stats, progress=progress):
        state.apply(event)
    return state, stats


@dataclass
class SnapshotResult:
    """What one `take_snapshot` did."""

    sequence: int
    events: int
    bytes: int
    allocations: int
    written: bool
    trimmed: int = 0
    deleted: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        """The snapshot's object name."""
        return snapshot_name(self.sequence)


async def take_snapshot(
    bus: EventBus,
    *,
    keep: int = DEFAULT_KEEP,
    dedupe_horizon_s: float = DEFAULT_DEDUPE_HORIZON_S,
    trim: bool = True,
    progress: Progress | None = None,
    now: datetime | None = None,
) -> SnapshotResult:
    """Fold the newest snapshot and the events after it into a new snapshot, store it, keep the `keep`
    newest, and (with `trim`) purge the ledger stream up to what it covers and every durable consumer read.

    Nothing is written when no event arrived since the newest snapshot.
    """
    store = SnapshotStore(bus)
    base = await store.newest()
    state, stats = await replay_tail(bus, base, progress=progress)
    if stats.last_sequence <= (base.sequence if base is not None else 0):  # nothing new (or nothing at all)
        result = SnapshotResult(stats.last_sequence, 0, 0, len(state.allocations), written=False)
    else:
        state.forget_seen(dedupe_horizon_s)
        snapshot = Snapshot(state, bus.names.stream, stats.last_sequence, now or datetime.now(UTC))
        size = await store.put(snapshot)
        result = SnapshotResult(snapshot.sequence, stats.events, size, len(state.allocations), written=True)
        result.deleted = tuple(await store.prune(keep))
        log.info(
            "ledger snapshot %s: %d events folded, %d allocations, %d bytes",
            snapshot.name,
            stats.events,
            len(state.allocations),
            size,
            extra={"sequence": snapshot.sequence, "bytes": size},
        )
    if trim and result.sequence > 0:
        result.trimmed = await trim_ledger_stream(bus, result.sequence)
    return result


async def snapshot_from_database(
    bus: EventBus, engine: AsyncEngine, *, keep: int = DEFAULT_KEEP, now: datetime | None = None
) -> SnapshotResult:
    """Take the live ledger tables as a new base snapshot (after a `StreamGap`, or to start a chain).

    The stream's last sequence is read before the tables, so every event after it is either already in the
    tables (and applies again harmlessly: transitions only move forward, exchanges carry versions, inventory,
    health and quota set values that later events in the tail set again) or new.
    """
    info = (await bus.js.stream_info(bus.names.stream)).state
    state = await read_live_state(engine)
    snapshot = Snapshot(state, bus.names.stream, int(info.last_seq), now or datetime.now(UTC))
    store = SnapshotStore(bus)
    size = await store.put(snapshot)
    deleted = tuple(await store.prune(keep))
    log.warning("ledger snapshot %s taken from the live tables", snapshot.name, extra={"sequence": snapshot.sequence})
    return SnapshotResult(snapshot.sequence, 0, size, len(state.allocations), written=True, deleted=deleted)


async def trim_ledger_stream(bus: EventBus, covered: int) -> int:
    """Purge ledger stream events up to `covered` that every durable consumer has acknowledged; returns how
    many went. A durable consumer that is behind holds the trim back (and is named in the log)."""
    stream = bus.names.stream
    info = (await bus.js.stream_info(stream)).state
    upto = min(covered, int(info.last_seq))
    for consumer in await bus.js.consumers_info(stream):
        if not consumer.config.durable_name:
            continue  # ephemeral (replays, node agents following their node): they start where they like
        if not consumer.num_pending and not consumer.num_ack_pending:
            continue  # read everything it wants
        floor = consumer.ack_floor.stream_seq if consumer.ack_floor is not None else 0
        if floor < upto:
            log.info(
                "durable consumer %s has acknowledged only up to %d: the ledger stream is trimmed no further",
                consumer.name,
                floor,
                extra={"consumer": consumer.name, "stream_seq": floor},
            )
            upto = floor
    if upto < info.first_seq or info.messages == 0:
        return 0
    await bus.js.purge_stream(stream, seq=upto + 1)  # removes every message below upto + 1
    after = (await bus.js.stream_info(stream)).state
    removed = max(0, int(info.messages) - int(after.messages))
    log.info("trimmed the ledger stream: %d events up to sequence %d", removed, upto, extra={"stream_seq": upto})
    return removed
