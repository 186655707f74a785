"""4. Ledger ceiling: concurrent reservations/s through `Ledger.reserve` vs a plain single-row UPDATE.

N actors spread over P processes hammer the same private database. Ledger phase: each actor reserves
1 GiB on a random GPU (invariant on: conditional UPDATE + CHECKs, allocation row, parts, outbox row),
then releases it so capacity never runs out; each process runs its own outbox relay, as a service would.
Baseline phase: the same actors, the same pools, each doing `UPDATE bench_counters SET n = n + 1 WHERE
id = 1` in its own transaction. Phases alternate for `rounds` rounds; figures are medians over rounds.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import random
import time
import uuid
from concurrent.futures import ProcessPoolExecutor
from typing import Any

from sqlalchemy import text

from bench.common import BenchResult, Context, latency_summary, median, private_bus, private_database
from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.ledger.reservations import ReservationRequest

NAME = "ledger"
TITLE = "4. Ledger ceiling: reservations/s vs single-row UPDATE"
GPU_MIB = 16 * 1024


def gpu_uuid(node: int, index: int) -> str:
    """A stable fake GPU UUID."""
    return f"GPU-bench-{node:05d}-{index}"


async def _actor_ledger(ledger: Ledger, gpus: list[tuple[str, str, int]], end: float, rng: random.Random) -> dict:
    reserve_lat: list[float] = []
    release_lat: list[float] = []
    while time.monotonic() < end:
        node, gpu, index = rng.choice(gpus)
        pod = uuid.uuid4().hex
        req = ReservationRequest(
            pod_uid=pod,
            namespace="bench",
            pod_name=f"p-{pod[:8]}",
            node=node,
            parts=(
                AllocationPart(container="main", container_index=0, gpu_uuid=gpu, gpu_index=index, memory_mib=1024),
            ),
        )
        t0 = time.perf_counter()
        res = await ledger.reserve(req)
        t1 = time.perf_counter()
        await ledger.release(res.allocation_id, pod, node, "bench")
        t2 = time.perf_counter()
        reserve_lat.append(t1 - t0)
        release_lat.append(t2 - t1)
    return {"reserve": reserve_lat, "release": release_lat}


async def _actor_update(engine: Any, end: float) -> dict:
    lat: list[float] = []
    stmt = text("UPDATE bench_counters SET n = n + 1 WHERE id = 1")
    while time.monotonic() < end:
        t0 = time.perf_counter()
        async with engine.begin() as conn:
            await conn.execute(stmt)
        lat.append(time.perf_counter() - t0)
    return {"update": lat}


async def _worker_main(
    mode: str, db_url: str, nats_url: str, names: BusNames, actors: int, duration: float, start_at: float, seed: int
) -> dict:
    engine = make_engine(db_url, pool_size=actors, max_overflow=0)
    bus = await EventBus.connect(nats_url, names, name="gpushare-bench-ledger")
    relay = OutboxRelay(engine, bus)
    ledger = Ledger(engine, prefix=names.prefix, source="bench", on_commit=relay.kick)
    stop = asyncio.Event()
    relay_task = asyncio.create_task(relay.run(stop))
    try:

        async def warm() -> None:
            async with engine.connect() as conn:
                await conn.execute(text("SELECT 1"))
                await asyncio.sleep(0.05)

        await asyncio.gather(*(warm() for _ in range(actors)))
        async with engine.connect() as conn:
            rows = (await conn.execute(text("SELECT node, uuid, index FROM gpus ORDER BY uuid"))).all()
        gpus = [(r[0], r[1], r[2]) for r in rows]
        await asyncio.sleep(max(0.0, start_at - time.time()))
        t0 = time.perf_counter()
        end = time.monotonic() + duration
        if mode == "ledger":
            outs = await asyncio.gather(
                *(_actor_ledger(ledger, gpus, end, random.Random(seed * 1000 + i)) for i in range(actors))
            )
        else:
            outs = await asyncio.gather(*(_actor_update(engine, end) for _ in range(actors)))
        elapsed = time.perf_counter() - t0
    finally:
        stop.set()
        relay.kick()
        with contextlib.suppress(Exception):
            await asyncio.wait_for(relay_task, 10)
        with contextlib.suppress(Exception):
            await relay.flush()
        await bus.close()
        await engine.dispose()
    merged: dict[str, list[float]] = {}
    for out in outs:
        for k, v in out.items():
            merged.setdefault(k, []).extend(v)
    return {"elapsed": elapsed, "latencies": merged}


def _worker(args: tuple) -> dict:
    logging.getLogger("shared.events.bus").setLevel(logging.ERROR)  # reconnect chatter when closing
    return asyncio.run(_worker_main(*args))


async def _seed(db_url: str, names: BusNames, bus: EventBus, nodes: int, gpus_per_node: int) -> None:
    engine = make_engine(db_url, pool_size=4)
    try:
        ledger = Ledger(engine, prefix=names.prefix, source="bench")
        for n in range(nodes):
            await ledger.record(
                InventoryEvent(
                    node=f"node-{n:05d}",
                    gpus=[
                        GpuInfo(
                            uuid=gpu_uuid(n, i),
                            index=i,
                            model="Bench-16G",
                            memory_mib=GPU_MIB,
                            memory_total_mib=GPU_MIB,
                        )
                        for i in range(gpus_per_node)
                    ],
                )
            )
        await OutboxRelay(engine, bus).flush()
        async with engine.begin() as conn:
            await conn.execute(text("CREATE TABLE bench_counters (id int PRIMARY KEY, n bigint NOT NULL)"))
            await conn.execute(text("INSERT INTO bench_counters VALUES (1, 0)"))
    finally:
        await engine.dispose()


async def run(ctx: Context) -> BenchResult:
    """Alternate baseline and ledger phases with the same processes x actors; report rates and latencies."""
    processes = ctx.pick(1, 2, 2)
    actors = ctx.pick(2, 8, 16)
    duration = ctx.pick(1.0, 5.0, 10.0)
    rounds = ctx.pick(1, 1, 3)
    nodes = ctx.pick(4, 50, 100)
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={
            "processes": processes,
            "actors_per_process": actors,
            "connections": processes * actors,
            "phase_s": duration,
            "rounds": rounds,
            "gpus": nodes * 8,
        },
    )
    async with private_database(ctx.database_url, "ledger") as db_url, private_bus(ctx.nats_url, "ledger") as bus:
        await _seed(db_url, bus.names, bus, nodes, 8)
        spawn = multiprocessing.get_context("spawn")
        rates: dict[str, list[float]] = {"update": [], "reserve": []}
        lats: dict[str, list[float]] = {"update": [], "reserve": [], "release": []}
        with ProcessPoolExecutor(processes, mp_context=spawn) as pool:
            loop = asyncio.get_running_loop()
            for r in range(rounds):
                for mode in ("update", "ledger"):
                    start_at = time.time() + ctx.pick(3.0, 4.0, 4.0)  # room for spawn + imports + warm-up
                    futures = [
                        loop.run_in_executor(
                            pool,
                            _worker,
                            (mode, db_url, ctx.nats_url, bus.names, actors, duration, start_at, r * 100 + p),
                        )
                        for p in range(processes)
                    ]
                    outs = await asyncio.gather(*futures)
                    elapsed = max(o["elapsed"] for o in outs)
                    key = "update" if mode == "update" else "reserve"
                    count = sum(len(o["latencies"][key]) for o in outs)
                    rates[key].append(count / elapsed)
                    for o in outs:
                        for k, v in o["latencies"].items():
                            lats[k].extend(v)
    m = result.metrics
    m["update_per_s"] = round(median(rates["update"]), 1)
    m["reservations_per_s"] = round(median(rates["reserve"]), 1)
    m["ledger_txn_per_s"] = round(2 * m["reservations_per_s"], 1)
    m["ratio_reservations_vs_update"] = round(m["reservations_per_s"] / m["update_per_s"], 3)
    m["ratio_txn_vs_update"] = round(m["ledger_txn_per_s"] / m["update_per_s"], 3)
    m.update(latency_summary("reserve", lats["reserve"]))
    m.update(latency_summary("release", lats["release"]))
    m.update(latency_summary("update", lats["update"]))
    result.notes.append(
        "each reservation is followed by its release (two ledger transactions, each with its outbox row); "
        "ratio_txn_vs_update compares transactions one for one"
    )
    return result
