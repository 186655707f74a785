"""The ledger's public face: each change is applied and its event staged in one transaction.

Services call these methods; they never write ledger tables directly. Because every committed change
has exactly one event in the outbox (and so, soon after, in the stream), the stream is a complete log
of the ledger and `gpushare ledger rebuild` can reproduce it.
"""

from __future__ import annotations

import logging
import uuid
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager
from datetime import datetime

from sqlalchemy.ext.asyncio import AsyncConnection, AsyncEngine

from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    ClaimReservedEvent,
    ExchangedEvent,
    FailedEvent,
    HealthEvent,
    InventoryEvent,
    NodeRetiredEvent,
    QuotaEvent,
    ReleasedEvent,
    ReservedEvent,
    TerminatingEvent,
)
from shared.ledger import (
    batch_reserve,
    claims,
    idempotency,
    inventory,
    locks,
    outbox,
    quotas,
    reservations,
    transitions,
)
from shared.ledger.commit_watch import watch_of
from shared.ledger.db import reading
from shared.ledger.reservations import Reservation, ReservationError, ReservationRequest
from shared.ledger.rules import AllocationState

log = logging.getLogger(__name__)

LedgerEvent = (
    InventoryEvent
    | NodeRetiredEvent
    | HealthEvent
    | QuotaEvent
    | ReservedEvent
    | ClaimReservedEvent
    | BoundEvent
    | AssignedEvent
    | ReleasedEvent
    | FailedEvent
    | ExchangedEvent
    | TerminatingEvent
)


async def apply_event(conn: AsyncConnection, event: LedgerEvent) -> object:
    """Apply any ledger event to the tables inside the caller's transaction."""
    match event:
        case ClaimReservedEvent():  # before ReservedEvent: a claim's reservation is one too
            return await claims.reserve_claim(conn, event)
        case ReservedEvent():
            await locks.lock_for_reservations(conn, [event])  # quota and GPUs before the allocation (`locks`)
            return await reservations.reserve(conn, event)
        case BoundEvent() | AssignedEvent() | ReleasedEvent() | FailedEvent():
            return await transitions.apply_transition(conn, event)
        case ExchangedEvent():
            return await transitions.apply_exchange(conn, event)
        case TerminatingEvent():
            return await transitions.apply_terminating(conn, event)
        case InventoryEvent():
            await inventory.apply_inventory(conn, event)
            return None
        case HealthEvent():
            return await inventory.apply_health(conn, event)
        case NodeRetiredEvent():
            await inventory.apply_node_retired(conn, event)
            return None
        case QuotaEvent():
            await quotas.apply_quota(conn, event)
            return None
    raise TypeError(f"not a ledger event: {type(event).__name__}")


