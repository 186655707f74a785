"""The node agent as a DRA plugin, in this process, against the real 1.37.2 control plane (kube-scheduler allocates;
no binder gate runs here, the test records in the ledger what the gate would), the ledger's gateway on real
PostgreSQL and NATS, and the kubelet stand-in's DRA side (devstack/cluster/kubelet_dra.py) on temp sockets:
registration (also with a kubelet that knows only v1beta1), the slice's generation and taint on a health change,
the health stream, and preparing a claim only once the ledger holds it."""

from __future__ import annotations

import asyncio
import shutil
import tempfile
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client
from sqlalchemy import select

from devstack.cluster.kubelet_dra import DraKubeletStandIn, DraPrepareDeferred, DraPrepareError
from devstack.cluster.nodes import create_gpu_node, delete_node
from services.node_agent import dra as dra_module
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.discovery import FakeBackend
from shared.dra import CLAIM_ANNOTATION, DRIVER, UNHEALTHY_TAINT
from shared.dra.cdi import spec_file_name
from shared.dra.claims import LedgerGpu, read_claim
from shared.dra.classes import device_class
from shared.dra.slices import device_name
from shared.events.bus import EventBus
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations, gpus
from shared.settings import MemoryUnit
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.node_agent.conftest import wait_ready
from tests.waiting import eventually

pytestmark = needs_dra


class DraNodeHarness:
    """One DRA node: the agent, its kubelet stand-in, the API."""

    def __init__(self, api: client.ApiClient, node: str, root: Path, ledger: Ledger, bus: EventBus) -> None:
        self.api, self.node, self.root, self.ledger, self.bus = api, node, root, ledger, bus
        self.backend = FakeBackend(node, "2x16GiB:Tesla-T4")
        self.agent: NodeAgent | None = None
        self.kubelet: DraKubeletStandIn | None = None

    def config(self) -> AgentConfig:
        return AgentConfig(
            node=self.node,
            device_plugin_dir=self.root / "dp",
            usage_interval_s=3600,
            proc_root=self.root / "proc",
            dra=True,
            dra_registration_dir=self.root / "registry",
            dra_plugin_dir=self.root / "plugin",
            cdi_dir=self.root / "cdi",
            dra_ledger_wait_s=2.0,
        )

    async def start_agent(self, services: tuple[str, ...] | None = None) -> NodeAgent:
        """The agent, and the kubelet stand-in (knowing `services`, default all) unless one runs: the agent is
        ready once kubelet registered its plugin and the slice is published."""
        self.agent = NodeAgent(self.config(), self.backend, bus=self.bus, kube_api=self.api)
        await self.agent.start()
        if self.kubelet is None:
            extra = {} if services is None else {"services": services}
            self.kubelet = await DraKubeletStandIn(self.api, self.root / "registry", self.root / "cdi", **extra).start()
        await wait_ready(self.agent)
        return self.agent


@pytest.fixture
async def dra_node(control_plane, gateway, bus) -> AsyncIterator[DraNodeHarness]:  # type: ignore[no-untyped-def]
    ledger, _relay = gateway
    api = control_plane.api_client()
    node = f"dra-{uuid.uuid4().hex[:6]}"
    root = Path(tempfile.mkdtemp(prefix="dra-", dir="/tmp"))
    await create_gpu_node(api, node, gpus=[(16, "Tesla-T4")] * 2, dra=True)
    try:
        await client.ResourceV1Api(api).create_device_class(device_class(), _preload_content=False)
    except client.ApiException as exc:
        if exc.status != 409:
            raise
    h = DraNodeHarness(api, node, root, ledger, bus)
    try:
        yield h
    finally:
        if h.agent is not None:
            await h.agent.close()
        if h.kubelet is not None:
            await h.kubelet.stop()
        h.backend.close()
        await delete_node(api, node)
        await api.close()
        shutil.rmtree(root, ignore_errors=True)


