"""Planning a batch of events for the read models: pure functions, no I/O.

`projections.apply_many` claims a batch's event ids in one statement, reads what the batch's events ask of
the read models (`reads`, then one query per question), and hands both to `plan`, which folds the events in
order over what was read, exactly as applying them one by one would, and returns the rows to write: one
multi-row statement per table. Order within the batch is kept where it matters:

- reads see the rows planned for earlier events of the batch (a bound event's latency finds a reservation
  of the same batch; a refusal is ignored when an earlier event of the batch reserved the pod at or after it);
- `acc_pending` takes a pod's refusals (upserts that keep the latest) and reservations (deletes of older
  refusals) as one net effect per pod, `Pending`: delete the pod's row when it is at most `delete_upto` old,
  then upsert `row` where the stored row is not newer, which is what the sequence does from any stored row.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any

from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    ClaimReservedEvent,
    Event,
    ExchangedEvent,
    FailedEvent,
    RefusedEvent,
    ReleasedEvent,
    ReservedEvent,
    TerminatingEvent,
    UsageEvent,
)
from shared.ledger.rules import AllocationState

PROJECTED = (
    ReservedEvent,
    BoundEvent,
    AssignedEvent,
    ExchangedEvent,
    TerminatingEvent,
    ReleasedEvent,
    FailedEvent,
    UsageEvent,
    RefusedEvent,
)  # the events that change the read models
RESERVED = AllocationState.RESERVED.value
BOUND = AllocationState.BOUND.value
ASSIGNED = AllocationState.ASSIGNED.value
DETAIL_MAX = 2048
TERMINATING_DETAIL = "pod is being deleted; its share stays held until the pod is gone"

Row = dict[str, Any]


def step_name(event: Event) -> str:
    """The timeline step an event is: its kind, except that every reservation is `reserved` (a DRA claim's
    allocation recorded at the gate, `claim_reserved`, is the same step of the allocation's life)."""
    return RESERVED if isinstance(event, ReservedEvent) else event.kind


def reserved_detail(event: ReservedEvent) -> str:
    """The timeline detail of a reservation: the claim it came from, for a DRA allocation."""
    return f"claim {event.claim_name}" if isinstance(event, ClaimReservedEvent) else ""


@dataclass
class Applied:
    """What applying one event did: whether it was new, and life-cycle latencies it completed."""

    new: bool
    latencies: list[tuple[str, float]] = field(default_factory=list)


@dataclass(frozen=True)
class Reads:
    """What a batch asks of the read models before it is applied (each list without repeats, in order)."""

    step_allocations: list[uuid.UUID]  # first reserved / bound / assigned steps (latencies)
    pod_allocations: list[uuid.UUID]  # the pod of an allocation (exchanges)
    refused_pods: list[str]  # the latest reservation of a pod (refusals)
    usage_ids: list[uuid.UUID]  # whether a usage event's samples are stored


@dataclass(frozen=True)
class Known:
    """What the read models held before the batch, for the questions of `Reads`."""

    first_steps: Mapping[tuple[uuid.UUID, str], datetime] = field(default_factory=dict)  # earliest ts of a step
    earliest: Mapping[uuid.UUID, tuple[datetime, str]] = field(default_factory=dict)  # (ts, pod) of first step
    latest_reservation: Mapping[str, datetime] = field(default_factory=dict)  # per pod
    stored_usage: frozenset[uuid.UUID] = frozenset()


@dataclass
class Pending:
    """A batch's net effect on one pod's `acc_pending` row: delete it when refused at or before
    `delete_upto`, then upsert `row` unless the stored row is newer."""

    delete_upto: datetime | None = None
    row: Row | None = None

    def delete(self, upto: datetime) -> None:
        """A reservation: drop refusals up to `upto` (the pod's row, and the batch's own when old enough)."""
        if self.row is not None and self.row["refused_at"] > upto:
            return  # the batch's refusal is newer, and so is any stored row it did not replace
        self.row = None
        self.delete_upto = upto if self.delete_upto is None else max(self.delete_upto, upto)

    def upsert(self, row: Row) -> None:
        """A refusal: it replaces what is there unless that is newer."""
        if self.row is None or row["refused_at"] >= self.row["refused_at"]:
            self.row = row


@dataclass
class Plan:
    """The rows one batch writes, and what each event did (aligned with the batch)."""

    results: list[Applied]
    timeline_rows: list[Row]
    sample_rows: list[Row]
    pending: dict[str, Pending]

    @property
    def pending_deletes(self) -> list[tuple[str, datetime]]:
        """(pod, refused at or before) per pod whose row goes."""
        return [(pod, p.delete_upto) for pod, p in self.pending.items() if p.delete_upto is not None]

    @property
    def pending_rows(self) -> list[Row]:
        """The refusals to upsert, one per pod."""
        return [p.row for p in self.pending.values() if p.row is not None]


def claims(events: Iterable[Event]) -> list[uuid.UUID]:
    """The event ids to claim: every projected event but usage (whose samples carry their id), once each."""
    return list(dict.fromkeys(e.event_id for e in events if isinstance(e, PROJECTED) and not isinstance(e, UsageEvent)))


def _fresh(events: Iterable[Event], claimed: set[uuid.UUID]) -> list[Event]:
    """The events a batch may apply: usage events with samples, and claimed events (first copies)."""
    seen: set[uuid.UUID] = set()
    out: list[Event] = []
    for e in events:
        if isinstance(e, UsageEvent):
            if e.samples:
                out.append(e)
        elif isinstance(e, PROJECTED) and e.event_id in claimed and e.event_id not in seen:
            seen.add(e.event_id)
            out.append(e)
    return out


def reads(events: Iterable[Event], claimed: set[uuid.UUID]) -> Reads:
    """What `plan` needs to know from the read models to apply the claimed events of a batch."""
    steps: dict[uuid.UUID, None] = {}
    pods: dict[uuid.UUID, None] = {}
    refused: dict[str, None] = {}
    usage: dict[uuid.UUID, None] = {}
    for e in _fresh(events, claimed):
        match e:
            case BoundEvent() | AssignedEvent():
                steps[e.allocation_id] = None
            case ExchangedEvent():
                pods[e.first_allocation_id] = None
                pods[e.second_allocation_id] = None
            case RefusedEvent():
                refused[e.pod_uid] = None
            case UsageEvent():
                usage[e.event_id] = None
    return Reads(list(steps), list(pods), list(refused), list(usage))


class _Batch:
    """The fold of a batch: the read models as they stood, plus the rows planned so far."""

    def __init__(self, known: Known) -> None:
        self.first = dict(known.first_steps)
        self.earliest = dict(known.earliest)
        self.latest_reservation = dict(known.latest_reservation)
        self.stored_usage = set(known.stored_usage)
        self.timeline_rows: list[Row] = []
        self.planned: set[tuple[uuid.UUID, uuid.UUID]] = set()
        self.sample_rows: list[Row] = []
        self.pending: dict[str, Pending] = {}

    def step(self, event: Event, allocation_id: uuid.UUID, pod_uid: str, node: str, detail: str = "") -> None:
        """A timeline row (the step is the event's kind); one per event and allocation, like the unique key."""
        ts = event.occurred_at
        step = step_name(event)
        key = (allocation_id, step)
        if key not in self.first or ts < self.first[key]:
            self.first[key] = ts
        if allocation_id not in self.earliest or ts < self.earliest[allocation_id][0]:
            self.earliest[allocation_id] = (ts, pod_uid)
        if step == RESERVED:
            latest = self.latest_reservation.get(pod_uid)
            self.latest_reservation[pod_uid] = ts if latest is None else max(latest, ts)
        if (event.event_id, allocation_id) in self.planned:
            return
        self.planned.add((event.event_id, allocation_id))
        self.timeline_rows.append(
            {
                "event_id": event.event_id,
                "allocation_id": allocation_id,
                "pod_uid": pod_uid,
                "node": node,
                "step": step,
                "ts": ts,
                "detail": detail[:DETAIL_MAX],
            }
        )

    def pending_of(self, pod_uid: str) -> Pending:
        return self.pending.setdefault(pod_uid, Pending())

    def usage(self, event: UsageEvent) -> bool:
        """Store a usage event's samples unless they are stored already; True when stored."""
        if not event.samples or event.event_id in self.stored_usage:
            return False
        self.stored_usage.add(event.event_id)
        self.sample_rows += [
            {
                "event_id": event.event_id,
                "ts": event.occurred_at,
                "node": event.node,
                "gpu_uuid": s.gpu_uuid,
                "pod_uid": s.pod_uid,
                "namespace": s.namespace,
                "pod_name": s.pod_name,
                "container": s.container,
                "used_memory_mib": s.used_memory_mib,
                "utilization_pct": s.utilization_pct,
                "sm_utilization_pct": s.sm_utilization_pct,
            }
            for s in event.samples
        ]
        return True

    def apply(self, event: Event) -> Applied:
        """One claimed (new) event's effects, in the batch's order."""
        out = Applied(new=True)
        match event:
            case ReservedEvent():
                self.step(event, event.allocation_id, event.pod_uid, event.node, reserved_detail(event))
                self.pending_of(event.pod_uid).delete(event.occurred_at)
            case BoundEvent():
                self.step(event, event.allocation_id, event.pod_uid, event.node)
                reserved = self.first.get((event.allocation_id, RESERVED))
                if reserved is not None:
                    out.latencies.append(("reserved_to_bound", (event.occurred_at - reserved).total_seconds()))
            case AssignedEvent():
                first = self.first.get((event.allocation_id, event.kind))
                detail = f"container {event.container}: {', '.join(event.gpu_uuids)}"
                self.step(event, event.allocation_id, event.pod_uid, event.node, detail)
                bound = self.first.get((event.allocation_id, BOUND))
                if first is None and bound is not None:
                    out.latencies.append(("bound_to_assigned", (event.occurred_at - bound).total_seconds()))
            case TerminatingEvent():
                self.step(event, event.allocation_id, event.pod_uid, event.node, TERMINATING_DETAIL)
            case ReleasedEvent() | FailedEvent():
                self.step(event, event.allocation_id, event.pod_uid, event.node, event.reason)
            case ExchangedEvent():
                pairs = (
                    (
                        event.first_allocation_id,
                        event.first_container,
                        event.second_allocation_id,
                        event.second_container,
                    ),
                    (
                        event.second_allocation_id,
                        event.second_container,
                        event.first_allocation_id,
                        event.first_container,
                    ),
                )
                for mine, my_container, other, other_container in pairs:
                    pod_uid = self.earliest[mine][1] if mine in self.earliest else ""
                    detail = (
                        f"container {my_container} swapped shares with allocation {other} container {other_container}"
                    )
                    self.step(event, mine, pod_uid, event.node, detail)
            case RefusedEvent():
                later = self.latest_reservation.get(event.pod_uid)
                if later is None or later < event.occurred_at:
                    self.pending_of(event.pod_uid).upsert(
                        {
                            "pod_uid": event.pod_uid,
                            "event_id": event.event_id,
                            "namespace": event.namespace,
                            "pod_name": event.pod_name,
                            "summary": event.summary,
                            "reasons": dict(event.reasons),
                            "refused_at": event.occurred_at,
                        }
                    )
        return out


def plan(events: list[Event], claimed: set[uuid.UUID], known: Known) -> Plan:
    """Fold a batch over what the read models held (`known`), in order, as one-by-one application would:
    claimed events (first copies) and usage events whose samples are not stored change something, every
    other event nothing. Returns the rows to write and, per event, what it did."""
    batch = _Batch(known)
    seen: set[uuid.UUID] = set()
    results = []
    for event in events:
        if isinstance(event, UsageEvent):
            results.append(Applied(new=batch.usage(event)))
        elif isinstance(event, PROJECTED) and event.event_id in claimed and event.event_id not in seen:
            seen.add(event.event_id)
            results.append(batch.apply(event))
        else:
            results.append(Applied(new=False))
    return Plan(results, batch.timeline_rows, batch.sample_rows, batch.pending)
