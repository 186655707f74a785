"""The extender's decisions: filter, prioritize, bind, preempt, inspect, over the view and the ledger."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import logging
import time
from collections import OrderedDict
from typing import Any

from nats.aio.msg import Msg
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender import metrics
from services.extender.outcomes import BOUND, OutcomeWaiter
from services.extender.scores import NodeScores, ScoreCache
from services.extender.view import ClusterView
from services.extender.wire import BindingArgs, ExtenderArgs, PreemptionArgs, filter_result
from shared.events.bus import EventBus
from shared.events.catalogue import (
    AssignedEvent,
    BoundEvent,
    EventDecodeError,
    FailedEvent,
    RefusedEvent,
    ReleasedEvent,
    decode_event,
)
from shared.ledger.ledger import Ledger
from shared.ledger.reservations import (
    InsufficientCapacity,
    QuotaExceeded,
    Reservation,
    ReservationError,
    ReservationRequest,
    live_reservation,
)
from shared.placement import (
    DemandError,
    NoFit,
    PodDemand,
    Policy,
    Victim,
    filter_nodes,
    parse_pod,
    pick,
    quota_refusal,
    select_victims,
)
from shared.placement.columns import columns_apply, score_list, split_fitting
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

REFUSAL_THROTTLE_S = 10.0
NO_INVENTORY = "node has no gpushare inventory (no node agent reported GPUs)"


def settle_gc() -> None:
    """After a reload: one full collection, then keep the surviving objects (mostly the view) out of later ones.

    The view holds hundreds of thousands of long-lived objects; left in the oldest generation, every full
    collection walks them all (~200 ms on a loaded 2-core machine at 5,000 nodes, landing on random
    requests). Frozen, they are skipped; they are still freed by reference counting when the next reload
    replaces them (the view has no reference cycles), and unfreezing first lets each reload's collection
    see everything again, so no cyclic garbage stays frozen for longer than one resync period.
    """
    gc.unfreeze()
    gc.collect()
    gc.freeze()


class PodUnavailable(Exception):
    """The pod spec could not be found (not seen by filter, and the Kubernetes API cannot tell)."""


class ExtenderService:
    """Everything behind the HTTP routes; start() loads the view and subscribes to the bus."""

    def __init__(
        self,
        *,
        engine: AsyncEngine,
        ledger: Ledger,
        bus: EventBus | None,
        unit: MemoryUnit = MemoryUnit.GIB,
        policy: Policy = Policy.BINPACK,
        bind_timeout_s: float = 20.0,
        resync_s: float = 30.0,
        kubeconfig: str | None = None,
        kube_enabled: bool = True,
        pod_cache_size: int = 10_000,
        poll_s: float = 1.0,
    ) -> None:
        self.engine = engine
        self.ledger = ledger
        self.bus = bus
        self.unit = unit
        self.policy = policy
        self.bind_timeout_s = bind_timeout_s
        self.resync_s = resync_s
        self.kubeconfig = kubeconfig
        self.kube_enabled = kube_enabled
        self.view = ClusterView()
        self.scores = ScoreCache()
        self.waiter = OutcomeWaiter(engine, poll_s=poll_s)
        self._pods: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._pod_cache_size = pod_cache_size
        self._refused_at: OrderedDict[str, float] = OrderedDict()
        self._sub: Any = None
        self._tasks: list[asyncio.Task[Any]] = []
        self._resync_lock = asyncio.Lock()
        self._kube: Any = None
        self._loaded_at = -1.0

    # ---- life cycle ----------------------------------------------------------------------------
    async def start(self) -> None:
        """Subscribe to ledger events, load the view, and start the periodic resync."""
        if self.bus is not None:
            self._sub = await self.bus.nc.subscribe(f"{self.bus.names.prefix}.>", cb=self._on_message)
        await self.resync("start")
        self._tasks.append(asyncio.create_task(self._resync_loop()))

    async def close(self) -> None:
        """Stop background work (the caller owns the engine and the bus)."""
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._sub is not None:
            with contextlib.suppress(Exception):
                await self._sub.unsubscribe()
        if self._kube is not None:
            with contextlib.suppress(Exception):
                await self._kube.close()

    @property
    def ready(self) -> bool:
        """Ready once the view has been loaded."""
        return self.view.loaded

    async def resync(self, reason: str, *, settle: bool = True) -> None:
        """Reload the view from the ledger. Concurrent callers share one reload: a reload that started
        after a caller asked already contains every commit the caller could have seen. `settle=False`
        skips the full garbage collection (for reloads on the bind path; the periodic one settles)."""
        asked = time.monotonic()
        async with self._resync_lock:
            if self._loaded_at >= asked:
                return
            started = time.monotonic()
            await self.view.reload(self.engine)
            self._loaded_at = started
            if settle:
                settle_gc()
        metrics.RESYNCS.labels(reason=reason).inc()

    async def _resync_loop(self) -> None:
        while True:
            await asyncio.sleep(self.resync_s)
            try:
                await self.resync("periodic")
            except Exception as exc:  # the database may be briefly away; keep the old view
                log.warning("periodic resync failed: %s", exc)

    async def _on_message(self, msg: Msg) -> None:
        try:
            event = decode_event(msg.data)
        except EventDecodeError as exc:
            log.debug("ignored an unreadable event on %s: %s", msg.subject, exc)
            return
        self.view.apply(event)
        if isinstance(event, BoundEvent):
            self.waiter.notify(event.allocation_id, BOUND)
        elif isinstance(event, FailedEvent | ReleasedEvent | AssignedEvent):
            self.waiter.notify(event.allocation_id)

    # ---- pods ----------------------------------------------------------------------------------
    def remember(self, pod: dict[str, Any]) -> None:
        """Keep a pod spec by UID for bind (bounded LRU)."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        self._pods[uid] = pod
        self._pods.move_to_end(uid)
        while len(self._pods) > self._pod_cache_size:
            self._pods.popitem(last=False)

    async def pod_spec(self, args: BindingArgs) -> dict[str, Any]:
        """The pod filter saw, or the pod read from the Kubernetes API."""
        pod = self._pods.get(args.pod_uid)
        if pod is not None:
            return pod
        if not self.kube_enabled:
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} ({args.pod_uid}) was not seen by this replica's filter "
                "and the Kubernetes API is not configured"
            )
        try:
            from kubernetes_asyncio import client

            from shared.kube.client import api_client

            if self._kube is None:
                self._kube = await api_client(self.kubeconfig)
            found = await client.CoreV1Api(self._kube).read_namespaced_pod(args.pod_name, args.pod_namespace)
            pod = self._kube.sanitize_for_serialization(found)
        except Exception as exc:
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} was not seen by this replica's filter and could not be "
                f"read from the Kubernetes API: {exc}"
            ) from None
        if (pod.get("metadata") or {}).get("uid") != args.pod_uid:
            raise PodUnavailable(f"pod {args.pod_namespace}/{args.pod_name} now has another UID (it was recreated)")
        self.remember(pod)
        return pod

    def demand(self, pod: dict[str, Any]) -> PodDemand:
        """The pod's GPU demand (raises DemandError)."""
        return parse_pod(pod, self.unit)

    # ---- filter / prioritize -------------------------------------------------------------------
    async def filter(self, args: ExtenderArgs) -> dict[str, Any]:
        """Answer a filter call."""
        self.remember(args.pod)
        try:
            demand = self.demand(args.pod)
        except DemandError as exc:
            metrics.REFUSALS.labels(reason="invalid_request").inc()
            return filter_result(args, [], {}, {}, error=f"invalid GPU request: {exc}")
        if demand.gated:  # kube-scheduler does not send gated pods; whoever did gets no place and no refusal
            return filter_result(args, [], {}, {}, error=demand.gated_reason())
        if not demand.wants_gpu:
            return filter_result(args, list(args.node_names), {}, {})
        passed: list[str] = []
        failed: dict[str, str] = {}
        never: dict[str, str] = {}
        quota = self.view.quotas.get(demand.namespace)
        over = quota_refusal(demand, self.view.namespace_usage(demand.namespace), quota) if quota else None
        if over is not None:
            failed = {name: over for name in args.node_names}
            metrics.NODE_DECISIONS.labels(reason="quota").inc(len(failed))
        else:
            filtered = self._filter_by_columns if columns_apply(demand) else self._filter_by_nodes
            passed, failed, never = filtered(args.node_names, demand)
            metrics.NODE_DECISIONS.labels(reason="fits").inc(len(passed))
            metrics.NODE_DECISIONS.labels(reason="full").inc(len(failed))
            metrics.NODE_DECISIONS.labels(reason="never_fits").inc(len(never))
        if not passed:
            reason = "quota" if over else ("full" if failed else "never_fits")
            metrics.REFUSALS.labels(reason=reason).inc()
            await self._refused(demand, over, {**never, **failed})
        return filter_result(args, passed, failed, never)

    def _filter_by_nodes(self, names: list[str], demand: PodDemand) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """(fit, full now, never fit) by the placement core, node by node; keeps the scores for prioritize."""
        nodes, version = self.view.nodes, self.view.version
        never: dict[str, str] = {}
        if all(map(nodes.__contains__, names)):  # C-speed check (`None in` would call NodeView.__eq__)
            known = list(map(nodes.__getitem__, names))
        else:
            known = []
            for name in names:
                node = nodes.get(name)
                if node is None:
                    never[name] = NO_INVENTORY
                else:
                    known.append(node)
        passed, failed, found_never = filter_nodes(known, demand, self.policy)
        never.update(found_never)
        if len(passed) > 1:  # kube-scheduler prioritizes only when more than one node is left
            scores = NodeScores(passed, score_list(self.view.columns, nodes, passed, demand, self.policy))
            self.scores.put(demand, version, self.policy, scores)
        return passed, failed, never

    def _filter_by_columns(
        self, names: list[str], demand: PodDemand
    ) -> tuple[list[str], dict[str, str], dict[str, str]]:
        """`_filter_by_nodes` for a one-GPU, memory-only pod, from the view's columns (same answers, C-level loops)."""
        view, version = self.view, self.view.version
        passed, rest = split_fitting(view.columns, names, demand.containers[0].memory_mib)
        failed: dict[str, str] = {}
        never: dict[str, str] = {}
        if rest:  # explained node by node (there are usually few)
            passed_too, failed, never = self._filter_by_nodes(rest, demand)
            if passed_too:  # cannot happen (same rule); the placement core is the authority
                log.warning("node columns were stale for %d node(s), e.g. %s", len(passed_too), passed_too[0])
                passed = [*passed, *passed_too]
        if len(passed) > 1:
            scores = NodeScores(passed, score_list(view.columns, view.nodes, passed, demand, self.policy))
            self.scores.put(demand, version, self.policy, scores)
        return passed, failed, never

    async def _refused(self, demand: PodDemand, quota_reason: str | None, reasons: dict[str, str]) -> None:
        if self.bus is None or not demand.uid:
            return
        now = time.monotonic()
        last = self._refused_at.get(demand.uid)
        if last is not None and now - last < REFUSAL_THROTTLE_S:
            return
        self._refused_at[demand.uid] = now
        self._refused_at.move_to_end(demand.uid)
        while len(self._refused_at) > self._pod_cache_size:
            self._refused_at.popitem(last=False)
        if quota_reason:
            summary = quota_reason
        elif not reasons:
            summary = "no candidate node was offered"
        else:
            summary = f"no node can hold the pod's GPU request ({len(reasons)} node(s) refused)"
        short = {k[:253]: v[:2048] for k, v in list(sorted(reasons.items()))[:256]}
        try:
            event = RefusedEvent(
                pod_uid=demand.uid[:253],
                namespace=demand.namespace[:253],
                pod_name=(demand.name or demand.uid)[:253],
                summary=summary[:2048],
                reasons=short,
                source="extender",
            )
            await self.bus.publish(event)
        except Exception as exc:  # explaining a refusal must never fail the filter call
            log.warning("could not publish a refusal: %s", exc)

    def prioritize(self, args: ExtenderArgs) -> list[tuple[str, int]]:
        """Answer a prioritize call: (host, score) for every node asked about (the wire's [{Host, Score}])."""
        try:
            demand = self.demand(args.pod)
        except DemandError:
            return [(n, 0) for n in args.node_names]
        names = args.node_names
        nodes = self.view.nodes
        cached = self.scores.get(demand, self.view.version, self.policy)
        if cached is None:
            return list(zip(names, score_list(self.view.columns, nodes, names, demand, self.policy), strict=True))
        found = cached.aligned(names)
        if None in found:  # nodes filter did not pass (or did not see) are scored now
            missing = [n for n, s in zip(names, found, strict=True) if s is None]
            more = dict(zip(missing, score_list(self.view.columns, nodes, missing, demand, self.policy), strict=True))
            found = [more[n] if s is None else s for n, s in zip(names, found, strict=True)]
        return list(zip(names, found, strict=True))

    # ---- bind ----------------------------------------------------------------------------------
    async def bind(self, args: BindingArgs) -> str:
        """Reserve, wait for the binder, and return "" (bound) or the error text for kube-scheduler."""
        try:
            pod = await self.pod_spec(args)
            demand = self.demand(pod)
        except PodUnavailable as exc:
            metrics.BIND_OUTCOMES.labels(reason="unknown_pod").inc()
            return str(exc)
        except DemandError as exc:
            metrics.BIND_OUTCOMES.labels(reason="invalid").inc()
            return f"invalid GPU request: {exc}"
        if demand.gated:
            metrics.BIND_OUTCOMES.labels(reason="gated").inc()
            return demand.gated_reason()
        if not demand.wants_gpu:
            metrics.BIND_OUTCOMES.labels(reason="invalid").inc()
            return f"pod {args.pod_namespace}/{args.pod_name} asks for no GPU share; gpushare binds only GPU pods"
        # No read first: `reserve` returns the pod's live reservation when it already has one (a retried bind),
        # so the common case costs one transaction. Only when the pod no longer fits (its own reservation
        # may be what fills the node) is the ledger asked before the view is reloaded.
        reservation: Reservation | None = None
        fresh = False
        last_error = ""
        for attempt in range(3):
            node = self.view.nodes.get(args.node)
            if node is None and attempt == 0:
                reservation = await self._existing(args.pod_uid)
                if reservation is not None:
                    break
                await self.resync("unknown_node", settle=False)
                node = self.view.nodes.get(args.node)
            if node is None:
                metrics.BIND_OUTCOMES.labels(reason="no_fit").inc()
                return f"node {args.node}: {NO_INVENTORY}"
            try:
                placement = pick(node, demand, self.policy)
            except NoFit as exc:
                last_error = exc.reason
                if attempt == 0:
                    reservation = await self._existing(args.pod_uid)
                    if reservation is not None:
                        break
                    if exc.resolvable:
                        await self.resync("bind_no_fit", settle=False)
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
            )
            # Hold the shares in the view while the ledger decides, as kube-scheduler assumes a pod: concurrent
            # binds then pick around each other instead of racing for the same GPU and reloading on conflict.
            self.view.add_reservation(
                request.allocation_id, args.pod_uid, args.pod_namespace, args.pod_name, args.node, placement.parts
            )
            try:
                try:
                    reservation = await self.ledger.reserve(request)
                except BaseException:
                    self.view.drop(args.pod_uid, request.allocation_id)
                    raise
                fresh = reservation.created
                break
            except QuotaExceeded as exc:
                metrics.BIND_OUTCOMES.labels(reason="quota").inc()
                return str(exc)
            except InsufficientCapacity as exc:  # another replica took it, or the view missed an event
                last_error = str(exc)
                await self.resync("conflict", settle=False)
            except ReservationError as exc:
                last_error = str(exc)
        if reservation is None:
            # a concurrent bind for the same pod (another replica) may have reserved meanwhile
            reservation = await self._existing(args.pod_uid)
        if reservation is None:
            metrics.BIND_OUTCOMES.labels(reason="no_fit").inc()
            return f"could not reserve GPUs on {args.node}: {last_error}"
        if reservation.node != args.node:
            metrics.BIND_OUTCOMES.labels(reason="failed").inc()
            return f"pod already holds a reservation on node {reservation.node}, not {args.node}"
        self.view.add_reservation(
            reservation.allocation_id, args.pod_uid, args.pod_namespace, args.pod_name, args.node, reservation.parts
        )
        return await self._outcome(reservation.allocation_id, args, fresh=fresh)

    async def _existing(self, pod_uid: str) -> Reservation | None:
        async with self.engine.connect() as conn:
            return await live_reservation(conn, pod_uid)

    async def _outcome(self, allocation_id: Any, args: BindingArgs, *, fresh: bool = False) -> str:
        outcome = await self.waiter.wait(allocation_id, self.bind_timeout_s, check_first=not fresh)
        if outcome is None:
            # The binder owns the reservation's outcome: it may be creating the Binding right now, so
            # releasing here could leave a bound pod without an allocation. Keep the reservation; the
            # binder binds it (kube-scheduler then sees the pod bound) or fails it, and its reconciliation
            # releases reservations whose pods are gone.
            metrics.BIND_OUTCOMES.labels(reason="timeout").inc()
            return (
                f"the binder has not bound the pod within {self.bind_timeout_s:g}s; the reservation on "
                f"{args.node} is kept and the binder will bind or release it"
            )
        if outcome.bound:
            metrics.BIND_OUTCOMES.labels(reason="bound").inc()
            return ""
        metrics.BIND_OUTCOMES.labels(reason="failed").inc()
        if outcome is None:
            return "binding outcome unknown: the reservation is neither bound nor failed"
        return f"binding failed ({outcome.state}): {outcome.reason or 'no reason given'}"

    # ---- preempt -------------------------------------------------------------------------------
    def preempt(self, args: PreemptionArgs) -> dict[str, Any]:
        """Keep only nodes where evicting victims frees the right GPUs, with a minimal set of GPU victims.

        Victims holding no GPU share on the node are kept as kube-scheduler chose them (it needed them
        for other resources); among GPU holders only the minimal set is kept.
        """
        try:
            demand = self.demand(args.pod)
        except DemandError:
            return {"NodeNameToMetaVictims": {}}
        if demand.gated:
            return {"NodeNameToMetaVictims": {}}
        out: dict[str, Any] = {}
        for node_name, (uids, pdb) in args.victims.items():
            node = self.view.nodes.get(node_name)
            if demand.wants_gpu and node is None:
                continue
            if not demand.wants_gpu or node is None:
                out[node_name] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
                continue
            gpu_victims, others = [], []
            for uid in uids:
                alloc = self.view.allocations.get(uid)
                if alloc is not None and alloc.node == node_name and alloc.charges:
                    gpu_victims.append(Victim(uid, alloc.charges))
                else:
                    others.append(uid)
            chosen = select_victims(node, demand, gpu_victims, self.policy)
            if chosen is None:
                continue
            out[node_name] = {"Pods": [{"UID": u} for u in [*others, *chosen]], "NumPDBViolations": pdb}
        return {"NodeNameToMetaVictims": out}

    # ---- inspect -------------------------------------------------------------------------------
    def inspect(self, node_name: str | None = None) -> dict[str, Any]:
        """gpushare's inspect JSON: nodes with totalGPU / usedGPU and per-GPU devs (memory in the unit)."""
        unit = self.unit.mib
        out = []
        for name in sorted(self.view.nodes) if node_name is None else [node_name]:
            node = self.view.nodes.get(name)
            if node is None:
                continue
            devs = []
            for g in node.gpus:
                pods = [
                    {
                        "name": a.pod_name,
                        "namespace": a.namespace,
                        "uid": a.pod_uid,
                        "state": a.state,
                        "usedGPU": a.charge_on(g.uuid)[0] // unit,
                    }
                    for a in self.view.pods_on(name, g.uuid)
                ]
                devs.append(
                    {
                        "id": g.index,
                        "uuid": g.uuid,
                        "model": g.model,
                        "healthy": g.healthy,
                        "totalGPU": g.memory_mib // unit,
                        "usedGPU": g.allocated_memory_mib // unit,
                        "pods": pods,
                    }
                )
            out.append(
                {
                    "name": name,
                    "totalGPU": sum(d["totalGPU"] for d in devs),
                    "usedGPU": sum(d["usedGPU"] for d in devs),
                    "devs": devs,
                }
            )
        return {"nodes": out}
