"""The I/O shell of exact assignment: GetPreferredAllocation, Allocate and PreStartContainer for
`aliyun.com/gpu-mem`, against the agent's view of the ledger and kubelet's pod-resources API.

GetPreferredAllocation and Allocate answer from the local view (`view.NodeView`, fed by the node's events);
when either finds no match, the view may lag a reservation that was just made, so it is reloaded from the
ledger's gateway once before answering. Allocate picks the pending container (see `assignment`) and remembers
the decision under the device set. PreStartContainer asks kubelet which container really holds the devices:
the chosen one -> `assigned`; another pending container of identical share shape -> the ledger exchanges the
two shares (so it records what each container really received), then `assigned`; anything else -> refused
(after one reload of the view, which may lag the holder's reservation), and the container does not start.
kubelet never lists a regular init container there (`podresources`): its device set is confirmed from the later
containers of the pod that kubelet handed the devices on to (`devicesToReuse`), which name the pod that received
them, or, when none did, as Allocate decided. A device set that reuses devices of a decided set belongs to the same
pod, so its container is looked for in that allocation first.
The confirmation must reach the ledger before the container starts: it is a command to the gateway with a
bounded deadline, and when the ledger cannot be reached in time PreStart fails with a short reason (kubelet
retries). No node-wide lock: decisions are in-memory steps without awaits between choosing and claiming.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Awaitable, Callable, Iterable
from dataclasses import dataclass

import grpc

from services.node_agent import podresources
from services.node_agent.assignment import (
    AssignmentError,
    PendingContainer,
    container_env,
    match_container,
    preferred_devices,
    units_by_gpu,
)
from services.node_agent.ledger_link import CommandRefused, LedgerLink, LedgerUnavailable
from services.node_agent.mps import MpsRoot
from services.node_agent.view import NodeView
from shared.annotations import RESOURCE_MEM
from shared.events.agent_rpc import MAX_BATCH, CommandReply
from shared.events.catalogue import AssignedEvent, Event, ExchangedEvent, decode_event
from shared.ledger.group_commit import GroupCommit
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

Key = tuple[uuid.UUID, str]
CONFIRM_DEADLINE_S = 20.0  # kubelet waits for PreStartContainer; a later retry of its own starts over


@dataclass
class Decision:
    """Which container an Allocate'd device set was handed to."""

    target: Key
    confirmed: bool = False


