"""Accounting's housekeeping: the periodic ledger snapshot (which trims the ledger stream) and pruning the tables
that grow with time.

* `usage_samples`: samples younger than `usage_full_resolution` stay as sampled; older ones are thinned to the
  first sample time of each node in each `usage_downsample_interval` (every sample of that moment is kept, so
  per-pod sums stay whole; means and percentiles over a window are estimated from the kept moments, peaks
  between them are lost); samples older than `usage_retention` are deleted.
* `applied_events`: claims older than `dedupe_horizon` are deleted (every projection's effect is idempotent by
  itself, so a copy arriving later changes nothing either; see `projections`).
* `acc_pending`: refusals older than `usage_retention` are deleted (pods refused and never placed).
* `outbox`: rows leave when the relay published them; the pass reports what is left (a stuck relay shows up).

Several accounting replicas may run this at once: every step is idempotent, and snapshots of the same sequence
are the same object.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta

from sqlalchemy import Delete, Table, delete, extract, func, select, tuple_
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.events.bus import EventBus
from shared.ledger.models import applied_events, outbox
from shared.ledger.snapshots import SnapshotResult, StreamGap, take_snapshot
from shared.settings import Settings

from .tables import pending, usage_samples

log = logging.getLogger(__name__)

DELETE_BATCH = 20_000  # rows per DELETE statement: short transactions, no long locks
THIN_WINDOW = timedelta(hours=6)  # samples thinned per statement
PASS_PERIOD_S = 600.0  # how often tables are pruned (snapshots follow their own interval)


@dataclass(frozen=True)
class Retention:
    """How long accounting keeps what (seconds; `downsample_s` 0 keeps old samples unthinned)."""

    full_resolution_s: float = 86_400.0
    downsample_s: float = 300.0
    usage_s: float = 30 * 86_400.0
    dedupe_horizon_s: float = 7 * 86_400.0

    @classmethod
    def from_settings(cls, settings: Settings) -> Retention:
        """The retention a process was configured with (`GPUSHARE_USAGE_RETENTION`, ...)."""
        return cls(
            full_resolution_s=settings.usage_full_resolution,
            downsample_s=settings.usage_downsample_interval,
            usage_s=settings.usage_retention,
            dedupe_horizon_s=settings.dedupe_horizon,
        )


@dataclass
class PruneResult:
    """Rows one pass deleted per table, and the outbox backlog it found."""

    deleted: dict[str, int] = field(default_factory=dict)
    outbox_rows: int = 0


async def _delete_in_batches(engine: AsyncEngine, statement: Delete) -> int:
    """Run a `DELETE ... WHERE condition` `DELETE_BATCH` rows at a time (by primary key); returns how many went."""
    table = statement.table
    assert isinstance(table, Table) and statement.whereclause is not None
    key = tuple_(*table.primary_key.columns)
    total = 0
    while True:
        doomed = select(*table.primary_key.columns).where(statement.whereclause).limit(DELETE_BATCH)
        async with engine.begin() as conn:
            gone = (await conn.execute(statement.where(key.in_(doomed)))).rowcount
        total += gone
        if gone < DELETE_BATCH:
            return total


def thin_statement(step_s: float, since: datetime, until: datetime) -> Delete:
    """DELETE every usage sample in [since, until) but those of the first sample time of its node in each
    `step_s` bucket (every sample of that moment stays, so per-pod sums stay whole)."""
    ts, node = usage_samples.c.ts, usage_samples.c.node
    bucket = func.floor(extract("epoch", ts) / step_s)
    firsts = (
        select(node.label("node"), bucket.label("bucket"), func.min(ts).label("kept"))
        .where(ts >= since, ts < until)
        .group_by(node, bucket)
        .cte("firsts")
    )
    return delete(usage_samples).where(
        ts >= since,
        ts < until,
        node == firsts.c.node,
        bucket == firsts.c.bucket,
        ts > firsts.c.kept,
    )


class Housekeeper:
    """Prunes accounting's tables and takes ledger snapshots, each on its own period."""

    def __init__(
        self,
        engine: AsyncEngine,
        bus: EventBus | None,
        retention: Retention,
        *,
        snapshot_interval_s: float = 3600.0,
        snapshot_keep: int = 3,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
        on_pruned: Callable[[str, int], None] | None = None,
        on_snapshot: Callable[[SnapshotResult], None] | None = None,
        on_failure: Callable[[str], None] | None = None,
    ) -> None:
        self.engine = engine
        self.bus = bus
        self.retention = retention
        self.snapshot_interval_s = snapshot_interval_s
        self.snapshot_keep = snapshot_keep
        self.clock = clock
        self.on_pruned = on_pruned
        self.on_snapshot = on_snapshot
        self.on_failure = on_failure
        self.thinned_until: datetime | None = None  # samples before this are thinned already

    async def prune(self) -> PruneResult:
        """One pruning pass over usage_samples, applied_events and acc_pending."""
        now, r, out = self.clock(), self.retention, PruneResult()
        expire_before = now - timedelta(seconds=r.usage_s)
        out.deleted["usage_samples"] = await _delete_in_batches(
            self.engine, delete(usage_samples).where(usage_samples.c.ts < expire_before)
        )
        if r.downsample_s > 0:
            since = max(expire_before, self.thinned_until or expire_before)
            out.deleted["usage_samples"] += await self._thin(since, now - timedelta(seconds=r.full_resolution_s))
        horizon = now - timedelta(seconds=r.dedupe_horizon_s)
        out.deleted["applied_events"] = await _delete_in_batches(
            self.engine, delete(applied_events).where(applied_events.c.applied_at < horizon)
        )
        out.deleted["acc_pending"] = await _delete_in_batches(
            self.engine, delete(pending).where(pending.c.refused_at < expire_before)
        )
        async with self.engine.connect() as conn:
            out.outbox_rows = int((await conn.execute(select(func.count()).select_from(outbox))).scalar_one())
        for table, rows in out.deleted.items():
            if self.on_pruned is not None and rows:
                self.on_pruned(table, rows)
        if any(out.deleted.values()):
            log.info("pruned %s", ", ".join(f"{rows} {table} rows" for table, rows in out.deleted.items() if rows))
        return out

    async def _thin(self, since: datetime, until: datetime) -> int:
        """Thin samples in [since, until) to one sample time per node per downsample interval."""
        step = self.retention.downsample_s
        # bucket boundaries: a window starts on one, so a bucket is never split between two statements
        start = datetime.fromtimestamp((since.timestamp() // step) * step, UTC)
        total = 0
        while start < until:
            end = min(start + THIN_WINDOW, until)
            end = datetime.fromtimestamp((end.timestamp() // step) * step, UTC) if end < until else end
            if end <= start:
                break
            async with self.engine.begin() as conn:
                total += (await conn.execute(thin_statement(step, start, end))).rowcount
            start = end
        # a bucket cut by `until` is thinned again next time, with its later samples
        self.thinned_until = datetime.fromtimestamp((until.timestamp() // step) * step, UTC)
        return total

    async def snapshot(self) -> SnapshotResult | None:
        """Take a ledger snapshot and trim the ledger stream (None without a bus, or after a gap)."""
        if self.bus is None:
            return None
        try:
            result = await take_snapshot(
                self.bus, keep=self.snapshot_keep, dedupe_horizon_s=self.retention.dedupe_horizon_s, now=self.clock()
            )
        except StreamGap as exc:
            log.error("no ledger snapshot: %s", exc)
            if self.on_failure is not None:
                self.on_failure("snapshot")
            return None
        if self.on_snapshot is not None:
            self.on_snapshot(result)
        return result

    async def run(self, stop: asyncio.Event) -> None:
        """Prune every `PASS_PERIOD_S` and snapshot every `snapshot_interval_s` (0: never) until `stop`;
        a failed step is logged and tried again on its next turn."""
        next_snapshot = time.monotonic() + min(60.0, self.snapshot_interval_s)  # first one soon after start
        while not stop.is_set():
            for name, step, due in (
                ("prune", self.prune, True),
                ("snapshot", self.snapshot, self.snapshot_interval_s > 0 and time.monotonic() >= next_snapshot),
            ):
                if not due:
                    continue
                try:
                    await step()
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    log.warning("housekeeping %s failed: %r; trying again later", name, exc)
                    if self.on_failure is not None:
                        self.on_failure(name)
                if name == "snapshot":
                    next_snapshot = time.monotonic() + self.snapshot_interval_s
            wait = PASS_PERIOD_S
            if self.snapshot_interval_s > 0:
                wait = max(1.0, min(wait, next_snapshot - time.monotonic()))
            try:
                await asyncio.wait_for(stop.wait(), wait)
            except TimeoutError:
                pass
