"""Node agents' `assigned` commands through the binder's gateway over real NATS and PostgreSQL, racing: several
agents at once, each pod's containers as one batch or as single commands, live and ended allocations, and a command
sent twice. Every live container is assigned once and its event reaches the stream once, the ended ones are refused
with the reason, the group commit carries them in fewer transactions than commands, and a replay of the stream
equals the ledger. A gateway that predates batches answers one with "unknown request": the agent then sends the
commands one by one."""

from __future__ import annotations

import asyncio
import uuid

from sqlalchemy import func, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.node_agent.ledger_link import CommandRefused, LedgerLink
from shared.events.agent_rpc import CommandReply, ErrorReply, rpc_prefix
from shared.events.bus import EventBus
from shared.events.catalogue import AllocationPart, AssignedEvent, BoundEvent, GpuInfo, InventoryEvent, ReleasedEvent
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations
from shared.ledger.replay import differences, load_state, replay_state, wait_for_quiet
from shared.ledger.reservations import Reservation, ReservationRequest
from shared.ledger.rules import AllocationState
from tests.node_agent.conftest import running_gateway

NODES = [f"batch-node-{i}" for i in range(3)]
PODS_PER_NODE = 8
GIB = 1024


async def _pod(ledger: Ledger, node: str, i: int) -> Reservation:
    parts = tuple(
        AllocationPart(container=c, container_index=j, gpu_uuid=f"{node}-G{i % 2}", gpu_index=i % 2, memory_mib=GIB)
        for j, c in enumerate(("web", "worker"))
    )
    uid = str(uuid.uuid4())
    r = await ledger.reserve(ReservationRequest(pod_uid=uid, namespace="ns", pod_name=uid[:8], node=node, parts=parts))
    await ledger.record(BoundEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=node))
    return r


def _assigned(r: Reservation, container: str) -> AssignedEvent:
    return AssignedEvent(
        allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=r.node, container=container, gpu_uuids=["x"]
    )


async def test_racing_agents_assign_each_container_once_in_few_transactions(engine: AsyncEngine, bus: EventBus) -> None:
    async with running_gateway(engine, bus) as (ledger, _, gw):
        for node in NODES:
            gpus = [
                GpuInfo(uuid=f"{node}-G{i}", index=i, memory_mib=64 * GIB, memory_total_mib=64 * GIB) for i in (0, 1)
            ]
            await ledger.record(InventoryEvent(node=node, gpus=gpus))
        pods = {node: [await _pod(ledger, node, i) for i in range(PODS_PER_NODE)] for node in NODES}
        ended = {node: pods[node][-1] for node in NODES}  # the pod was deleted before its agent confirmed it
        for r in ended.values():
            await ledger.record(
                ReleasedEvent(allocation_id=r.allocation_id, pod_uid=r.pod_uid, node=r.node, reason="t")
            )
        links = {node: LedgerLink(bus, node) for node in NODES}

        async def agent(node: str) -> list[object]:
            link, out = links[node], []
            for i, r in enumerate(pods[node]):
                events = [_assigned(r, "web"), _assigned(r, "worker")]
                if i % 2:  # one request for the pod's containers
                    out += await link.send_many(events, deadline_s=10)
                else:  # two commands at once, the first of them sent twice (a retry after a lost reply)
                    sent = await asyncio.gather(
                        *(link.send(e, deadline_s=10) for e in (*events, events[0])), return_exceptions=True
                    )
                    out += sent[:2]
            return out

        commands = sum(2 * len(p) for p in pods.values())
        answers = dict(zip(NODES, await asyncio.gather(*(agent(n) for n in NODES)), strict=True))
        await wait_for_quiet(engine)
        async with engine.connect() as conn:
            live_state = await load_state(conn)
            states = dict((await conn.execute(select(allocations.c.id, allocations.c.state))).all())
            stamped = (
                await conn.execute(
                    select(func.count())
                    .select_from(allocation_parts)
                    .where(allocation_parts.c.assigned_at.is_not(None))
                )
            ).scalar_one()
        replayed, _ = await replay_state(bus)

    for node in NODES:
        for r, (web, worker) in zip(pods[node], zip(*[iter(answers[node])] * 2, strict=True), strict=True):
            if r is ended[node]:
                for answer in (web, worker):
                    assert isinstance(answer, CommandRefused), answer
                    assert str(answer) == f"allocation {r.allocation_id} is released on {node}"
                assert states[r.allocation_id] == "released"
            else:
                assert all(isinstance(a, CommandReply) and a.ok for a in (web, worker)), (web, worker)
                assert states[r.allocation_id] == "assigned"
    live = len(NODES) * (PODS_PER_NODE - 1)
    assert stamped == 2 * live
    assigned_events = [e for e in (await _stream_kinds(bus)) if e == "assigned"]
    assert len(assigned_events) == 2 * live  # each once, the repeats too
    assert gw._assigned.batches < commands
    assert differences(live_state, replayed) == []


async def _stream_kinds(bus: EventBus) -> list[str]:
    from shared.ledger.replay import read_events

    kinds: list[str] = []
    async for event in read_events(bus):
        kinds.append(event.kind)
    return kinds


async def test_an_agent_sends_one_by_one_to_a_gateway_without_batches(bus: EventBus) -> None:
    """A binder of the release before batches subscribes to every request subject and answers a batch with an
    `ErrorReply` (unknown request): the agent's commands then go one by one, and it does not try batches again."""
    seen: list[str] = []

    async def old_gateway(msg) -> None:  # type: ignore[no-untyped-def]
        verb = msg.subject.split(".")[-2]
        seen.append(verb)
        if verb == "command":
            await msg.respond(CommandReply(ok=True).model_dump_json().encode())
        else:
            await msg.respond(ErrorReply(error=f"unknown request {verb!r}").model_dump_json().encode())

    sub = await bus.nc.subscribe(f"{rpc_prefix(bus.names.prefix)}.>", cb=old_gateway)
    try:
        link = LedgerLink(bus, "old-node")
        r = Reservation(uuid.uuid4(), "pod", "old-node", AllocationState.BOUND, (), created=True)
        replies = await link.send_many([_assigned(r, "a"), _assigned(r, "b")], deadline_s=5)
        assert [type(x) for x in replies] == [CommandReply, CommandReply]
        await link.send_many([_assigned(r, "c"), _assigned(r, "d")], deadline_s=5)
    finally:
        await sub.unsubscribe()
    assert seen == ["commands", "command", "command", "command", "command"]
    assert not link.batches
