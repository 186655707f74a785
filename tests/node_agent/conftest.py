"""A node agent on the fake backend with the real ledger and NATS, and the kubelet stand-in on temp sockets."""

from __future__ import annotations

import asyncio
import contextlib
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.cluster.kubelet import KubeletStandIn
from services.binder.gateway import LedgerGateway
from services.binder.metrics import BinderMetrics
from services.node_agent.agent import RESOURCES, AgentConfig, NodeAgent
from services.node_agent.discovery import FakeBackend
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations
from shared.ledger.outbox import OutboxRelay
from shared.ledger.reservations import ReservationRequest
from tests.waiting import eventually

NODE = "gpu-node-1"


@dataclass
class Harness:
    """Everything a node-agent test touches."""

    agent: NodeAgent
    kubelet: KubeletStandIn
    ledger: Ledger
    backend: FakeBackend
    bus: EventBus
    root: Path
    relay: OutboxRelay

    def gpu(self, index: int) -> str:
        return self.agent.gpus[index].uuid

    async def reserve(
        self,
        name: str,
        containers: list[tuple[str, list[tuple[int, int]]]],
        *,
        init: list[str] | None = None,
        sidecars: list[str] | None = None,
        wait_for_view: bool = True,
    ) -> tuple[dict[str, Any], uuid.UUID]:
        """Reserve and bind a pod: containers = [(name, [(gpu index, GiB), ...])] (`init` and `sidecars` name
        init containers, in their order among `containers`); returns (pod dict, id) once the agent's view knows
        the bound reservation (as it would long before kubelet sees the pod), unless `wait_for_view` is False."""
        uid = str(uuid.uuid4())
        parts = []
        spec: dict[str, list[dict[str, Any]]] = {"containers": [], "initContainers": []}
        for cname, shares in containers:
            sidecar = cname in (sidecars or [])
            is_init = sidecar or cname in (init or [])
            listed = spec["initContainers" if is_init else "containers"]
            for gi, gib in shares:
                parts.append(
                    AllocationPart(
                        container=cname,
                        container_index=len(listed),
                        gpu_uuid=self.gpu(gi),
                        gpu_index=gi,
                        memory_mib=gib * 1024,
                        init=is_init,
                        sidecar=sidecar,
                    )
                )
            total = sum(g for _, g in shares)
            listed.append({"name": cname, "resources": {"limits": {"aliyun.com/gpu-mem": str(total)}}})
            if sidecar:
                listed[-1]["restartPolicy"] = "Always"
        res = await self.ledger.reserve(
            ReservationRequest(pod_uid=uid, namespace="default", pod_name=name, node=NODE, parts=tuple(parts))
        )
        await self.ledger.mark_bound(res.allocation_id, uid, NODE)
        pod = {"metadata": {"name": name, "namespace": "default", "uid": uid}, "spec": spec}
        if wait_for_view:
            view = self.agent.view
            await eventually(
                lambda: any(c.allocation_id == res.allocation_id and c.bound_at is not None for c in view.containers()),
                what=f"the agent's view of {name}'s reservation",
            )
        return pod, res.allocation_id

    @contextlib.asynccontextmanager
    async def restarted_agent(self) -> AsyncIterator[NodeAgent]:
        """The agent stops (forgetting its Allocate decisions) and a new one registers with kubelet; closed on exit."""
        await self.agent.close()
        agent = NodeAgent(self.agent.config, FakeBackend(self.agent.config.node, self.backend.spec), bus=self.bus)
        await agent.start()
        try:
            await self.kubelet.wait_registered(RESOURCES, timeout_s=30, min_count=2)
            yield agent
        finally:
            await agent.close()

    async def ledger_gpus(self, allocation_id: uuid.UUID, container: str) -> tuple[str, list[str], bool]:
        """(allocation state, GPU UUIDs of the container's parts, all parts assigned)."""
        async with self.ledger.engine.connect() as conn:
            state = (
                await conn.execute(select(allocations.c.state).where(allocations.c.id == allocation_id))
            ).scalar_one()
            rows = (
                await conn.execute(
                    select(allocation_parts.c.gpu_uuid, allocation_parts.c.gpu_index, allocation_parts.c.assigned_at)
                    .where(allocation_parts.c.allocation_id == allocation_id)
                    .where(allocation_parts.c.container == container)
                    .order_by(allocation_parts.c.gpu_index)
                )
            ).all()
        return state, [r.gpu_uuid for r in rows], all(r.assigned_at is not None for r in rows)


