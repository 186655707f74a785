"""Today's pod rules at the extender's wire: sidecar containers are charged beside the app containers, and
pods held by scheduling gates are neither placed, reserved nor reported as refused."""

from __future__ import annotations

import asyncio

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.service import ExtenderService
from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent, decode_event
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations, gpus
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args

SIDECAR = [
    {
        "name": "proxy",
        "image": "x",
        "restartPolicy": "Always",
        "resources": {"limits": {"aliyun.com/gpu-mem": "4"}},
    }
]


async def test_a_sidecar_is_charged_beside_the_app_and_the_gpu_refuses_what_would_overcommit_it(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder, engine: AsyncEngine
) -> None:
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    pod = gpu_pod("with-sidecar", 8, init=SIDECAR)
    assert (await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()["NodeNames"] == ["n1"]
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json() == {"Error": ""}
    async with engine.connect() as conn:
        parts = {p.container: p for p in (await conn.execute(select(allocation_parts))).all()}
        held = (await conn.execute(select(gpus.c.allocated_memory_mib))).scalar_one()
        charged = (await conn.execute(select(allocations.c.memory_mib))).scalar_one()
    assert parts["proxy"].init and parts["proxy"].sidecar and not parts["main"].sidecar
    assert held == charged == 12 * 1024  # 4 + 8, not max(8, 4)
    # 4 GiB are left: a 6 GiB pod fails filter, from the live view and from a view reloaded from the ledger
    second = gpu_pod("second", 6)
    for _ in range(2):
        body = (await client.post(f"{PREFIX}/filter", json=names_args(second, ["n1"]))).json()
        assert body["NodeNames"] == [] and "4096 MiB" in body["FailedNodes"]["n1"], body
        await service.resync("test")


async def test_a_gated_pod_is_neither_placed_nor_reserved_nor_reported_as_refused(
    client: httpx.AsyncClient,
    ledger: Ledger,
    service: ExtenderService,
    binder: StandInBinder,
    engine: AsyncEngine,
    bus: EventBus,
) -> None:
    await add_node(ledger, "n1", [4])
    await service.resync("test")
    refusals: list[RefusedEvent] = []

    async def on(msg) -> None:  # type: ignore[no-untyped-def]
        refusals.append(decode_event(msg.data))  # type: ignore[arg-type]

    sub = await bus.nc.subscribe(f"{bus.names.prefix}.refused.>", cb=on)
    fits = gpu_pod("gated-fits", 2)
    too_big = gpu_pod("gated-too-big", 8)
    for pod in (fits, too_big):
        pod["spec"]["schedulingGates"] = [{"name": "example.com/admission"}]
        r = await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
        assert r.status_code == 200
        body = r.json()
        assert body["NodeNames"] == [] and body["FailedNodes"] == {} and body["FailedAndUnresolvableNodes"] == {}
        assert "schedulingGates (example.com/admission)" in body["Error"], body
        bound = (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json()
        assert "schedulingGates" in bound["Error"], bound
        preempt = {"Pod": pod, "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0}}}
        assert (await client.post(f"{PREFIX}/preempt", json=preempt)).json() == {"NodeNameToMetaVictims": {}}
    await asyncio.sleep(0.5)
    await sub.unsubscribe()
    assert refusals == []
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations))).all() == []
    assert binder.seen == []
    # once the gates are removed the same pod is placed as usual
    del fits["spec"]["schedulingGates"]
    assert (await client.post(f"{PREFIX}/filter", json=names_args(fits, ["n1"]))).json()["NodeNames"] == ["n1"]
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(fits, "n1"))).json() == {"Error": ""}


async def test_unreadable_scheduling_gates_are_a_clear_error(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService
) -> None:
    pod = gpu_pod("odd", 2)
    pod["spec"]["schedulingGates"] = "later"
    r = await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    assert r.status_code == 200
    assert "invalid GPU request: spec.schedulingGates must be a list" in r.json()["Error"]