class Ledger:
    """Applies ledger changes and stages their events atomically; kicks the outbox relay after commit."""

    def __init__(
        self,
        engine: AsyncEngine,
        *,
        prefix: str,
        source: str = "",
        on_commit: Callable[[], None] | None = None,
    ) -> None:
        self.engine = engine
        self.prefix = prefix
        self.source = source
        self.on_commit = on_commit

    def _committed(self) -> None:
        if self.on_commit is not None:
            self.on_commit()

    def _begin(self) -> AbstractAsyncContextManager[AsyncConnection]:
        """A write transaction; refused at once (`CommitsRefused`, naming why) while the ledger's COMMITs are held
        (`commit_watch`): it could only wait for them."""
        watch = watch_of(self.engine)
        if watch is not None:
            watch.refuse_if_held()
        return self.engine.begin()

    async def record(self, event: LedgerEvent) -> object:
        """Apply one event and stage it, in one transaction (an exchange is staged with its result)."""
        async with self._begin() as conn:
            result = await apply_event(conn, event)
            await outbox.stage(conn, self.prefix, result if isinstance(result, ExchangedEvent) else event)
        self._committed()
        return result

    async def record_once(self, event: LedgerEvent, consumer: str) -> object | None:
        """`record`, unless `consumer` already applied this event id (then nothing is written: None).

        For commands that are not idempotent by themselves (an exchange applied twice swaps back) and that a
        sender may repeat after a lost reply.
        """
        async with self._begin() as conn:
            if not await idempotency.claim(conn, consumer, event.event_id):
                return None
            result = await apply_event(conn, event)
            await outbox.stage(conn, self.prefix, result if isinstance(result, ExchangedEvent) else event)
        self._committed()
        return result

    async def reserve(self, request: ReservationRequest) -> Reservation:
        """Reserve GPU shares for a pod, or return its existing live reservation.

        Raises `InsufficientCapacity` / `QuotaExceeded` (nothing is written then).
        """
        (answer,) = await self.reserve_many([request])
        if isinstance(answer, ReservationError):
            raise answer
        return answer

    async def reserve_many(self, requests: list[ReservationRequest]) -> list[Reservation | ReservationError]:
        """Reserve for several pods in one transaction (group commit): one answer per request, in order.

        A request's answer is its reservation (new, or the live one its pod already holds) or the
        `ReservationError` that concerns it alone. The regular batch takes a constant number of statements
        (`batch_reserve`); any other is retried one pod at a time, each under a savepoint, so a conflict
        fails only the pods it concerns. Every new reservation's event is staged in the same transaction.
        """
        events = [reservations.reserved_event(r, source=self.source) for r in requests]
        answers: list[Reservation | ReservationError] = []
        try:
            async with self._begin() as conn:
                answers.extend(await batch_reserve.reserve_fast(conn, events))
                await outbox.stage(conn, self.prefix, *events)
        except batch_reserve.Irregular:
            answers = []
            async with self._begin() as conn:
                await locks.lock_for_reservations(conn, events)  # quotas, then GPUs, then each pod's allocation
                for event in events:  # in arrival order: the pod kube-scheduler placed first gets the room first
                    try:
                        async with conn.begin_nested():
                            result = await reservations.reserve(conn, event)
                            if result.created:
                                await outbox.stage(conn, self.prefix, event)
                    except ReservationError as exc:
                        answers.append(exc)
                    else:
                        answers.append(result)
        if any(isinstance(a, Reservation) and a.created for a in answers):
            self._committed()
        return answers

    async def reserve_claim(self, event: ClaimReservedEvent) -> Reservation:
        """Record a DRA claim's allocation (`claims.reserve_claim`), or return it when recorded before.

        Raises `InsufficientCapacity` / `QuotaExceeded` / `claims.PathConflict` / `ReservationError` (nothing is
        written then). The event is staged only when the allocation is new.
        """
        async with self._begin() as conn:
            result = await claims.reserve_claim(conn, event)
            if result.created:
                await outbox.stage(conn, self.prefix, event)
        if result.created:
            self._committed()
        return result

    async def mark_bound(self, allocation_id: uuid.UUID, pod_uid: str, node: str) -> bool:
        """The pod's Binding exists."""
        (changed,) = await self.mark_bound_many([(allocation_id, pod_uid, node)])
        return changed

    async def mark_bound_many(
        self, bindings: list[tuple[uuid.UUID, str, str]], *, at: list[datetime] | None = None
    ) -> list[bool]:
        """`mark_bound` for many (allocation id, pod UID, node) in one transaction (the binder's group commit);
        True per allocation that moved to `bound`. `at`: when each pod was seen bound (default: now). Only the events
        that wrote something are staged: a `bound` that changed nothing (two replicas, or reconciliation and a
        redelivery, binding the same reservation) would reach the stream twice."""
        events = [BoundEvent(allocation_id=a, pod_uid=p, node=n, source=self.source) for a, p, n in bindings]
        if at is not None:
            events = [e.model_copy(update={"occurred_at": when}) for e, when in zip(events, at, strict=True)]
        async with self._begin() as conn:
            changed, wrote = await transitions.bind_many(conn, events)
            written = [e for e, w in zip(events, wrote, strict=True) if w]
            if written:
                await outbox.stage(conn, self.prefix, *written)
        self._committed()
        return changed

    async def mark_failed(self, allocation_id: uuid.UUID, pod_uid: str, node: str, reason: str) -> bool:
        """Binding failed: give the capacity back."""
        return await self._record_ending(
            FailedEvent(allocation_id=allocation_id, pod_uid=pod_uid, node=node, reason=reason, source=self.source)
        )

    async def _record_ending(self, event: ReleasedEvent | FailedEvent) -> bool:
        """Apply an ending event and stage it, in one transaction, unless it wrote nothing: two watchers that both
        saw the allocation live (the pod's and its claim's, a pass of reconciliation) end it once, and the second
        one's copy, a no-op for the ledger and for a replay, is not sent to every consumer."""
        async with self._begin() as conn:
            done = await transitions.transition(conn, event)
            if done.wrote:
                await outbox.stage(conn, self.prefix, event)
        if done.wrote:
            self._committed()
        return done.changed

    async def mark_assigned(
        self, allocation_id: uuid.UUID, pod_uid: str, node: str, container: str, gpu_uuids: list[str]
    ) -> bool:
        """A container received its GPU(s) from the node agent."""
        return bool(
            await self.record(
                AssignedEvent(
                    allocation_id=allocation_id,
                    pod_uid=pod_uid,
                    node=node,
                    container=container,
                    gpu_uuids=gpu_uuids,
                    source=self.source,
                )
            )
        )

    async def mark_assigned_many(self, events: list[AssignedEvent]) -> list[str | None]:
        """The node agents' `assigned` commands of a group commit, in one transaction (`transitions.assign_many`):
        None per applied event, else why it was refused. Every applied event is staged, once per event id (one
        sent again while its first copy waits in the outbox is not staged twice)."""
        async with self._begin() as conn:
            answers = await transitions.assign_many(conn, events)
            await outbox.stage_new(conn, self.prefix, [e for e, a in zip(events, answers, strict=True) if a is None])
        self._committed()
        return answers

    async def end_allocation(
        self, allocation_id: uuid.UUID, pod_uid: str, node: str, reason: str
    ) -> AllocationState | None:
        """End an allocation from whichever live state it is in, with no read before
        (`transitions.end_allocation`): failed while it is still reserved (its pod never bound), released otherwise;
        one transaction, and the event that applied is staged when it wrote something. Returns the state it ended
        in, None when it had ended already (or is unknown)."""
        failed = FailedEvent(allocation_id=allocation_id, pod_uid=pod_uid, node=node, reason=reason, source=self.source)
        released = ReleasedEvent(
            allocation_id=allocation_id, pod_uid=pod_uid, node=node, reason=reason, source=self.source
        )
        async with self._begin() as conn:
            done, event = await transitions.end_allocation(conn, failed, released)
            if done.wrote:
                await outbox.stage(conn, self.prefix, event)
        if done.wrote:
            self._committed()
        return AllocationState(event.kind) if done.changed else None

    async def release(self, allocation_id: uuid.UUID, pod_uid: str, node: str, reason: str) -> bool:
        """End an allocation and give its capacity back (no-op, and no event, if already ended)."""
        return await self._record_ending(
            ReleasedEvent(allocation_id=allocation_id, pod_uid=pod_uid, node=node, reason=reason, source=self.source)
        )

    async def exchange(
        self,
        node: str,
        first: tuple[uuid.UUID, str],
        second: tuple[uuid.UUID, str],
    ) -> bool:
        """Swap two containers' equal-sized shares (allocation id, container name each).

        Raises `rules.ExchangeRefused` (and writes nothing) when the shares differ or a container would
        exchange with itself.
        """
        return bool(
            await self.record(
                ExchangedEvent(
                    node=node,
                    first_allocation_id=first[0],
                    first_container=first[1],
                    second_allocation_id=second[0],
                    second_container=second[1],
                    source=self.source,
                )
            )
        )

    async def release_pod(self, pod_uid: str, reason: str) -> int:
        """Release every live allocation of a pod; returns how many ended."""
        async with reading(self.engine) as conn:
            rows = await transitions.live_allocation_ids(conn, pod_uid=pod_uid)
        return sum([await self.release(r.id, r.pod_uid, r.node, reason) for r in rows])

    async def mark_terminating(self, pod_uid: str) -> int:
        """Record that a pod began terminating; its shares stay held. Returns how many allocations were marked.

        A pod marked before is not marked again (no event), so repeated pod updates cost one read.
        """
        async with reading(self.engine) as conn:
            rows = await transitions.live_allocation_ids(conn, pod_uid=pod_uid)
        events = [
            TerminatingEvent(allocation_id=r.id, pod_uid=r.pod_uid, node=r.node, source=self.source)
            for r in rows
            if r.terminating_at is None
        ]
        return sum([bool(await self.record(event)) for event in events])

    async def retire_node(self, node: str, reason: str = "node deleted") -> int:
        """Release a node's allocations and retire its GPUs; returns how many allocations ended."""
        async with reading(self.engine) as conn:
            rows = await transitions.live_allocation_ids(conn, node=node)
        released = sum([await self.release(r.id, r.pod_uid, r.node, reason) for r in rows])
        await self.record(NodeRetiredEvent(node=node, source=self.source))
        return released
