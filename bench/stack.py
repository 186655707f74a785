"""Seeding a large ledger quickly and running real service subprocesses against it."""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import httpx

from devstack.embedded import free_port
from shared.events.bus import BusNames
from shared.events.catalogue import AllocationPart, GpuInfo, InventoryEvent, ReservedEvent
from shared.ledger.db import make_engine
from shared.ledger.replay import write_state
from shared.ledger.state import LedgerState

GPU_MIB = 16 * 1024


def node_name(n: int) -> str:
    """The name of the n-th seeded node."""
    return f"node-{n:05d}"


def half_full_events(nodes: int, gpus_per_node: int = 8) -> list[InventoryEvent | ReservedEvent]:
    """Nodes x GPUs of 16 GiB, each GPU half full: one inventory per node, one 8 GiB reservation per GPU."""
    events: list[InventoryEvent | ReservedEvent] = []
    for n in range(nodes):
        name = node_name(n)
        uuids = [f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{name}-{i}')}" for i in range(gpus_per_node)]
        events.append(
            InventoryEvent(
                node=name,
                driver_version="550.54.15",
                cuda_version="12.4",
                gpus=[
                    GpuInfo(
                        uuid=u, index=i, model="NVIDIA A100-SXM4-16GB", memory_mib=GPU_MIB, memory_total_mib=GPU_MIB
                    )
                    for i, u in enumerate(uuids)
                ],
            )
        )
        for i, u in enumerate(uuids):
            pod = str(uuid.uuid4())
            events.append(
                ReservedEvent(
                    allocation_id=uuid.uuid4(),
                    pod_uid=pod,
                    namespace=f"team-{n % 20}",
                    pod_name=f"train-{pod[:8]}",
                    node=name,
                    parts=[
                        AllocationPart(
                            container="main", container_index=0, gpu_uuid=u, gpu_index=i, memory_mib=GPU_MIB // 2
                        )
                    ],
                    source="extender",
                )
            )
    return events


async def seed_half_full(db_url: str, nodes: int, gpus_per_node: int = 8) -> list[InventoryEvent | ReservedEvent]:
    """Write a half-full cluster into the ledger; returns the events that describe it.

    The state is folded from the same events the services would have recorded (`LedgerState.apply`) and
    written with `write_state`, the ledger's bulk restore path: a commit per event would take minutes.
    """
    events = half_full_events(nodes, gpus_per_node)
    state = LedgerState()
    for e in events:
        state.apply(e)
    engine = make_engine(db_url, pool_size=2)
    try:
        await write_state(engine, state)
    finally:
        await engine.dispose()
    return events


def rss_mib(pid: int) -> tuple[float, float]:
    """(current RSS, peak RSS) of a process in MiB, from /proc."""
    values = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            values[key] = int(rest.split()[0]) / 1024
    return round(values.get("VmRSS", 0.0), 1), round(values.get("VmHWM", 0.0), 1)


@dataclass
class Service:
    """A running `gpushare <command>` subprocess."""

    command: str
    proc: subprocess.Popen[bytes]
    url: str
    log_path: Path

    @property
    def pid(self) -> int:
        """Its process id."""
        return self.proc.pid


def _spawn(args: list[str], log_path: Path) -> subprocess.Popen[bytes]:
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "wb") as log_file:
        return subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, start_new_session=True)


@contextlib.asynccontextmanager
async def service(
    command: str,
    *,
    db_url: str,
    nats_url: str,
    names: BusNames,
    work_dir: Path,
    extra: list[str] | None = None,
    ready_timeout_s: float = 120.0,
) -> AsyncIterator[Service]:
    """Start `gpushare <command> --port P` on private streams, wait for /readyz, stop it (SIGTERM) afterwards."""
    port = free_port()
    log_path = work_dir / f"{command}-{port}.log"
    args = [
        sys.executable,
        "-m",
        "services.cli",
        command,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--database-url",
        db_url,
        "--nats-url",
        nats_url,
        "--stream-name",
        names.stream,
        "--subject-prefix",
        names.prefix,
        "--log-level",
        "WARNING",
        *(extra or []),
    ]
    proc = await asyncio.to_thread(_spawn, args, log_path)
    svc = Service(command, proc, f"http://127.0.0.1:{port}", log_path)
    try:
        deadline = time.monotonic() + ready_timeout_s
        async with httpx.AsyncClient(timeout=2.0) as client:
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"{command} exited with {proc.returncode}: {log_path.read_text()[-2000:]}")
                with contextlib.suppress(httpx.HTTPError):
                    if (await client.get(f"{svc.url}/readyz")).status_code == 200:
                        break
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{command} not ready within {ready_timeout_s}s: {log_path.read_text()[-2000:]}")
                await asyncio.sleep(0.2)
        yield svc
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                await asyncio.to_thread(proc.wait, 15)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                await asyncio.to_thread(proc.wait, 5)
