"""7. Footprint: resident memory of the extender and accounting at 5,000 nodes x 8 GPUs, 40,000 allocations.

Both run as real subprocesses against a private database seeded with the cluster (every GPU holds one
allocation) and private streams that also carry the events describing it, so accounting's consumer has
them to project. After start-up each service is exercised (extender: filter + prioritize over every
node; accounting: cluster, nodes, allocations pages, metrics), then RSS and peak RSS (VmHWM) are read
from /proc.
"""

from __future__ import annotations

import asyncio
import json
import time

import httpx

from bench.common import BenchResult, Context, Target, private_bus
from bench.extender_latency import PREFIX, pod
from bench.replay import publish_all
from bench.stack import node_name, rss_mib, service
from shared.events.catalogue import ReservedEvent

NAME = "footprint"
TITLE = "7. Footprint: extender and accounting RSS, large cluster"


async def run(ctx: Context) -> BenchResult:
    """Seed, start both services, exercise them, read their memory."""
    nodes = ctx.pick(50, 5000, 5000)
    soak_s = ctx.pick(3.0, 20.0, 60.0)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"nodes": nodes, "gpus_per_node": 8, "soak_s": soak_s})
    m = result.metrics
    async with private_bus(ctx.nats_url, "foot") as bus:
        db_url, events = await ctx.seeded_database(nodes)
        m["allocations"] = sum(1 for e in events if isinstance(e, ReservedEvent))
        await publish_all(bus, events)
        common = {"db_url": db_url, "nats_url": ctx.nats_url, "names": bus.names, "work_dir": ctx.work_dir}
        async with service("extender", **common) as ext, service("accounting", **common) as acc:
            started = time.monotonic()  # accounting is ready: its consumer works through the stream from here
            watch = asyncio.create_task(caught_up(acc.url, m["allocations"], started))
            m["extender_rss_start_mib"], _ = rss_mib(ext.pid)
            m["accounting_rss_start_mib"], _ = rss_mib(acc.pid)
            body = json.dumps({"Pod": pod(), "NodeNames": [node_name(n) for n in range(nodes)]}).encode()
            headers = {"Content-Type": "application/json"}
            deadline = time.monotonic() + soak_s
            async with httpx.AsyncClient(timeout=120.0) as client:
                while True:
                    for verb in ("filter", "prioritize"):
                        r = await client.post(f"{ext.url}{PREFIX}/{verb}", content=body, headers=headers)
                        r.raise_for_status()
                    for path in ("/v1/cluster", "/v1/nodes", "/v1/allocations?limit=500&state=live", "/metrics"):
                        r = await client.get(f"{acc.url}{path}")
                        r.raise_for_status()
                    if time.monotonic() > deadline:
                        break
                    await asyncio.sleep(0.5)
                applied = await applied_so_far(client, acc.url)
                done_s = watch.result() if watch.done() else None
                watch.cancel()
                window = done_s if done_s is not None else time.monotonic() - started
            m["extender_rss_mib"], m["extender_peak_rss_mib"] = rss_mib(ext.pid)
            m["accounting_rss_mib"], m["accounting_peak_rss_mib"] = rss_mib(acc.pid)
            m["accounting_events_projected"] = int(applied)
            m["accounting_catchup_s"] = round(done_s, 1) if done_s is not None else None
            m["accounting_catchup_events_per_s"] = round(applied / window, 1) if window > 0 else 0.0
            m["events_in_stream"] = len(events)
    result.targets += [
        Target("extender_peak_rss_mib", "<=", 250.0),
        Target("accounting_peak_rss_mib", "<=", 250.0),
    ]
    result.notes.append(
        "accounting keeps its read models in PostgreSQL; accounting_events_projected says how far its consumer "
        f"got through the {len(events)} events within the soak ({m['allocations']} of them change its read "
        "models); accounting_catchup_events_per_s is that count over the seconds from accounting's readiness to "
        "the last one applied (accounting_catchup_s, that counter read every 0.2 s) or to the end of the soak, while "
        "the extender is exercised on the same machine"
    )
    return result


async def caught_up(url: str, total: int, started: float, *, every_s: float = 0.2) -> float:
    """Seconds from `started` until accounting has applied `total` events (its /metrics read every `every_s`)."""
    async with httpx.AsyncClient(timeout=30.0) as client:
        while True:
            if await applied_so_far(client, url) >= total:
                return time.monotonic() - started
            await asyncio.sleep(every_s)


APPLIED = "gpushare_accounting_events_applied_total"


async def applied_so_far(client: httpx.AsyncClient, url: str) -> float:
    """The events accounting at `url` has applied, read from /metrics filtered to that counter (the whole page
    is 15 MB at 5,000 nodes)."""
    return applied_events((await client.get(f"{url}/metrics", params={"name[]": APPLIED})).text)


def applied_events(metrics: str) -> float:
    """gpushare_accounting_events_applied_total from a /metrics page (0 when absent)."""
    for line in metrics.splitlines():
        if line.startswith(APPLIED):
            return float(line.split()[-1])
    return 0.0
