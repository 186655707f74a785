"""Rebuilding the ledger from the event stream, and comparing it with the live database."""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from nats.aio.msg import Msg
from nats.js.api import ConsumerConfig, DeliverPolicy
from sqlalchemy import delete, insert, select
from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.events.bus import EventBus
from shared.events.catalogue import Event, EventDecodeError, decode_event
from shared.ledger.models import allocation_parts, allocations, gpus, nodes, outbox, part_from_row, part_row, quotas
from shared.ledger.rules import LIVE_STATE_VALUES, AllocationState
from shared.ledger.state import AllocationRow, GpuRow, LedgerState, NodeRow

log = logging.getLogger(__name__)

Progress = Callable[[int, int], None]


@dataclass
class ReplayStats:
    """What a replay read."""

    events: int = 0
    skipped: int = 0
    last_sequence: int = 0


_BUFFER_HIGH_WATER = 10_000


def _stream_sequence(reply: str) -> int:
    """The stream sequence from a JetStream reply subject (cheaper than `Msg.metadata`).

    `$JS.ACK.<stream>.<consumer>.<delivered>.<sseq>.<cseq>.<ts>.<pending>` (9 tokens), or with a
    domain and account hash first (12 tokens, `$JS.ACK.<domain>.<hash>.<stream>...`).
    """
    tokens = reply.split(".")
    return int(tokens[5] if len(tokens) == 9 else tokens[7])


async def read_events(
    bus: EventBus,
    *,
    stream: str | None = None,
    after: int = 0,
    stats: ReplayStats | None = None,
    progress: Progress | None = None,
    idle_timeout_s: float = 10.0,
) -> AsyncIterator[Event]:
    """Every event in the stream (the ledger stream unless told) after stream sequence `after`, oldest first,
    up to the last one present when called.

    Undecodable messages are counted and skipped (consumers park them the same way). Messages arrive
    through a callback into a local buffer that is drained in batches: the per-message cost of
    `next_msg` (a task and a timer per message) dominated replay time.
    """
    stats = stats or ReplayStats()
    stream = stream or bus.names.stream
    info = await bus.js.stream_info(stream)
    last = info.state.last_seq
    if info.state.messages == 0 or last <= after:
        return
    buffer: deque[Msg] = deque()
    arrived, drained = asyncio.Event(), asyncio.Event()

    async def on_message(msg: Msg) -> None:
        while len(buffer) >= _BUFFER_HIGH_WATER:  # a slow reader: leave the rest in the subscription's queue
            drained.clear()
            await drained.wait()
        buffer.append(msg)
        arrived.set()

    start = (
        ConsumerConfig(deliver_policy=DeliverPolicy.BY_START_SEQUENCE, opt_start_seq=after + 1)
        if after > 0
        else ConsumerConfig(deliver_policy=DeliverPolicy.ALL)
    )
    sub = await bus.js.subscribe(
        f"{bus.names.prefix}.>",
        cb=on_message,
        ordered_consumer=True,
        config=start,
        stream=stream,
        pending_msgs_limit=1_000_000,
    )
    try:
        while True:
            if not buffer:
                drained.set()
                arrived.clear()
                try:
                    await asyncio.wait_for(arrived.wait(), idle_timeout_s)
                except TimeoutError:
                    raise TimeoutError(
                        f"replay stalled at stream sequence {stats.last_sequence} of {last}: "
                        f"no message for {idle_timeout_s:g}s"
                    ) from None
            while buffer:
                msg = buffer.popleft()
                seq = _stream_sequence(msg.reply)
                stats.last_sequence = seq
                try:
                    event = decode_event(msg.data)
                except EventDecodeError as exc:
                    stats.skipped += 1
                    log.warning("replay skipped message %d: %s", seq, exc)
                else:
                    stats.events += 1
                    yield event
                if progress is not None and (stats.events + stats.skipped) % 5000 == 0:
                    progress(seq, last)
                if seq >= last:
                    return
    finally:
        await sub.unsubscribe()
        if progress is not None and stats.last_sequence >= last:
            progress(last, last)


async def replay_state(bus: EventBus, *, progress: Progress | None = None) -> tuple[LedgerState, ReplayStats]:
    """Fold the whole stream into a `LedgerState`."""
    state, stats = LedgerState(), ReplayStats()
    async for event in read_events(bus, stats=stats, progress=progress):
        state.apply(event)
    return state, stats


async def read_live_state(engine: AsyncEngine) -> LedgerState:
    """The live ledger tables as of one moment: `load_state` in one read-only REPEATABLE READ transaction. Under READ
    COMMITTED each table is read as of its own statement, and a change that commits between two of them is half in
    (a reservation's allocation without its GPU's charge)."""
    async with engine.connect() as conn:
        await conn.execution_options(isolation_level="REPEATABLE READ", postgresql_readonly=True)
        async with conn.begin():
            return await load_state(conn)


