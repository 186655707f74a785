"""An exchange's annotation rewrite does not wait behind a burst of `assigned` events (a real kube-apiserver).

In a burst of 1,000 pods on 40 nodes (kubelet stand-ins with PreStart exchanges), the binder's consumer of
`assigned` and `exchanged` events held up to 367 events at once, and each exchange's rewrite waited its turn behind
the assigned flags queued before it: 11.5 s at the median, 18.4 s at p99 (`python -m bench --only annotations
--profile full`), with 41 pods still naming the other pod's GPU in `ALIYUN_COM_GPU_MEM_IDX` 15 s after every pod was
bound. Here the same queue, made smaller and held: 60 assigned flags in the stream, the consumer's writing of them
held back, then an exchange sent by a node agent's ledger link. The exchanged pods must show the new record while
not one flag queued ahead of the exchange is written (before the fix: only after all of them). The flags are then
let through. (Until the flags became cheaper to write, this test let the consumer run and counted the flags written
before the exchange showed, fewer than half; with each flag one patch, the consumer drained faster than the exchange
was rewritten, and the count measured the flags' speed instead of the exchange's independence.)
"""

from __future__ import annotations

import asyncio

import pytest

from services.node_agent.ledger_link import LedgerLink
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_IDX, record_version
from shared.events.bus import EventBus
from shared.events.catalogue import ExchangedEvent
from shared.ledger.ledger import Ledger
from tests.binder.conftest import request_for, state_becomes
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

PODS = 60


async def test_an_exchange_is_rewritten_before_the_assigned_flags_queued_ahead_of_it(
    cluster, ledger: Ledger, engine, bus: EventBus, start_binder
) -> None:
    binder = await start_binder()
    held = asyncio.Event()
    flag = binder.annotations.flag

    async def held_flag(event):  # type: ignore[no-untyped-def]
        await held.wait()
        return await flag(event)

    binder.annotations.flag = held_flag  # type: ignore[method-assign]
    node = await cluster.node(ledger, gpus_gib=(16,) * 8)
    pods = [await cluster.pod(gib=1) for _ in range(PODS)]
    reservations = [await ledger.reserve(request_for(p, node, gib=1, gpu=i % 8)) for i, p in enumerate(pods)]
    await asyncio.gather(*(state_becomes(engine, r, "bound", within=60) for r in reservations))

    # the node agents confirm every container at once (60 `assigned` events, as a burst's admissions do), then one
    # reports an exchange: pod 0 got the devices on pod 1's GPU and pod 1 pod 0's (same size, GPUs 0 and 1)
    await asyncio.gather(
        *(
            ledger.mark_assigned(res.allocation_id, pod.metadata.uid, node.name, "main", [res.parts[0].gpu_uuid])
            for pod, res in zip(pods, reservations, strict=True)
        )
    )
    first, second = reservations[0], reservations[1]
    link = LedgerLink(bus, node.name)
    exchange = ExchangedEvent(
        node=node.name,
        first_allocation_id=first.allocation_id,
        first_container="main",
        second_allocation_id=second.allocation_id,
        second_container="main",
        source="node-agent",
    )
    reply = await link.send(exchange, deadline_s=20)
    assert reply.ok, reply

    names = [p.metadata.name for p in pods]

    async def rewritten() -> tuple[int] | None:
        """How many other pods carry the assigned flag once both exchanged pods show the new record (None: not
        yet)."""
        listed = {
            p.metadata.name: dict(p.metadata.annotations or {})
            for p in (await cluster.core.list_namespaced_pod(cluster.namespace)).items
        }
        a, b = listed[names[0]], listed[names[1]]
        if record_version(a.get(ALLOCATION)) < 2 or record_version(b.get(ALLOCATION)) < 2:
            return None
        assert (a[GPU_MEM_IDX], b[GPU_MEM_IDX]) == ("1", "0")
        return (sum(1 for n in names[2:] if listed[n].get(GPU_MEM_ASSIGNED) == "true"),)  # the rewrite flags both

    (flagged,) = await eventually(rewritten, what="both exchanged pods' annotations to follow the ledger", within=60)
    assert flagged == 0, f"the exchange was rewritten only after {flagged} of {PODS} assigned flags"
    held.set()

    async def all_flagged() -> bool:
        listed = (await cluster.core.list_namespaced_pod(cluster.namespace)).items
        return sum(1 for p in listed if (p.metadata.annotations or {}).get(GPU_MEM_ASSIGNED) == "true") == PODS

    await eventually(all_flagged, what="every assigned flag written", within=60)
