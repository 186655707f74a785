"""Storage stays bounded: a simulated week of usage and placements in compressed time. The samples stream stays
under its cap, the ledger stream is trimmed behind each daily snapshot, `usage_samples`, `applied_events`,
`acc_pending` and `outbox` stay under what their retention allows, and `ledger rebuild` (newest snapshot + tail)
still reproduces the ledger exactly."""

from __future__ import annotations

import asyncio
import logging
from datetime import timedelta

from sqlalchemy import text
from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting.housekeeping import Retention
from services.cli import main as gpushare
from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent, UsageEvent
from shared.events.streams import StreamLimits
from shared.ledger.replay import differences, load_state
from shared.ledger.snapshots import SnapshotStore, replay_tail
from tests.reliability.test_crash import _record

from .compressed import compressed_cluster

log = logging.getLogger(__name__)

DAY, HOUR = 86_400.0, 3_600.0
DAYS = 7
SAMPLE_EVERY_MIN = 15  # simulated minutes between usage events (per node)
LIVE_PODS = 10  # pods end as others come, around this many
SAMPLES_CAP = 256 * 1024  # bytes the samples stream may hold (a week of this cluster's samples is several times more)
RETENTION = Retention(full_resolution_s=DAY, downsample_s=HOUR, usage_s=3 * DAY, dedupe_horizon_s=2 * DAY)


async def test_a_week_of_usage_and_placements_keeps_storage_bounded_and_rebuild_exact(
    engine: AsyncEngine, bus: EventBus, database_url: str, nats_url: str
) -> None:
    async with engine.begin() as conn:
        await conn.execute(text("TRUNCATE acc_timeline, acc_pending, usage_samples RESTART IDENTITY"))
    await bus.ensure_streams(StreamLimits(samples_max_bytes=SAMPLES_CAP))
    names = bus.names
    days: list[dict[str, int]] = []
    claimed_per_day: list[int] = []  # events accounting claims (every projected kind but usage), per day
    async with compressed_cluster(engine, bus, RETENTION) as world:
        await world.inventory()
        for day in range(DAYS):
            first_event = len(world.published)
            for _hour in range(24):
                for _ in range(60 // SAMPLE_EVERY_MIN):
                    world.clock.advance(minutes=SAMPLE_EVERY_MIN)
                    await world.sample()
                for _ in range(world.rng.choice([1, 1, 2])):
                    await world.place()
                while len(world.live) > LIVE_PODS or world.rng.random() < 0.2:
                    await world.end()
                if world.rng.random() < 0.1:
                    await world.flap()
            today = world.published[first_event:]
            claimed_per_day.append(sum(1 for e in today if not isinstance(e, UsageEvent)))
            await world.settle()
            ledger_before = (await bus.js.stream_info(names.stream)).state
            await world.housekeeper.prune()
            snap = await world.housekeeper.snapshot()
            assert snap is not None and snap.written
            ledger_after = (await bus.js.stream_info(names.stream)).state
            samples = (await bus.js.stream_info(names.samples_stream)).state
            figures = {
                "day": day + 1,
                "events": len(today),
                "ledger_events": sum(1 for e in today if not isinstance(e, UsageEvent | RefusedEvent)),
                "ledger_stream_msgs_before_trim": ledger_before.messages,
                "ledger_stream_bytes_before_trim": ledger_before.bytes,
                "ledger_stream_msgs": ledger_after.messages,
                "samples_stream_msgs": samples.messages,
                "samples_stream_bytes": samples.bytes,
                "usage_samples": await world.count("usage_samples"),
                "applied_events": await world.count("applied_events"),
                "acc_pending": await world.count("acc_pending"),
                "outbox": await world.count("outbox"),
                "snapshot_bytes": snap.bytes,
                "snapshot_seen": len((await SnapshotStore(bus).newest()).state.seen),  # type: ignore[union-attr]
            }
            days.append(figures)
            log.info("day %d: %s", day + 1, figures)

            # the samples stream: under its cap; the ledger stream: what came since yesterday's snapshot, then none
            assert samples.bytes <= SAMPLES_CAP
            assert ledger_before.messages <= figures["ledger_events"] + (len(world.published) if day == 0 else 0)
            assert ledger_after.messages == 0, "every consumer read everything: the snapshot covers it all"
            assert figures["outbox"] == 0
            # claims: those of the last two days (the dedupe horizon; claims are stamped when applied, which trails
            # the clock a little, and pruning runs once a day here: at most three days' worth), and the snapshot
            # remembers no more ids than that either
            assert figures["applied_events"] <= sum(claimed_per_day[-3:]) + 1
            assert figures["snapshot_seen"] <= figures["applied_events"] + 2 * world.nodes * 10
        published = sum(len(e.model_dump_json()) for e in world.published if isinstance(e, UsageEvent | RefusedEvent))
        assert published > 3 * SAMPLES_CAP, "the cap was what kept the samples stream small"
        # usage: a day at full resolution, two more thinned to one sample time per node per hour, nothing older
        per_event = max(len(e.samples) for e in world.published if isinstance(e, UsageEvent))
        full_day = world.nodes * 24 * (60 // SAMPLE_EVERY_MIN) * per_event
        thinned_days = world.nodes * 24 * 2 * per_event
        assert days[-1]["usage_samples"] <= full_day + thinned_days + world.nodes * per_event
        assert days[-1]["usage_samples"] < max(d["usage_samples"] for d in days[:3]) * 2
        async with engine.connect() as conn:
            oldest = (await conn.execute(text("SELECT min(ts) FROM usage_samples"))).scalar_one()
            crowded = (
                await conn.execute(
                    text(
                        "SELECT count(*) FROM (SELECT node, date_trunc('hour', ts) AS h, count(DISTINCT ts) AS n "
                        "FROM usage_samples WHERE ts < :cut GROUP BY 1, 2) x WHERE n > 1"
                    ),
                    {"cut": world.clock() - timedelta(seconds=RETENTION.full_resolution_s)},
                )
            ).scalar_one()
        assert oldest >= world.clock() - timedelta(seconds=RETENTION.usage_s)
        assert crowded == 0, "older samples keep one sample time per node per hour"

        # the ledger: the newest snapshot plus the tail reproduces it exactly, through the command line too
        async with engine.connect() as conn:
            live = await load_state(conn)
        assert len(live.allocations) > 150
        replayed, _ = await replay_tail(bus, await SnapshotStore(bus).newest())
        assert differences(live, replayed) == []
        args = ["ledger", "rebuild", "--database-url", database_url, "--nats-url", nats_url]
        code = await asyncio.to_thread(
            gpushare, [*args, "--stream-name", names.stream, "--subject-prefix", names.prefix]
        )
        assert code == 0
    _record("storage-week", days=days)