class Assigner:
    """Maps kubelet's device sets to ledger containers on one node."""

    def __init__(
        self,
        *,
        link: LedgerLink,
        view: NodeView,
        reload: Callable[[], Awaitable[bool]],
        node: str,
        unit: MemoryUnit,
        pod_resources_socket: str,
        gpu_memory_mib: Callable[[], dict[str, int]],
        gpu_total_mib: Callable[[], dict[str, int]],
        mps: bool = False,
        mps_root: MpsRoot | None = None,
        on_outcome: Callable[[str], None] | None = None,
        confirm_deadline_s: float = CONFIRM_DEADLINE_S,
    ) -> None:
        self.link = link
        self.view = view
        self.reload = reload
        self.node = node
        self.unit = unit
        self.pod_resources_socket = pod_resources_socket
        self.pod_resources = podresources.PodResourcesClient(pod_resources_socket)
        self.gpu_memory_mib = gpu_memory_mib
        self.gpu_total_mib = gpu_total_mib
        self.mps = mps  # always hand out MPS limits (--mps)
        self.mps_root = mps_root  # while the control daemon runs there (--mps-root)
        self.on_outcome = on_outcome or (lambda _reason: None)
        self.confirm_deadline_s = confirm_deadline_s
        self.decisions: dict[frozenset[str], list[Decision]] = {}
        self._settling = asyncio.Lock()  # PreStarts that exchange, reload or refuse: one at a time (`prestart`)
        # commands that arrive while a request is in flight go together in the next (a pod's containers, a burst)
        self._commands: GroupCommit[Event, CommandReply] = GroupCommit(
            self._send, what="node_agent_commands", max_batch=MAX_BATCH
        )

    async def containers(self) -> list[PendingContainer]:
        """The node's live containers from the view; forgets decisions of ended allocations."""
        if not self.view.loaded:
            await self.reload()
        view = self.view.containers()
        live = {c.key for c in view}
        for key in list(self.decisions):
            kept = [d for d in self.decisions[key] if d.target in live]
            if kept:
                self.decisions[key] = kept
            else:
                del self.decisions[key]
        return view

    def claimed(self, *, started_only: bool = False) -> set[Key]:
        """Containers already handed a device set (`started_only`: only those kubelet went on to start)."""
        return {d.target for ds in self.decisions.values() for d in ds if d.confirmed or not started_only}

    def reusing(self, device_ids: Iterable[str]) -> uuid.UUID | None:
        """The allocation a device set shares devices with: kubelet hands a regular init container's devices on to
        the later containers of the same pod only (`devicesToReuse`), so a set holding devices of a decided set is
        for that pod (as the agent decided it; None when no decided set shares any)."""
        ids = set(device_ids)
        for key, decided in self.decisions.items():
            if ids & key and decided:
                return decided[-1].target[0]
        return None

    async def preferred(self, available: list[str], must: list[str], size: int) -> list[str]:
        """Device IDs on the GPU(s) of the oldest pending container of `size` units (the pod's own, when kubelet
        must include devices it hands on from the pod's init container).

        Answered from the view. When no container of this size waits there, the view may lag a reservation made a
        moment ago (without a preference kubelet would pick devices that match no reservation, and Allocate would
        refuse them): the ledger is read once. Only then are containers handed a device set that was never started
        considered (kubelet drops a device set when the pod's admission fails and asks again, and such a container
        must not be left without devices); before the ledger is read, such a container may be the very one a
        lagging view hides a better match for.
        """
        prefer = self.reusing(must)
        view = await self.containers()
        found = preferred_devices(view, self.claimed(), available, must, size, self.unit, prefer)
        if found:
            return found
        if await self.reload():
            view = await self.containers()
            found = preferred_devices(view, self.claimed(), available, must, size, self.unit, prefer)
        return found or preferred_devices(
            view, self.claimed(started_only=True), available, must, size, self.unit, prefer
        )

    async def allocate(self, device_ids: list[str]) -> dict[str, str]:
        """The env for the container this device set is for; AssignmentError when none matches.

        Answered from the view; when no unclaimed container matches, the ledger is read once first (the view may
        lag a reservation made a moment ago). A container that was handed a device set kubelet never started may
        be handed another one when no other container matches (see `preferred`); PreStartContainer still checks
        who really got it.
        """
        prefer = self.reusing(device_ids)
        try:
            chosen = match_container(await self.containers(), self.claimed(), device_ids, self.unit, prefer)
        except AssignmentError:
            await self.reload()  # unreachable: the view as it is, with the fallback below
            try:
                chosen = self._match(await self.containers(), device_ids, prefer)
            except AssignmentError:
                self.on_outcome("no_match")
                raise
        self.decisions.setdefault(frozenset(device_ids), []).append(Decision(chosen.key))
        log.info(
            "Allocate: %d units -> %s/%s container %s",
            len(device_ids),
            chosen.namespace,
            chosen.pod_name,
            chosen.container,
            extra={"allocation_id": str(chosen.allocation_id), "gpus": [s.gpu_uuid for s in chosen.shares]},
        )
        self.on_outcome("allocated")
        client = self.mps_root is not None and self.mps_root.running()
        env = container_env(chosen, self.gpu_memory_mib(), self.gpu_total_mib(), self.unit, mps=self.mps or client)
        return {**env, **self.mps_root.client_env()} if client and self.mps_root is not None else env

    def _match(self, view: list[PendingContainer], device_ids: list[str], prefer: uuid.UUID | None) -> PendingContainer:
        try:
            return match_container(view, self.claimed(), device_ids, self.unit, prefer)
        except AssignmentError as first:
            try:
                return match_container(view, self.claimed(started_only=True), device_ids, self.unit, prefer)
            except AssignmentError:
                raise first from None

    async def prestart(self, device_ids: list[str], *, reload_on_miss: bool = True) -> None:
        """Confirm (or correct through an exchange) who received `device_ids`; AssignmentError otherwise.

        A refusal that rests on the view (the holder's reservation unknown to it) first reloads the view from
        the ledger once: the holder's reservation may have been made a moment ago, as in `allocate`.

        kubelet starts pods in workers of their own, so PreStarts arrive concurrently. A container that received
        what Allocate decided is confirmed at once; everything else (an exchange, a reload, a refusal, a device
        set without a decision) is settled one PreStart at a time, each looking at the decisions afresh once it
        is its turn: two pods admitted in swapped order would otherwise each exchange, the second swapping the
        shares back.
        """
        own = await self._own_pod(device_ids)
        if own is not None and await self._decide(device_ids, own, settle=False, reload_on_miss=False, whole=False):
            return
        listed = await self._listing()
        if await self._decide(device_ids, listed, settle=False, reload_on_miss=False):
            return
        async with self._settling:
            await self._decide(device_ids, listed, settle=True, reload_on_miss=reload_on_miss)

    async def _own_pod(self, device_ids: list[str]) -> list[podresources.Listed] | None:
        """What kubelet lists for the pod Allocate decided this device set for (pod-resources `Get`: one pod, where
        `List` reads every pod of the node), when that container is one kubelet lists; None otherwise, or when
        kubelet has no `Get`."""
        decided = self.decisions.get(frozenset(device_ids), [])
        d = next((d for d in decided if not d.confirmed), None) or next((d for d in reversed(decided)), None)
        c = self.view.container(d.target) if d is not None else None
        if c is None or c.regular_init:
            return None
        return await self.pod_resources.pod(c.namespace, c.pod_name, RESOURCE_MEM)

    async def _listing(self) -> list[podresources.Listed]:
        try:
            return await self.pod_resources.listing(RESOURCE_MEM)
        except grpc.aio.AioRpcError as exc:
            self.on_outcome("pod_resources_unavailable")
            raise AssignmentError(
                f"cannot ask kubelet's pod-resources API ({self.pod_resources_socket}) who holds the devices: "
                f"{exc.code().name} {exc.details()}"
            ) from None

    async def _decide(
        self,
        device_ids: list[str],
        listed: list[podresources.Listed],
        *,
        settle: bool,
        reload_on_miss: bool,
        whole: bool = True,
    ) -> bool:
        """`prestart` against kubelet's listing (`whole`: of every pod; else of the decided pod alone, which
        settles nothing about a regular init container); without `settle` only the received case is done (True),
        anything else is left (False) for a settling turn."""
        view = await self.containers()
        by_key = {c.key: c for c in view}
        holders = podresources.holders(listed, device_ids)
        pods = podresources.pods_holding_any(listed, device_ids)
        decisions = self.decisions.get(frozenset(device_ids), [])
        pending = next((d for d in decisions if not d.confirmed), None)
        chosen = by_key.get(pending.target) if pending is not None else None
        if pending is not None and chosen is not None and chosen.regular_init:
            if not whole:
                return False
            # kubelet's pod-resources API never lists a regular init container: a container listing any of its
            # devices was handed them on from the init container of its own pod, the pod that received them; none
            # listed (the pod has no later container on them): the Allocate decision stands, as nothing on the
            # node can say otherwise
            others = pods - {(chosen.namespace, chosen.pod_name)}
            if len(pods) > 1:
                if not settle:
                    return False
                self.on_outcome("refused")
                raise AssignmentError(
                    f"kubelet lists these devices in several pods ({sorted(pods)}); refusing to guess"
                )
            received = not others
            if not received and not settle:
                return False
            candidates = sorted((c for c in view if (c.namespace, c.pod_name) in others), key=_start_order)
            meant = f"init container {chosen.container} of {chosen.namespace}/{chosen.pod_name}"
            given = ", ".join(f"pod {ns}/{name} (its later containers were handed them on)" for ns, name in others)
            await self._settle(chosen, pending, received, candidates, meant, given, device_ids, reload_on_miss, listed)
            return True
        received = chosen is not None and (chosen.namespace, chosen.pod_name, chosen.container) in holders
        if pending is None:
            done = next((d for d in reversed(decisions) if d.confirmed), None)
            started = by_key.get(done.target) if done is not None else None
            if (
                started is not None
                and started.assigned
                and (started.namespace, started.pod_name, started.container) in holders
            ):
                return True  # confirmed with its pod's first container, or started before: nothing to record
        if not settle and not received:
            return False
        if not holders and (pending is not None or not self._init_candidates(view, device_ids, pods)):
            self.on_outcome("no_holder")
            raise AssignmentError(f"kubelet's pod-resources API lists no container holding {len(device_ids)} devices")
        if pending is None:
            # a restarted container, or the agent restarted between Allocate and PreStart
            await self._prestart_undecided(view, device_ids, holders, pods, reload_on_miss)
            return True
        if chosen is None:
            self.on_outcome("refused")
            raise AssignmentError("the reservation this device set was allocated for has ended")
        candidates = [c for c in view if (c.namespace, c.pod_name, c.container) in holders]
        meant = f"{chosen.namespace}/{chosen.pod_name}/{chosen.container}"
        await self._settle(
            chosen, pending, received, candidates, meant, _names(holders), device_ids, reload_on_miss, listed
        )
        return True

    async def _again(self, device_ids: list[str]) -> None:
        """After a reload of the view: decide once more (within the settling turn), from a fresh listing."""
        await self._decide(device_ids, await self._listing(), settle=True, reload_on_miss=False)

    async def _settle(
        self,
        chosen: PendingContainer,
        pending: Decision,
        received: bool,
        candidates: list[PendingContainer],
        meant: str,
        given: str,
        device_ids: list[str],
        reload_on_miss: bool,
        listed: list[podresources.Listed],
    ) -> None:
        """`chosen` received the devices -> confirm it (with the rest of its pod, `_confirm_with_pod`); else
        exchange with the candidate that did (same kind and shape), or refuse (after one reload of a view that may
        lag the candidate's reservation)."""
        if received:
            await self._confirm_with_pod(chosen, pending, listed)
            return
        actual = _exchangeable(chosen, candidates)
        if actual is None:
            if reload_on_miss and await self.reload():
                return await self._again(device_ids)
            self.on_outcome("refused")
            raise AssignmentError(
                f"kubelet gave the devices meant for {meant} to {given}, which has no pending reservation of the "
                "same shape on this node"
            )
        if not _same_shares(chosen, actual):
            return await self._exchange(chosen, actual, pending)
        # the very same shares: the environment Allocate handed out is right for either container, and an
        # exchange would change nothing in the ledger; the decisions follow kubelet instead
        self._retarget(actual.key, chosen.key)
        pending.target = actual.key
        self.on_outcome("swapped_same_shares")
        await self._confirm(actual)
        pending.confirmed = True

    async def _confirm_with_pod(
        self, chosen: PendingContainer, pending: Decision, listed: list[podresources.Listed]
    ) -> None:
        """Confirm `chosen` and, in the same request, every other container of its pod that kubelet lists holding
        exactly the device set Allocate decided for it: kubelet allocates all of a pod's containers at admission,
        before it starts the first, so what pod-resources says of them now is what they get; their own PreStarts
        then find them confirmed (one ledger transaction per pod, not per container). A companion the ledger does
        not confirm now is confirmed at its own PreStart."""
        companions: list[tuple[Decision, PendingContainer]] = []
        for devices, decided in self.decisions.items():
            for d in decided:
                if d.confirmed or d is pending or d.target[0] != chosen.allocation_id or d.target == chosen.key:
                    continue
                c = self.view.container(d.target)
                if c is None or c.assigned or c.regular_init:
                    continue
                if (c.namespace, c.pod_name, c.container) in podresources.holders(listed, devices):
                    companions.append((d, c))
        if not companions:
            await self._confirm(chosen)
            pending.confirmed = True
            return
        results = await asyncio.gather(
            self._confirm(chosen), *(self._confirm(c) for _, c in companions), return_exceptions=True
        )
        for (d, _), result in zip(companions, results[1:], strict=True):
            d.confirmed = not isinstance(result, BaseException)
        if isinstance(results[0], BaseException):
            raise results[0]
        pending.confirmed = True

    def _init_candidates(
        self, view: list[PendingContainer], device_ids: list[str], pods: set[tuple[str, str]]
    ) -> list[PendingContainer]:
        """Regular init containers this device set may have gone to (no Allocate decision known): of the pod whose
        later containers hold some of the devices, else of any pod; by kubelet's start order, unassigned first."""
        want = units_by_gpu(device_ids)
        found = [
            c
            for c in view
            if c.regular_init and c.units(self.unit) == want and (not pods or (c.namespace, c.pod_name) in pods)
        ]
        return sorted(found, key=lambda c: (c.assigned, _start_order(c)))

    async def _prestart_undecided(
        self,
        view: list[PendingContainer],
        device_ids: list[str],
        holders: list[tuple[str, str, str]],
        pods: set[tuple[str, str]],
        reload_on_miss: bool,
    ) -> None:
        """PreStart of a device set with no Allocate decision: a restarted container, or the agent restarted
        between Allocate and PreStart. The container is recomputed from pod-resources and the view: a listed
        holder of these units, or a regular init container of the pod the devices went to; the one kubelet starts
        first (unassigned, init containers first) is the one starting."""
        want = units_by_gpu(device_ids)
        named = [c for c in view if (c.namespace, c.pod_name, c.container) in holders and c.units(self.unit) == want]
        found = sorted(
            [*named, *self._init_candidates(view, device_ids, pods)], key=lambda c: (c.assigned, _start_order(c))
        )
        if found:
            c = found[0]
            await self._confirm(c)
            known = self.decisions.setdefault(frozenset(device_ids), [])
            if all(d.target != c.key for d in known):
                known.append(Decision(c.key, confirmed=True))
            return
        # the agent restarted after Allocate and kubelet admitted another pod than the one whose
        # GPUs these devices are: the env named the devices' GPUs, so exchange into that
        for h in view:
            if (h.namespace, h.pod_name, h.container) not in holders or h.assigned:
                continue
            owner = _exchangeable(
                h,
                (o for o in sorted(view, key=lambda o: o.admission_order) if o.units(self.unit) == want),
            )
            if owner is not None:
                decision = Decision(owner.key)
                self.decisions.setdefault(frozenset(device_ids), []).append(decision)
                await self._exchange(owner, h, decision)
                return
        if reload_on_miss and await self.reload():
            return await self._again(device_ids)
        self.on_outcome("refused")
        raise AssignmentError(
            f"kubelet gave these devices to {_names(holders)}, which holds no reservation on exactly these GPUs"
        )

    def _retarget(self, old: Key, new: Key) -> None:
        """After an exchange, device sets handed to `old` (not started yet) now belong to `new`."""
        for ds in self.decisions.values():
            for d in ds:
                if not d.confirmed and d.target == old:
                    d.target = new

    async def _exchange(self, expected: PendingContainer, actual: PendingContainer, decision: Decision) -> None:
        """Swap `expected`'s share (the devices' GPUs) with `actual`'s, then mark `actual` assigned; `decision` (the
        device set's) names `actual` from the exchange on, so no Allocate meanwhile takes `actual` for another set."""
        command = ExchangedEvent(
            node=self.node,
            first_allocation_id=expected.allocation_id,
            first_container=expected.container,
            second_allocation_id=actual.allocation_id,
            second_container=actual.container,
            source="node-agent",
        )
        await self._command(command, refused_outcome="refused")
        self._retarget(actual.key, expected.key)
        decision.target = actual.key
        log.warning(
            "kubelet admitted %s/%s/%s where %s/%s/%s was expected; exchanged their equal shares in the ledger",
            actual.namespace,
            actual.pod_name,
            actual.container,
            expected.namespace,
            expected.pod_name,
            expected.container,
            extra={
                "admitted_order": [str(x) for x in actual.admission_order],
                "expected_order": [str(x) for x in expected.admission_order],
            },
        )
        self.on_outcome("exchanged")
        await self._confirm(self.view.container(actual.key) or actual)
        decision.confirmed = True

    async def _confirm(self, c: PendingContainer) -> None:
        """Record in the ledger that `c` received its GPU(s) (the binder then sets the pod's assigned flag)."""
        if not c.assigned:
            command = AssignedEvent(
                allocation_id=c.allocation_id,
                pod_uid=c.pod_uid,
                node=self.node,
                container=c.container,
                gpu_uuids=[s.gpu_uuid for s in c.shares],
                source="node-agent",
            )
            await self._command(command, refused_outcome="refused")
            self.on_outcome("assigned")
            log.info("assigned %s/%s container %s", c.namespace, c.pod_name, c.container)

    async def _send(self, commands: list[Event]) -> list[CommandReply | Exception]:
        return await self.link.send_many(commands, deadline_s=self.confirm_deadline_s)

    async def _command(self, command: AssignedEvent | ExchangedEvent, *, refused_outcome: str) -> None:
        """Send a command and fold the staged event into the view at once; AssignmentError with a short reason
        when the ledger refuses it or cannot be reached before the deadline."""
        try:
            reply = await self._commands.submit(command)
        except CommandRefused as exc:
            self.on_outcome(refused_outcome)
            raise AssignmentError(str(exc)) from None
        except LedgerUnavailable as exc:
            self.on_outcome("ledger_unavailable")
            raise AssignmentError(f"the GPU assignment could not be recorded in the ledger: {exc}") from None
        self.view.apply(decode_event(json.dumps(reply.event)) if reply.event is not None else command)


