"""`devstack.embedded.sample_connections` counts the clients' connections only, not PostgreSQL's own processes.

The connection cap tests (tests/e2e/test_agents_at_scale.py, bench/scale.py) compare its samples with the
services' pool sizes. PostgreSQL lists its own workers in `pg_stat_activity` with the database's name too: the
autovacuum workers a burst of writes wakes on the database, a parallel query's workers. CI once saw 18 against a
cap of 17 (the pools' hard caps and the commit probes) with the samples steady at 13-15 and no service logging a
replaced connection: such workers were counted as the product's connections. A parallel worker is the one this
test can start at will.
"""

from __future__ import annotations

import asyncio

import asyncpg

from devstack.embedded import sample_connections

CLIENTS = 2


async def test_a_parallel_querys_workers_are_not_counted_as_connections(database_url: str) -> None:
    clients = [await asyncpg.connect(database_url) for _ in range(CLIENTS)]
    samples: list[int] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_connections(database_url, samples, stop, interval=0.05))
    try:
        busy = clients[0]
        # every plan gets a Gather with a worker under it (debug_parallel_query, PostgreSQL 16+); the worker lives
        # for as long as the sleep inside it, and lists itself in pg_stat_activity under this database. The simple
        # query protocol (`execute`): asyncpg's prepared statements run without parallel workers
        await busy.execute("SET debug_parallel_query = on")
        await busy.execute("SET max_parallel_workers_per_gather = 2")
        workers = asyncio.create_task(busy.execute("SELECT count(*) FROM (SELECT pg_sleep(1.5)) AS s"))
        seen_worker = False
        for _ in range(100):
            seen_worker = await clients[1].fetchval(
                "SELECT count(*) > 0 FROM pg_stat_activity "
                "WHERE datname = current_database() AND backend_type = 'parallel worker'"
            )
            if seen_worker:
                break
            await asyncio.sleep(0.02)
        await workers
        await asyncio.sleep(0.1)
    finally:
        stop.set()
        await sampler
        for conn in clients:
            await conn.close()

    assert seen_worker, "the query ran without a parallel worker: the test shows nothing"
    assert samples, "the sampler took no sample"
    assert max(samples) == CLIENTS, (samples, CLIENTS)
