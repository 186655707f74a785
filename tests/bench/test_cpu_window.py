"""The CPU-per-pod window counts the servers' processes, whether they listen on TCP or on a unix socket."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

import asyncpg

from bench.common import Context
from bench.cpu import CpuWindow, _processes, background_ms_per_item, group_of, listener_pids
from tests.conftest import _run


def test_postgres_found_by_its_unix_socket_and_its_cpu_counted(pg_server_url: str, nats_url: str) -> None:
    ctx = Context("tiny", pg_server_url, nats_url, Path("/tmp"))
    listeners = ctx.server_ports()
    assert len(listeners) == 2, listeners  # PostgreSQL (socket or port) and NATS
    pids = listener_pids(listeners)
    assert len(pids) >= 2, (listeners, pids)

    # the connection is open before the window and closed after it: its backend is alive (not exited, not waiting
    # to be reaped) at both readings, so the query's CPU is read from the backend itself
    async def work() -> CpuWindow:
        conn = await asyncpg.connect(pg_server_url)
        try:
            with CpuWindow(listeners) as window:
                await conn.execute("SELECT count(*) FROM generate_series(1, 3000000)")
        finally:
            await conn.close()
        return window

    window = _run(work())
    assert window.spent().get("postgres", 0.0) > 0.05, window.spent()


def test_background_cpu_is_spread_over_the_phase_and_its_pods() -> None:
    """An idle window's CPU, scaled to a phase's length and divided by its pods: per group family and total."""
    idle = {"kube-apiserver": 0.3, "etcd": 0.1, "extender": 0.05, "postgres": 0.05, "bench": 0.1}
    figures = background_ms_per_item(idle, idle_s=2.0, busy_s=4.0, items=200, prefix="pipeline")
    # control plane 0.4 s per 2 s idle -> 0.8 s over the 4 s phase -> 4 ms per pod; gpushare 0.1 -> 1 ms
    assert figures == {
        "pipeline_background_cpu_ms_per_pod_control_plane": 4.0,
        "pipeline_background_cpu_ms_per_pod_product": 1.0,
        "pipeline_background_cpu_ms_per_pod_total": 6.0,
    }
    assert set(background_ms_per_item(idle, 0.0, 4.0, 200, "raw").values()) == {0.0}


def test_a_process_that_exited_unreaped_keeps_its_group() -> None:
    """A process that exited and whose parent has not reaped it yet has an empty command line; its CPU must still
    go to its group (the postgres test above once saw a closed backend's CPU under "other", its postmaster not
    having reaped it when the window closed)."""
    child = subprocess.Popen(["sleep", "0"])  # not waited for: a zombie once it exits
    try:
        deadline = time.monotonic() + 10
        while Path(f"/proc/{child.pid}/cmdline").read_bytes() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert Path(f"/proc/{child.pid}/cmdline").read_bytes() == b""  # exited, not reaped
        seen = _processes()[child.pid]
        assert seen.command == "sleep" and group_of(seen.command, seen.pid) == "other"
        assert group_of("postgres", 1) == "postgres"  # how a zombie postgres backend is named
    finally:
        child.wait()