async def test_registration_the_slice_and_health_follow_the_gpus(dra_node: DraNodeHarness) -> None:
    h = dra_node
    agent = await h.start_agent()
    plugin = await h.kubelet.wait_registered(DRIVER)
    assert (plugin.service, plugin.health_service) == ("v1.DRAPlugin", "v1.DRAResourceHealth")
    assert agent.dra.server.registered
    first = await w.resource_slice(h.api, h.node)
    generation = first["spec"]["pool"]["generation"]
    names = [device_name(g.uuid) for g in agent.gpus]
    assert [d["name"] for d in first["spec"]["devices"]] == names
    await h.kubelet.wait_for(lambda: all(h.kubelet.device_health(DRIVER, h.node, n) == "HEALTHY" for n in names))

    sick = agent.gpus[0].uuid
    h.backend.set_health(sick, False, "fake XID 79")

    async def tainted() -> dict[str, Any] | None:
        s = await w.resource_slice(h.api, h.node)
        taints = s["spec"]["devices"][0].get("taints") or []
        return s if any(t["key"] == UNHEALTHY_TAINT and t["effect"] == "NoSchedule" for t in taints) else None

    s = await eventually(tainted, what="the unhealthy GPU's taint", within=30)
    assert s["spec"]["pool"]["generation"] == generation + 1
    await h.kubelet.wait_for(lambda: h.kubelet.device_health(DRIVER, h.node, names[0]) == "UNHEALTHY")
    assert h.kubelet.device_health(DRIVER, h.node, names[1]) == "HEALTHY"
    assert await eventually(lambda: _healthy(h.ledger, sick, False), what="the ledger's health", within=30)

    h.backend.set_health(sick, True)
    s = await eventually(lambda: _untainted(h.api, h.node), what="the recovered GPU's taint gone", within=30)
    assert s["spec"]["pool"]["generation"] == generation + 2
    await h.kubelet.wait_for(lambda: h.kubelet.device_health(DRIVER, h.node, names[0]) == "HEALTHY")

    # a restarted agent finds its slice as the inventory says: same generation, nothing written
    await agent.close()
    again = await h.start_agent()
    await eventually(lambda: again.dra.published.is_set(), what="the slice checked", within=30)
    assert again.dra.slices.writes == 0
    assert (await w.resource_slice(h.api, h.node))["spec"]["pool"]["generation"] == generation + 2