async def wait_ready(agent: NodeAgent, timeout_s: float = 30.0) -> None:
    """Wait until the agent's inventory is in the ledger and its view is loaded."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while not agent.ready():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the node agent did not become ready")
        await asyncio.sleep(0.05)


@contextlib.asynccontextmanager
async def running_gateway(
    engine: AsyncEngine, bus: EventBus
) -> AsyncIterator[tuple[Ledger, OutboxRelay, LedgerGateway]]:
    """The binder's ledger gateway (the agents' only way to the ledger) answering over NATS, with an outbox relay;
    yields the ledger and relay the gateway and the test share, and the gateway."""
    stop = asyncio.Event()
    relay = OutboxRelay(engine, bus, poll_s=0.2)
    ledger = Ledger(engine, prefix=bus.names.prefix, source="binder", on_commit=relay.kick)
    gw = LedgerGateway(ledger, bus, metrics=BinderMetrics())
    tasks = [asyncio.create_task(relay.run(stop)), asyncio.create_task(gw.run(stop))]
    await asyncio.wait_for(gw.ready.wait(), 10)
    try:
        yield ledger, relay, gw
    finally:
        with contextlib.suppress(Exception):
            await asyncio.wait_for(relay.flush(), 5)
        stop.set()
        for task in tasks:
            task.cancel()
        for task in tasks:
            with contextlib.suppress(BaseException):
                await task


@pytest.fixture
async def gateway(engine: AsyncEngine, bus: EventBus) -> AsyncIterator[tuple[Ledger, OutboxRelay]]:
    """`running_gateway`: yields the (ledger, relay) that the gateway and the test share."""
    async with running_gateway(engine, bus) as (ledger, relay, _):
        yield ledger, relay


@pytest.fixture
async def harness(
    gateway: tuple[Ledger, OutboxRelay], bus: EventBus, request: pytest.FixtureRequest
) -> AsyncIterator[Harness]:
    """Agent with GPUs 2x16GiB T4 + 1x80GiB A100, registered with a running kubelet stand-in. Parametrized
    indirectly with a dict, it passes it to the FakeBackend (`simulate`, `clock`: simulated usage, whose
    processes' cgroup files go to the agent's proc root)."""
    root = Path(tempfile.mkdtemp(prefix="na-", dir="/tmp"))
    ledger, relay = gateway
    kubelet = KubeletStandIn(root / "dp", root / "pr.sock")
    await kubelet.start()
    options = dict(getattr(request, "param", None) or {})
    if options.get("simulate"):
        options["proc_root"] = root / "proc"
    backend = FakeBackend(NODE, "2x16GiB:Tesla-T4,1x80GiB:A100", **options)
    config = AgentConfig(
        node=NODE,
        device_plugin_dir=root / "dp",
        pod_resources_socket=str(root / "pr.sock"),
        usage_interval_s=3600,
        overuse_grace_s=0.0,
        proc_root=root / "proc",
    )
    agent = NodeAgent(config, backend, bus=bus)
    backend.attach(agent.view.containers)
    await agent.start()
    await kubelet.wait_registered(RESOURCES, timeout_s=30)
    await wait_ready(agent)
    try:
        yield Harness(agent, kubelet, ledger, backend, bus, root, relay)
    finally:
        await agent.close()
        await kubelet.stop()
        backend.close()
        shutil.rmtree(root, ignore_errors=True)
