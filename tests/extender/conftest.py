"""An extender app on the real ledger and bus, a client for it, and a stand-in binder."""

from __future__ import annotations

import asyncio
import contextlib
import uuid
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.app import create_app
from services.extender.service import ExtenderService
from shared.events.bus import EventBus
from shared.events.catalogue import GpuInfo, InventoryEvent, ReservedEvent, decode_event
from shared.ledger.ledger import Ledger
from shared.ledger.outbox import OutboxRelay
from shared.settings import MemoryUnit

PREFIX = "/gpushare-scheduler"


def gpu_pod(name: str, mem: int | str, *, uid: str | None = None, namespace: str = "default", **extra: Any) -> dict:
    """A Pod as kube-scheduler 1.20 serialises it (camelCase object, lots of nulls)."""
    limits: dict[str, Any] = (
        {"aliyun.com/gpu-mem": str(mem)} if not isinstance(mem, str) else {"aliyun.com/gpu-mem": mem}
    )
    limits.update(extra.pop("limits", {}))
    return {
        "metadata": {
            "name": name,
            "namespace": namespace,
            "uid": uid or str(uuid.uuid4()),
            "resourceVersion": "1",
            "creationTimestamp": "2026-01-01T00:00:00Z",
            "annotations": extra.pop("annotations", None),
            "ownerReferences": extra.pop("owners", None),
        },
        "spec": {
            "containers": [{"name": "main", "image": "busybox", "resources": {"limits": limits, "requests": limits}}],
            "initContainers": extra.pop("init", None),
            "schedulerName": "default-scheduler",
            "nodeName": None,
        },
        "status": {"phase": "Pending"},
    }


def names_args(pod: dict, nodes: list[str]) -> dict:
    return {"Pod": pod, "Nodes": None, "NodeNames": nodes}


def nodes_args(pod: dict, nodes: list[str]) -> dict:
    items = [{"metadata": {"name": n, "labels": {"kubernetes.io/hostname": n}}, "status": {}} for n in nodes]
    return {"Pod": pod, "Nodes": {"metadata": {}, "items": items}, "NodeNames": None}


def bind_args(pod: dict, node: str) -> dict:
    m = pod["metadata"]
    return {"PodName": m["name"], "PodNamespace": m["namespace"], "PodUID": m["uid"], "Node": node}


async def add_node(
    ledger: Ledger, name: str, free_gib: list[int], *, model: str = "Tesla T4", cuda: str = "12.2"
) -> None:
    await ledger.record(
        InventoryEvent(
            node=name,
            cuda_version=cuda,
            gpus=[
                GpuInfo(uuid=f"GPU-{name}-{i}", index=i, model=model, memory_mib=g * 1024, memory_total_mib=g * 1024)
                for i, g in enumerate(free_gib)
            ],
        )
    )


class StandInBinder:
    """Plays the binder: marks each reservation bound, or failed when its pod name starts with 'fail'."""

    def __init__(self, bus: EventBus, ledger: Ledger, *, silent: bool = False) -> None:
        self.bus, self.ledger, self.silent = bus, ledger, silent
        self.seen: list[ReservedEvent] = []
        self._sub: Any = None
        self._tasks: set[asyncio.Task] = set()

    async def start(self) -> None:
        self._sub = await self.bus.nc.subscribe(f"{self.bus.names.prefix}.reserved.>", cb=self._on)

    async def _on(self, msg: Any) -> None:
        event = decode_event(msg.data)
        assert isinstance(event, ReservedEvent)
        self.seen.append(event)
        if self.silent:
            return
        if event.pod_name.startswith("fail"):
            await self.ledger.mark_failed(event.allocation_id, event.pod_uid, event.node, "stand-in binder refused")
        else:
            await self.ledger.mark_bound(event.allocation_id, event.pod_uid, event.node)

    async def stop(self) -> None:
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()


@pytest.fixture
async def ledger(engine: AsyncEngine, bus: EventBus) -> AsyncIterator[Ledger]:
    relay = OutboxRelay(engine, bus, poll_s=0.2)
    stop = asyncio.Event()
    led = Ledger(engine, prefix=bus.names.prefix, source="test", on_commit=relay.kick)
    task = asyncio.create_task(relay.run(stop))
    yield led
    stop.set()
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


@pytest.fixture
async def service(engine: AsyncEngine, bus: EventBus, ledger: Ledger) -> AsyncIterator[ExtenderService]:
    svc = ExtenderService(
        engine=engine,
        ledger=ledger,
        bus=bus,
        unit=MemoryUnit.GIB,
        bind_timeout_s=3.0,
        kube_enabled=False,
        poll_s=0.2,
    )
    await svc.start()
    yield svc
    await svc.close()


@pytest.fixture
async def client(service: ExtenderService) -> AsyncIterator[httpx.AsyncClient]:
    app = create_app(service, max_body_bytes=256 * 1024)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://extender") as c:
        yield c


@pytest.fixture
async def binder(bus: EventBus, ledger: Ledger) -> AsyncIterator[StandInBinder]:
    b = StandInBinder(bus, ledger)
    await b.start()
    yield b
    await b.stop()
