"""The bind verb: pick GPUs on the chosen node, reserve them in the ledger, wait for the binder's verdict."""

from __future__ import annotations

import uuid
from dataclasses import dataclass

from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender import metrics
from services.extender.outcomes import OutcomeWaiter
from services.extender.pods import PodCache, PodUnavailable
from services.extender.resync import ViewSync
from services.extender.view import DRA_NODE, NO_INVENTORY, ClusterView
from services.extender.wire import BindingArgs
from shared.ledger.db import LedgerUnavailable, reading, retry_transient
from shared.ledger.group_commit import GroupCommit
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import (
    InsufficientCapacity,
    QuotaExceeded,
    Reservation,
    ReservationError,
    ReservationRequest,
    live_reservation,
)
from shared.placement import DemandError, NoFit, PodDemand, Policy, parse_pod, pick
from shared.settings import MemoryUnit

ATTEMPTS = 3  # picks from the view; a conflict in the ledger reloads the view before the next
LEDGER_BUDGET_S = 5.0  # how long a bind rides out a database that refuses or drops connections


@dataclass(frozen=True)
class Reserved:
    """The pod holds this reservation; `fresh` when this call created it (no outcome can be known yet)."""

    reservation: Reservation
    fresh: bool = False


@dataclass(frozen=True)
class Refused:
    """No reservation: the answer for kube-scheduler, and the `binds_total` reason."""

    outcome: str
    error: str


