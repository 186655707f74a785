"""What every benchmark shares: profiles, results with targets, statistics, and private servers."""

from __future__ import annotations

import asyncio
import contextlib
import os
import platform
import socket
import statistics
import subprocess
import time
import uuid
from collections.abc import AsyncIterator, Iterator, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any
from urllib.parse import parse_qsl, urlsplit

import asyncpg

from devstack.embedded import EmbeddedNats, EmbeddedPostgres, with_database
from shared.events.bus import BusNames, EventBus

MACHINE_DATABASE_URL = "postgresql://postgres@127.0.0.1:5432/postgres"
MACHINE_NATS_URL = "nats://127.0.0.1:4222"
PROFILES = ("tiny", "quick", "full")


@dataclass
class Target:
    """A goal from the benchmark spec: `metric op value`, and whether this run met it."""

    metric: str
    op: str  # ">=", "<=", ">"
    value: float
    met: bool | None = None

    def check(self, metrics: dict[str, Any]) -> None:
        """Fill in `met` from the measured metrics (None when the metric is missing)."""
        got = metrics.get(self.metric)
        if not isinstance(got, int | float):
            self.met = None
            return
        self.met = {">=": got >= self.value, "<=": got <= self.value, ">": got > self.value}[self.op]


@dataclass
class BenchResult:
    """One benchmark's outcome: flat metrics (numbers), targets, notes; status ok / skipped / error."""

    name: str
    title: str
    profile: str
    status: str = "ok"
    metrics: dict[str, Any] = field(default_factory=dict)
    targets: list[Target] = field(default_factory=list)
    params: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    duration_s: float = 0.0

    def finish(self) -> BenchResult:
        """Evaluate the targets against the metrics."""
        for t in self.targets:
            t.check(self.metrics)
        return self

    def to_json(self) -> dict[str, Any]:
        """A JSON-ready dict."""
        return asdict(self)


@dataclass
class Context:
    """Where and how big a benchmark runs."""

    profile: str
    database_url: str  # a server's maintenance database; benchmarks create private databases on it
    nats_url: str
    work_dir: Path
    resources: contextlib.AsyncExitStack = field(default_factory=contextlib.AsyncExitStack)
    cache: dict[str, Any] = field(default_factory=dict)
    # the seed's extender binaries by variant (`bench.peer`): "as_shipped", "raised"
    peer_extenders: dict[str, str] = field(default_factory=dict)

    async def seeded_database(self, nodes: int) -> tuple[str, list[Any]]:
        """A private database holding `nodes` x 8 half-full GPUs, made once per run and shared (read-only use).

        Returns its URL and the events that describe it.
        """
        from bench.stack import seed_half_full

        key = f"half-full-{nodes}"
        if key not in self.cache:
            url = await self.resources.enter_async_context(private_database(self.database_url, f"seed{nodes}"))
            self.cache[key] = (url, await seed_half_full(url, nodes))
        return self.cache[key]

    def server_ports(self) -> list[int | str]:
        """Where the PostgreSQL and NATS servers in use listen (for `bench.cpu.CpuWindow`): local TCP ports, or
        the PostgreSQL unix socket's path when the URL names a socket directory (`?host=/dir`)."""
        out: list[int | str] = []
        for url, default in ((self.database_url, 5432), (self.nats_url, 4222)):
            parts = urlsplit(url)
            socket_dir = dict(parse_qsl(parts.query)).get("host", "")
            if socket_dir.startswith("/"):
                out.append(f"{socket_dir}/.s.PGSQL.{parts.port or default}")
            elif parts.hostname in ("127.0.0.1", "localhost", "::1"):
                out.append(parts.port or default)
        return out

    def pick(self, tiny: Any, quick: Any, full: Any) -> Any:
        """The value for this run's profile."""
        return {"tiny": tiny, "quick": quick, "full": full}[self.profile]


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100) by linear interpolation; NaN for no values."""
    if not values:
        return float("nan")
    data = sorted(values)
    if len(data) == 1:
        return float(data[0])
    pos = (len(data) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(data) - 1)
    return float(data[lo] + (data[hi] - data[lo]) * (pos - lo))


def latency_summary(prefix: str, seconds: Sequence[float]) -> dict[str, float]:
    """p50 / p99 / max in milliseconds, keyed `<prefix>_p50_ms` etc."""
    return {
        f"{prefix}_p50_ms": round(percentile(seconds, 50) * 1000, 3),
        f"{prefix}_p99_ms": round(percentile(seconds, 99) * 1000, 3),
        f"{prefix}_max_ms": round(max(seconds) * 1000, 3) if seconds else float("nan"),
    }


def median(values: Sequence[float]) -> float:
    """The median, NaN for none."""
    return float(statistics.median(values)) if values else float("nan")


def reachable(url: str, timeout: float = 0.5) -> bool:
    """Whether something listens at the host:port of a URL."""
    parts = urlsplit(url)
    try:
        with socket.create_connection((parts.hostname or "127.0.0.1", parts.port or 0), timeout=timeout):
            return True
    except OSError:
        return False


@contextlib.contextmanager
def servers(work_dir: Path) -> Iterator[tuple[str, str]]:
    """PostgreSQL and NATS URLs: GPUSHARE_BENCH_* if set, else the machine's servers, else embedded ones."""
    stack = contextlib.ExitStack()
    with stack:
        db = os.environ.get("GPUSHARE_BENCH_DATABASE_URL") or (
            MACHINE_DATABASE_URL if reachable(MACHINE_DATABASE_URL) else ""
        )
        if not db:
            pg = EmbeddedPostgres(work_dir / "pg", cleanup="delete")
            db = pg.start()
            stack.callback(pg.stop)
        nats_url = os.environ.get("GPUSHARE_BENCH_NATS_URL") or (
            MACHINE_NATS_URL if reachable(MACHINE_NATS_URL) else ""
        )
        if not nats_url:
            server = EmbeddedNats(work_dir / "nats")
            nats_url = server.start()
            stack.callback(server.stop)
        yield db, nats_url


