"""10. Accounting catch-up: how fast a fresh accounting projects a 45,000-event backlog, on its own.

The events of benchmark 7's cluster (5,000 nodes x 8 GPUs, one allocation each: inventories, reservations,
bindings) are published to private streams; then a real `gpushare accounting` starts on a fresh, migrated
database and works through them with nothing else exercised. Catch-up ends when its
`gpushare_accounting_events_applied_total` reaches the number of events that change its read models (read
every 0.1 s). events/s = events in the stream / seconds from readiness to caught up. CPU by component over
the same window (accounting, PostgreSQL, NATS; the benchmark's own polling left out), per 1,000 events.
Benchmark 7 measures the same consumer while the extender is hammered on the same two cores; this one says
what the projections themselves can do.
"""

from __future__ import annotations

import asyncio
import time

import httpx

from bench.common import BenchResult, Context, Target, private_bus, private_database
from bench.cpu import CpuWindow
from bench.footprint import applied_so_far, caught_up
from bench.replay import publish_all
from bench.stack import rss_mib, service
from shared.events.catalogue import ReservedEvent

NAME = "catchup"
TITLE = "10. Accounting catch-up on a 45,000-event backlog (accounting alone)"


async def run(ctx: Context) -> BenchResult:
    """Publish the backlog, start accounting, time its catch-up."""
    nodes = ctx.pick(50, 5000, 5000)
    timeout_s = ctx.pick(60.0, 180.0, 300.0)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"nodes": nodes, "gpus_per_node": 8})
    result.targets.append(Target("catchup_events_per_s", ">=", 5000.0))
    m = result.metrics
    _, events = await ctx.seeded_database(nodes)
    changing = sum(1 for e in events if isinstance(e, ReservedEvent))  # bound events change nothing new here
    async with private_bus(ctx.nats_url, "catch") as bus, private_database(ctx.database_url, "catch") as db_url:
        await publish_all(bus, events)
        common = {"db_url": db_url, "nats_url": ctx.nats_url, "names": bus.names, "work_dir": ctx.work_dir}
        async with service("accounting", **common) as acc:
            with CpuWindow(ctx.server_ports()) as cpu:
                started = time.monotonic()
                try:
                    seconds: float | None = await asyncio.wait_for(
                        caught_up(acc.url, changing, started, every_s=0.1), timeout_s
                    )
                except TimeoutError:
                    seconds = None
                async with httpx.AsyncClient(timeout=30.0) as client:
                    applied = await applied_so_far(client, acc.url)
            m["accounting_rss_mib"], m["accounting_peak_rss_mib"] = rss_mib(acc.pid)
    m["events_in_stream"] = len(events)
    m["events_applied"] = int(applied)
    m["catchup_s"] = round(seconds, 2) if seconds is not None else None
    m["catchup_events_per_s"] = round(len(events) / seconds, 1) if seconds is not None else 0.0
    for group, spent in sorted(cpu.spent().items()):
        if spent > 0 and group != "bench":
            m[f"cpu_ms_per_1000_events_{group.replace('-', '_')}"] = round(spent * 1e6 / len(events), 1)
    if seconds is None:
        result.status = "error"
        result.notes.append(f"accounting applied {int(applied)} of {changing} events within {timeout_s:g} s")
    result.notes.append("CPU from accounting's readiness to caught up, per 1,000 events of the stream")
    return result