@dataclass
class Bind:
    """Answers bind calls: the reservation is authoritative, the view only steers the pick."""

    view: ClusterView
    sync: ViewSync
    ledger: Ledger
    engine: AsyncEngine
    waiter: OutcomeWaiter
    pods: PodCache
    unit: MemoryUnit
    policy: Policy
    timeout_s: float  # how long to wait for the binder's verdict

    def __post_init__(self) -> None:
        # binds that arrive while a reservation transaction is in flight are reserved together in the next one
        self.reservations: GroupCommit[ReservationRequest, Reservation] = GroupCommit(
            self.ledger.reserve_many, what="reserve"
        )

    async def __call__(self, args: BindingArgs) -> str:
        """Reserve, wait for the binder, and return "" (bound) or the error text for kube-scheduler."""
        try:
            demand = parse_pod(await self.pods.spec(args), self.unit)
        except PodUnavailable as exc:
            return _refused(Refused("unknown_pod", str(exc)))
        except DemandError as exc:
            return _refused(Refused("invalid", f"invalid GPU request: {exc}"))
        if demand.gated:
            return _refused(Refused("gated", demand.gated_reason()))
        if not demand.wants_gpu:
            return _refused(
                Refused(
                    "invalid",
                    f"pod {args.pod_namespace}/{args.pod_name} asks for no GPU share; gpushare binds only GPU pods",
                )
            )
        try:
            got = await self.reserve(args, demand)
        except LedgerUnavailable as exc:  # a short reason for kube-scheduler; the driver's text stays in the log
            return _refused(Refused("ledger_unavailable", f"{exc}; kube-scheduler will retry the pod"))
        if isinstance(got, Refused):
            return _refused(got)
        reservation = got.reservation
        # the view holds what the ledger holds, whatever this bind picked (`reserve` took its hold out)
        self.view.add_reservation(
            reservation.allocation_id,
            args.pod_uid,
            args.pod_namespace,
            args.pod_name,
            reservation.node,
            reservation.parts,
            reservation.state.value,
        )
        if reservation.node != args.node:
            return _refused(
                Refused("failed", f"pod already holds a reservation on node {reservation.node}, not {args.node}")
            )
        return await self._outcome(reservation.allocation_id, args, fresh=got.fresh)

    async def reserve(self, args: BindingArgs, demand: PodDemand) -> Reserved | Refused:
        """The pod's reservation on `args.node`, made now or found (a retried bind), or why there is none.

        No read first: `reserve` returns the pod's live reservation when it already has one, so the common
        case costs one transaction. Only when the pod no longer fits (its own reservation may be what fills
        the node) is the ledger asked before the view is reloaded and the pick retried.
        """
        last_error = ""
        for attempt in range(ATTEMPTS):
            first = attempt == 0
            node = self.view.nodes.get(args.node)
            if node is None and first:
                if (found := await self._existing(args.pod_uid)) is not None:
                    return Reserved(found)
                await self.sync.resync("unknown_node", settle=False)
                node = self.view.nodes.get(args.node)
            if node is None:
                return Refused("no_fit", f"node {args.node}: {NO_INVENTORY}")
            if args.node in self.view.dra_nodes:
                return Refused("no_fit", f"node {args.node}: {DRA_NODE}")
            try:
                placement = pick(node, demand, self.policy)
            except NoFit as exc:
                last_error = exc.reason
                if first:
                    if (found := await self._existing(args.pod_uid)) is not None:
                        return Reserved(found)
                    if exc.resolvable:
                        await self.sync.resync("bind_no_fit", settle=False)
                        continue
                break
            request = ReservationRequest(
                pod_uid=args.pod_uid,
                namespace=args.pod_namespace,
                pod_name=args.pod_name,
                node=args.node,
                parts=placement.parts,
                owner_kind=demand.owner_kind,
                owner_name=demand.owner_name,
                pod_created_at=demand.created_at,
            )
            # Hold the shares in the view while the ledger decides, as kube-scheduler assumes a pod: concurrent
            # binds then pick around each other instead of racing for the same GPU and reloading on conflict.
            self.view.hold(
                request.allocation_id, args.pod_uid, args.pod_namespace, args.pod_name, args.node, placement.parts
            )
            try:
                reservation = await retry_transient(
                    lambda request=request: self.reservations.submit(request),  # type: ignore[misc]
                    budget_s=LEDGER_BUDGET_S,
                    what="reserve",
                )
            except BaseException as exc:
                self.view.release_hold(request.allocation_id)  # refused, or no answer: the hold goes
                if isinstance(exc, QuotaExceeded):
                    return Refused("quota", str(exc))
                if not isinstance(exc, ReservationError):
                    raise
                last_error = str(exc)
                if isinstance(exc, InsufficientCapacity):  # another replica took it, or the view missed an event
                    await self.sync.resync("conflict", settle=False)
                continue
            if reservation.allocation_id != request.allocation_id:  # the pod's reservation made before: not the hold
                self.view.release_hold(request.allocation_id)
            return Reserved(reservation, fresh=reservation.created)
        # a concurrent bind for the same pod (another replica) may have reserved meanwhile
        if (found := await self._existing(args.pod_uid)) is not None:
            return Reserved(found)
        return Refused("no_fit", f"could not reserve GPUs on {args.node}: {last_error}")

    async def _existing(self, pod_uid: str) -> Reservation | None:
        async def read() -> Reservation | None:
            async with reading(self.engine) as conn:
                return await live_reservation(conn, pod_uid)

        return await retry_transient(read, budget_s=LEDGER_BUDGET_S, what="read the pod's reservation")

    async def _outcome(self, allocation_id: uuid.UUID, args: BindingArgs, *, fresh: bool) -> str:
        outcome = await self.waiter.wait(allocation_id, self.timeout_s, check_first=not fresh)
        if outcome is None:
            # The binder owns the reservation's outcome: it may be creating the Binding right now, so
            # releasing here could leave a bound pod without an allocation. Keep the reservation; the
            # binder binds it (kube-scheduler then sees the pod bound) or fails it, and its reconciliation
            # releases reservations whose pods are gone.
            metrics.BIND_OUTCOMES.labels(reason="timeout").inc()
            return (
                f"the binder has not bound the pod within {self.timeout_s:g}s; the reservation on "
                f"{args.node} is kept and the binder will bind or release it"
            )
        if outcome.bound:
            metrics.BIND_OUTCOMES.labels(reason="bound").inc()
            return ""
        metrics.BIND_OUTCOMES.labels(reason="failed").inc()
        return f"binding failed ({outcome.state}): {outcome.reason or 'no reason given'}"


def _refused(refused: Refused) -> str:
    metrics.BIND_OUTCOMES.labels(reason=refused.outcome).inc()
    return refused.error
