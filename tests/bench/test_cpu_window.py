"""The CPU-per-pod window counts the servers' processes, whether they listen on TCP or on a unix socket."""

from __future__ import annotations

from pathlib import Path

import asyncpg

from bench.common import Context
from bench.cpu import CpuWindow, listener_pids
from tests.conftest import _run


def test_postgres_found_by_its_unix_socket_and_its_cpu_counted(pg_server_url: str, nats_url: str) -> None:
    ctx = Context("tiny", pg_server_url, nats_url, Path("/tmp"))
    listeners = ctx.server_ports()
    assert len(listeners) == 2, listeners  # PostgreSQL (socket or port) and NATS
    pids = listener_pids(listeners)
    assert len(pids) >= 2, (listeners, pids)

    async def work() -> None:
        conn = await asyncpg.connect(pg_server_url)
        try:
            await conn.execute("SELECT count(*) FROM generate_series(1, 3000000)")
        finally:
            await conn.close()

    with CpuWindow(listeners) as window:
        _run(work())
    assert window.spent().get("postgres", 0.0) > 0.05, window.spent()