@contextlib.asynccontextmanager
async def private_database(server_url: str, tag: str) -> AsyncIterator[str]:
    """A fresh, migrated database on the server, dropped afterwards; yields its URL."""
    from shared.ledger import migrate

    name = f"gpushare_bench_{tag}_{uuid.uuid4().hex[:8]}"
    conn = await asyncpg.connect(server_url)
    try:
        await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    url = with_database(server_url, name)
    try:
        await migrate.upgrade_async(url)
        yield url
    finally:
        conn = await asyncpg.connect(server_url)
        try:
            await conn.execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')
        finally:
            await conn.close()


def private_names(tag: str) -> BusNames:
    """A stream and subject prefix nobody else uses."""
    suffix = uuid.uuid4().hex[:10]
    return BusNames(stream=f"GPUSHARE_BENCH_{tag.upper()}_{suffix}", prefix=f"gsb{tag}{suffix}")


@contextlib.asynccontextmanager
async def private_bus(nats_url: str, tag: str) -> AsyncIterator[EventBus]:
    """A connected bus on private streams, deleted afterwards."""
    bus = await EventBus.connect(nats_url, private_names(tag), name=f"gpushare-bench-{tag}")
    try:
        yield bus
    finally:
        with contextlib.suppress(Exception):
            await bus.delete_streams()
        await bus.close()


def machine_info() -> dict[str, Any]:
    """CPU model and count, memory, load: to print beside the figures."""
    model = ""
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                model = line.split(":", 1)[1].strip()
                break
    mem_gib = 0.0
    with contextlib.suppress(OSError), open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_gib = round(int(line.split()[1]) / 1024 / 1024, 1)
    try:
        nproc = int(subprocess.run(["nproc"], capture_output=True, text=True, check=True).stdout.strip())
    except (OSError, subprocess.CalledProcessError, ValueError):
        nproc = os.cpu_count() or 0
    return {
        "cpu_model": model,
        "nproc": nproc,
        "memory_gib": mem_gib,
        "load_average": [round(x, 2) for x in os.getloadavg()],
        "python": platform.python_version(),
        "platform": platform.platform(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }


async def gather_limited(limit: int, coros: Sequence[Any]) -> list[Any]:
    """Await coroutines with at most `limit` running at once, in order."""
    sem = asyncio.Semaphore(limit)

    async def one(c: Any) -> Any:
        async with sem:
            return await c

    return await asyncio.gather(*(one(c) for c in coros))