def _exchangeable(target: PendingContainer, candidates: Iterable[PendingContainer]) -> PendingContainer | None:
    """The candidate `target` can trade shares with: unassigned, of the same kind and share shape; one whose
    pod has the same total memory first (then every variable of both environments stays true).

    Equal shares of differently shaped pods are exchanged too: refusing them could leave two pods that
    kubelet admitted against the prediction holding each other's devices, refused for ever. Only
    `ALIYUN_COM_GPU_MEM_POD` (the pod's total, informational) of the environment handed out at Allocate may
    then name the other pod's total; the GPUs, the share and the limits are exact, and the annotations follow
    the ledger.
    """
    fitting = [
        c
        for c in candidates
        if not c.assigned and c.key != target.key and c.kind == target.kind and c.share_shape() == target.share_shape()
    ]
    return next((c for c in fitting if c.shape() == target.shape()), fitting[0] if fitting else None)


def _same_shares(a: PendingContainer, b: PendingContainer) -> bool:
    """Containers holding the same share of the same GPUs, in pods of the same total memory: everything their
    environments say is the same (`assignment.container_env`)."""
    return a.shares == b.shares and a.pod_memory_mib == b.pod_memory_mib


def _start_order(c: PendingContainer) -> tuple:
    """The order kubelet starts containers in: pods by admission, within a pod init containers then app
    containers, each by spec index."""
    return (c.admission_order, str(c.allocation_id), not c.init, c.container_index)


def _name(c: PendingContainer) -> tuple[str, str, str]:
    """(namespace, pod, container): how pod-resources names a container."""
    return (c.namespace, c.pod_name, c.container)


def _names(holders: list[tuple]) -> str:
    return ", ".join(f"{ns}/{pod}/{c}" for ns, pod, c in holders)