async def test_the_slice_waits_for_kubelet_to_register_the_plugin(
    dra_node: DraNodeHarness, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """kube-scheduler allocates on a slice at once, and kubelet fails a claim's preparation while its driver is not
    registered ("DRA driver gpu.gpushare.io is not registered"), trying the pod again only at its resync, about a
    minute later (pkg/kubelet/cm/dra/manager.go, pod_workers.go; `make run` on real nodes saw the demo's DRA pods
    start 64 and 75 s after they were bound). So the agent publishes its slice, and says it is ready, only once
    kubelet registered the plugin, however soon the ledger holds the GPUs; a wait past its patience is a warning
    naming the registration folder."""
    h = dra_node
    monkeypatch.setattr(dra_module, "REGISTRATION_PATIENCE_S", 1.0)
    agent = NodeAgent(h.config(), h.backend, bus=h.bus, kube_api=h.api)
    h.agent = agent
    await agent.start()
    await eventually(lambda: agent.inventory_recorded(), what="the GPUs in the ledger", within=30)
    for _ in range(8):  # the slice loop's passes (every 0.5 s, and at once on the inventory's change)
        await asyncio.sleep(0.25)
        assert await w.resource_slice(h.api, h.node) is None, "a slice published before kubelet registered the plugin"
        assert not agent.ready()

    def warnings() -> list[str]:
        return [r.getMessage() for r in caplog.records if r.levelname == "WARNING" and "has not registered" in r.msg]

    await eventually(warnings, what="the warning that kubelet has not registered the plugin", within=30)
    assert str(h.root / "registry") in warnings()[0], warnings()
    assert await w.resource_slice(h.api, h.node) is None
    h.kubelet = await DraKubeletStandIn(h.api, h.root / "registry", h.root / "cdi").start()
    await h.kubelet.wait_registered(DRIVER)
    await wait_ready(agent)
    published = await w.resource_slice(h.api, h.node)
    assert published is not None
    assert [d["name"] for d in published["spec"]["devices"]] == [device_name(g.uuid) for g in agent.gpus]


async def _untainted(api: client.ApiClient, node: str) -> dict[str, Any] | None:
    s = await w.resource_slice(api, node)
    return s if not any(d.get("taints") for d in s["spec"]["devices"]) else None


async def test_a_claim_is_prepared_only_once_the_ledger_holds_it_also_through_v1beta1(dra_node: DraNodeHarness) -> None:
    """kube-scheduler allocates the claim (no gate runs here, so the pod waits at its binding condition): a prepare
    call is refused while the ledger has not recorded it, and succeeds, idempotently, once it has; the kubelet here
    knows only `v1beta1.DRAPlugin`. Which container holds the share comes from the ledger's record: the agent reads
    the claim, never the pod. Unprepare removes the CDI spec and may be repeated."""
    h = dra_node
    await h.start_agent(services=("v1beta1.DRAPlugin",))
    preparer, pod_reads = h.agent.dra.preparer, []
    read_pod = preparer.read_pod

    async def counted_read_pod(namespace: str, name: str) -> dict[str, Any] | None:
        pod_reads.append(name)
        return await read_pod(namespace, name)

    preparer.read_pod = counted_read_pod
    plugin = await h.kubelet.wait_registered(DRIVER)
    assert plugin.service == "v1beta1.DRAPlugin"
    ns = f"ns-{uuid.uuid4().hex[:6]}"
    await client.CoreV1Api(h.api).create_namespace({"metadata": {"name": ns}})
    pod = w.pod("p", [("main", "main")], template_name="t")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": h.node}
    await w.create(h.api, ns, w.template("t", [("main", "3Gi", "25", 1)]), pod)
    claim = await w.wait_claim_allocated(h.api, ns, "p")
    pod_obj = await w.raw_pod(h.api, ns, "p")
    pod_obj["spec"]["nodeName"] = h.node  # kubelet prepares a pod of its node; nothing binds it without the gate
    with pytest.raises(DraPrepareError, match="holds no live allocation"):
        await h.kubelet.prepare(pod_obj)
    assert not (h.root / "cdi" / spec_file_name(claim["metadata"]["uid"])).exists()
    with pytest.raises(DraPrepareDeferred):  # kubelet asks again at the pod's next update or resync, not before
        await h.kubelet.prepare(pod_obj)
    assert [c[0] for c in h.kubelet.calls].count("NodePrepareResources") == 1

    gpus = {device_name(g.uuid): LedgerGpu(g.uuid, g.index, g.memory_mib) for g in h.agent.gpu_infos()}
    event = read_claim(claim, pod_obj, gpus, MemoryUnit.GIB).event(source="binder")
    await h.ledger.reserve_claim(event)
    pod_obj["metadata"].setdefault("annotations", {})[CLAIM_ANNOTATION] = claim["metadata"]["uid"]  # the binder's
    await h.kubelet.prepare(pod_obj)  # the pod's update: kubelet asks again, and the ledger holds the claim now
    await h.kubelet.prepare(pod_obj)  # already prepared: not called again
    assert [c for c in h.kubelet.calls if c[0] == "NodePrepareResources"][-1][1] == [claim["metadata"]["uid"]]
    env = h.kubelet.container_env(pod_obj, pod_obj["spec"]["containers"][0])
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "3" and env["GPUSHARE_GPU_MEMORY_MIB"] == "3072"
    state = await eventually(lambda: _state(h.ledger, event.allocation_id, "assigned"), what="assigned", within=30)
    assert state
    assert pod_reads == [] and preparer.pod_reads == 0  # the holder came from the ledger's record
    # a second prepare by a restarted kubelet (no cache) finds the same spec and records nothing new
    h.kubelet.cache.clear()
    await h.kubelet.prepare(pod_obj)
    await h.kubelet.unprepare(pod_obj)
    assert not (h.root / "cdi" / spec_file_name(claim["metadata"]["uid"])).exists()
    assert h.agent.dra.preparer.unprepare(claim["metadata"]["uid"]) is False  # again: idempotent
    await client.CoreV1Api(h.api).delete_namespace(ns)


async def test_a_prepare_that_comes_before_the_record_waits_for_it(dra_node: DraNodeHarness) -> None:
    """Without the gate kubelet may ask as soon as the pod is bound, a moment before the binder's record reaches the
    agent: the prepare waits for the ledger to hold the claim (the node's events) instead of refusing at once, and
    how long it waited is observed."""
    h = dra_node
    agent = await h.start_agent()
    await h.kubelet.wait_registered(DRIVER)
    ns = f"ns-{uuid.uuid4().hex[:6]}"
    await client.CoreV1Api(h.api).create_namespace({"metadata": {"name": ns}})
    pod = w.pod("q", [("main", "main")], template_name="t")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": h.node}
    await w.create(h.api, ns, w.template("t", [("main", "2Gi", None, 1)]), pod)
    claim = await w.wait_claim_allocated(h.api, ns, "q")
    pod_obj = await w.raw_pod(h.api, ns, "q")
    pod_obj["spec"]["nodeName"] = h.node
    gpus = {device_name(g.uuid): LedgerGpu(g.uuid, g.index, g.memory_mib) for g in agent.gpu_infos()}
    event = read_claim(claim, pod_obj, gpus, MemoryUnit.GIB).event(source="binder")
    registry, labels = agent.metrics.registry, {"node": h.node}
    wait_sum = "gpushare_node_agent_dra_prepare_ledger_wait_seconds_sum"
    before = registry.get_sample_value(wait_sum, labels) or 0.0
    preparing = asyncio.create_task(h.kubelet.prepare(pod_obj))
    await eventually(lambda: h.kubelet.calls, what="kubelet's NodePrepareResources call", within=10)
    await asyncio.sleep(1.0)  # the agent has read the claim and waits for the ledger
    assert not preparing.done()  # waiting, not refused
    await h.ledger.reserve_claim(event)
    await asyncio.wait_for(preparing, 10)
    assert (registry.get_sample_value(wait_sum, labels) or 0.0) > before
    assert not registry.get_sample_value("gpushare_node_agent_dra_prepares_total", {**labels, "outcome": "refused"})
    await client.CoreV1Api(h.api).delete_namespace(ns)


async def test_alike_shares_of_one_gpu_held_by_two_containers_are_told_apart_by_the_pod(
    dra_node: DraNodeHarness,
) -> None:
    """Two containers, each with its own 2Gi request, both allocated on one GPU: the ledger's record holds two alike
    parts of that GPU, so it cannot say which share is whose. The agent reads the pod then (once), and each
    container gets its own request's device."""
    h = dra_node
    agent = await h.start_agent()
    await h.kubelet.wait_registered(DRIVER)
    preparer, pod_reads = agent.dra.preparer, []
    read_pod = preparer.read_pod

    async def counted_read_pod(namespace: str, name: str) -> dict[str, Any] | None:
        pod_reads.append(name)
        return await read_pod(namespace, name)

    preparer.read_pod = counted_read_pod
    ns = f"ns-{uuid.uuid4().hex[:6]}"
    await client.CoreV1Api(h.api).create_namespace({"metadata": {"name": ns}})
    pod = w.pod("r", [("a", "ra"), ("b", "rb")], template_name="t")
    pod["spec"]["nodeSelector"] = {"kubernetes.io/hostname": h.node}
    await w.create(h.api, ns, w.template("t", [("ra", "2Gi", None, 1), ("rb", "2Gi", None, 1)]), pod)
    claim = await w.wait_claim_allocated(h.api, ns, "r")
    results = claim["status"]["allocation"]["devices"]["results"]
    assert len({r["device"] for r in results}) == 1, f"kube-scheduler took the first GPU that fits for both: {results}"
    pod_obj = await w.raw_pod(h.api, ns, "r")
    pod_obj["spec"]["nodeName"] = h.node
    gpus = {device_name(g.uuid): LedgerGpu(g.uuid, g.index, g.memory_mib) for g in agent.gpu_infos()}
    event = read_claim(claim, pod_obj, gpus, MemoryUnit.GIB).event(source="binder")
    await h.ledger.reserve_claim(event)
    await h.kubelet.prepare(pod_obj)
    assert pod_reads == ["r"] and preparer.pod_reads == 1
    for container in pod_obj["spec"]["containers"]:
        env = h.kubelet.container_env(pod_obj, container)
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2", (container["name"], env)

    async def both_assigned() -> bool:  # each holder's own part is stamped: both containers were named
        async with h.ledger.engine.connect() as conn:
            stamped = (
                await conn.execute(
                    select(allocation_parts.c.container, allocation_parts.c.assigned_at).where(
                        allocation_parts.c.allocation_id == event.allocation_id
                    )
                )
            ).all()
        return sorted(c for c, at in stamped if at is not None) == ["a", "b"]

    assert await eventually(both_assigned, what="both containers' parts assigned", within=30)
    await client.CoreV1Api(h.api).delete_namespace(ns)


async def _healthy(ledger: Ledger, gpu_uuid: str, healthy: bool) -> bool:
    async with ledger.engine.connect() as conn:
        return (await conn.execute(select(gpus.c.healthy).where(gpus.c.uuid == gpu_uuid))).scalar() is healthy


async def _state(ledger: Ledger, allocation_id: uuid.UUID, state: str) -> bool:
    async with ledger.engine.connect() as conn:
        found = (await conn.execute(select(allocations.c.state).where(allocations.c.id == allocation_id))).scalar()
    return found == state