async def load_state(conn: AsyncConnection) -> LedgerState:
    """The live ledger tables as a `LedgerState`, for comparison with a replay (`read_live_state` reads them as of
    one moment)."""
    state = LedgerState()
    for r in (await conn.execute(select(nodes))).all():
        state.nodes[r.name] = NodeRow(
            r.driver_version,
            r.cuda_version,
            r.retired_at is not None,
            str((r.labels or {}).get("address", "")),
            r.allocator,
        )
    for r in (await conn.execute(select(gpus))).all():
        state.gpus[r.uuid] = GpuRow(
            node=r.node,
            index=r.index,
            model=r.model,
            memory_mib=r.memory_mib,
            memory_total_mib=r.memory_total_mib,
            compute_units=r.compute_units,
            healthy=r.healthy,
            health_reason=r.health_reason,
            mig_mode=r.mig_mode,
            numa_node=r.numa_node,
            pci_bus_id=r.pci_bus_id,
            retired=r.retired_at is not None,
            allocated_memory_mib=r.allocated_memory_mib,
            allocated_compute=r.allocated_compute,
        )
    parts: dict[Any, list[Any]] = {}
    for p in (await conn.execute(select(allocation_parts))).all():
        parts.setdefault(p.allocation_id, []).append(p)
    for r in (await conn.execute(select(allocations))).all():
        rows = parts.get(r.id, [])
        state.allocations[r.id] = AllocationRow(
            pod_uid=r.pod_uid,
            namespace=r.namespace,
            pod_name=r.pod_name,
            owner_kind=r.owner_kind,
            owner_name=r.owner_name,
            node=r.node,
            state=AllocationState(r.state),
            memory_mib=r.memory_mib,
            compute=r.compute,
            reason=r.reason,
            reserved_at=r.reserved_at,
            bound_at=r.bound_at,
            assigned_at=r.assigned_at,
            ended_at=r.ended_at,
            terminating_at=r.terminating_at,
            version=r.version,
            pod_created_at=r.pod_created_at,
            parts=tuple(part_from_row(p) for p in rows),
            assigned_containers={p.container: p.assigned_at for p in rows if p.assigned_at is not None},
            claim_uid=r.claim_uid,
            claim_name=r.claim_name,
        )
        if r.state in LIVE_STATE_VALUES:
            state.live_by_pod[r.pod_uid] = r.id
    for r in (await conn.execute(select(quotas))).all():
        state.quotas[r.namespace] = (r.memory_mib, r.compute)
    return state


def differences(live: LedgerState, replayed: LedgerState, *, limit: int = 20) -> list[str]:
    """Human-readable differences between two ledgers (empty when they are equal)."""
    out: list[str] = []
    a, b = live.canonical(), replayed.canonical()
    for table in a:
        keys = set(a[table]) | set(b[table])
        for key in sorted(keys, key=str):
            if a[table].get(key) != b[table].get(key):
                out.append(f"{table}[{key}]: live={a[table].get(key)!r} replayed={b[table].get(key)!r}")
                if len(out) >= limit:
                    return out
    return out


async def write_state(engine: AsyncEngine, state: LedgerState) -> None:
    """Replace the ledger tables with `state` in one transaction (disaster recovery)."""
    async with engine.begin() as conn:
        for table in (allocation_parts, allocations, gpus, nodes, quotas):
            await conn.execute(delete(table))
        if state.nodes:
            await conn.execute(
                insert(nodes),
                [
                    {
                        "name": n,
                        "driver_version": r.driver_version,
                        "cuda_version": r.cuda_version,
                        "labels": {"address": r.address},
                        "allocator": r.allocator,
                        "retired_at": _retired_stamp(r.retired),
                    }
                    for n, r in state.nodes.items()
                ],
            )
        gpu_rows = []
        for u, g in state.gpus.items():
            if g.node not in state.nodes:
                continue
            row = {k: v for k, v in vars(g).items() if k != "retired"}
            gpu_rows.append({"uuid": u, **row, "retired_at": _retired_stamp(g.retired)})
        if gpu_rows:
            await conn.execute(insert(gpus), gpu_rows)
        if state.allocations:
            await conn.execute(
                insert(allocations),
                [
                    {
                        "id": i,
                        "pod_uid": a.pod_uid,
                        "namespace": a.namespace,
                        "pod_name": a.pod_name,
                        "owner_kind": a.owner_kind,
                        "owner_name": a.owner_name,
                        "node": a.node,
                        "state": a.state.value,
                        "memory_mib": a.memory_mib,
                        "compute": a.compute,
                        "reason": a.reason,
                        "reserved_at": a.reserved_at,
                        "bound_at": a.bound_at,
                        "assigned_at": a.assigned_at,
                        "ended_at": a.ended_at,
                        "terminating_at": a.terminating_at,
                        "version": a.version,
                        "pod_created_at": a.pod_created_at,
                        "claim_uid": a.claim_uid,
                        "claim_name": a.claim_name,
                    }
                    for i, a in state.allocations.items()
                ],
            )
            part_rows = [
                part_row(i, p, a.assigned_containers.get(p.container))
                for i, a in state.allocations.items()
                for p in a.parts
            ]
            if part_rows:
                await conn.execute(insert(allocation_parts), part_rows)
        if state.quotas:
            await conn.execute(
                insert(quotas),
                [{"namespace": ns, "memory_mib": m, "compute": c} for ns, (m, c) in state.quotas.items()],
            )


def _retired_stamp(retired: bool) -> datetime | None:
    return datetime.now(UTC) if retired else None


async def wait_for_quiet(engine: AsyncEngine, *, timeout_s: float = 30.0) -> None:
    """Wait until the outbox is empty (every committed change is in the stream)."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        async with engine.connect() as conn:
            left = (await conn.execute(select(outbox.c.seq).limit(1))).first()
        if left is None:
            return
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("the outbox did not drain: is an outbox relay running?")
        await asyncio.sleep(0.1)
