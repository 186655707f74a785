"""The preempt verb: per candidate node, the victims kube-scheduler's own preemption would choose if it knew the GPUs.

kube-scheduler (`SelectVictimsOnNode`) chose its victims by the resources it checks itself; with `aliyun.com/gpu-mem`
left to the extender (`ignoredByScheduler: true`) those free no GPU. The extender runs kube-scheduler's rule again
with the GPU rule added (`shared.placement.preempt.select_victims`): it keeps kube-scheduler's victims, adds the
lower-priority GPU holders that must go too, drops the node when no eviction frees the right GPUs, and answers
what kube-scheduler would: the victims most important first (kube-scheduler takes the first as the highest
priority when it picks a node) and the number of them that violate a PodDisruptionBudget, counted as
kube-scheduler counts (`shared.placement.disruption`). The pods and budgets come from the API
(`services.extender.victims`).

A preemptor whose earlier preemption is still under way gets no node: kube-scheduler would preempt a second time
elsewhere (its cache forgot the victims, the extender's view still holds their shares for a moment, so its filter
refuses the node the victims left). kube-scheduler itself waits while lower-priority pods on the nominated node are
terminating (`PodEligibleToPreemptOthers`, pkg/scheduler/framework/plugins/defaultpreemption); this is the same wait
for victims gone or terminating, for shares on their way back, and for shares back already (the filter that sent the
pod to preemption saw the view a moment before). The node it waits on is the nominated one, or,
since kube-scheduler 1.37 preempts asynchronously and may try the pod again before its `nominatedNodeName` shows, any
node this extender answered victims on for the same preemptor a moment earlier (`Preemptions`).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from datetime import UTC, datetime
from typing import Any

from services.extender.victims import Facts, PodFacts
from services.extender.view import ClusterView
from services.extender.wire import PreemptionArgs
from shared.placement import DemandError, Policy, parse_pod
from shared.placement.preempt import Victim, fits_without, select_victims
from shared.settings import MemoryUnit

LOWEST_PRIORITY = -(2**31)


def preemptor_priority(pod: dict[str, Any]) -> int:
    """The preemptor's `spec.priority` (0 when unset, as `corev1helpers.PodPriority`)."""
    priority = (pod.get("spec") or {}).get("priority")
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else 0


def nominated_node(pod: dict[str, Any]) -> str:
    """The node kube-scheduler nominated the preemptor to after an earlier preemption ("" when none)."""
    name = (pod.get("status") or {}).get("nominatedNodeName")
    return name if isinstance(name, str) else ""


class Preemptions:
    """The nodes this extender recently answered victims on, per preemptor (bounded, forgotten after `keep_s`)."""

    def __init__(self, keep_s: float = 60.0, size: int = 1024) -> None:
        self.keep_s, self.size = keep_s, size
        self._nodes: OrderedDict[str, tuple[float, frozenset[str]]] = OrderedDict()

    def answered(self, pod_uid: str, nodes: frozenset[str], now: float | None = None) -> None:
        """Remember the nodes a preempt answer offered victims on."""
        if pod_uid and nodes:
            self._nodes[pod_uid] = (time.monotonic() if now is None else now, nodes)
            self._nodes.move_to_end(pod_uid)
            while len(self._nodes) > self.size:
                self._nodes.popitem(last=False)

    def recent(self, pod_uid: str, now: float | None = None) -> frozenset[str]:
        """The nodes answered for this preemptor within `keep_s`."""
        entry = self._nodes.get(pod_uid)
        if entry is None:
            return frozenset()
        if (time.monotonic() if now is None else now) - entry[0] > self.keep_s:
            del self._nodes[pod_uid]
            return frozenset()
        return entry[1]


def waiting_nodes(args: PreemptionArgs, recent: frozenset[str] = frozenset()) -> list[str]:
    """Where an earlier preemption for this preemptor may be under way: its nominated node and `recent`."""
    nominated = nominated_node(args.pod)
    return sorted({nominated, *recent} - {""})


def nodes_to_read(args: PreemptionArgs, recent: frozenset[str] = frozenset()) -> list[str]:
    """The nodes whose pods preempt reads: the candidates, and the nodes an earlier preemption may be under way on."""
    nodes = list(args.victims)
    return nodes + [n for n in waiting_nodes(args, recent) if n not in args.victims]


def being_released(view: ClusterView, node: str, listed: list[PodFacts], priority: int | None = None) -> list[Victim]:
    """Shares the view still holds on `node` for pods the API no longer has there, or (with the preemptor's
    `priority`) for lower-priority pods there that are terminating: their release is on its way."""
    present = {p.uid: p for p in listed}
    held = {a.pod_uid: a for g in view.nodes[node].gpus for a in view.pods_on(node, g.uuid)}
    out = []
    for uid, a in held.items():
        facts = present.get(uid)
        leaving = facts is None or (priority is not None and facts.terminating and facts.priority < priority)
        if leaving:
            out.append(Victim(uid, a.charges))
    return out


def _victim(view: ClusterView, node: str, facts: PodFacts) -> Victim:
    alloc = view.allocations.get(facts.uid)
    charges = alloc.charges if alloc is not None and alloc.node == node else {}
    return Victim(facts.uid, charges, facts.priority, facts.started, facts.namespace, facts.name, facts.labels)


def preempt(
    view: ClusterView,
    args: PreemptionArgs,
    facts: Facts,
    *,
    unit: MemoryUnit,
    policy: Policy,
    now: datetime | None = None,
    recent: frozenset[str] = frozenset(),
) -> dict[str, Any]:
    """Keep the nodes where evictions free the right GPUs, each with kube-scheduler's victims and the GPU holders
    that must go too, in kube-scheduler's order and with its count of PodDisruptionBudget violations; none while an
    earlier preemption for the pod is under way on its nominated node or on `recent` nodes."""
    try:
        demand = parse_pod(args.pod, unit)
    except DemandError:
        return {"NodeNameToMetaVictims": {}}
    if demand.gated:
        return {"NodeNameToMetaVictims": {}}
    now = now or datetime.now(UTC)
    priority = preemptor_priority(args.pod)
    for waiting in waiting_nodes(args, recent):
        if waiting in view.nodes and facts.pods is not None and waiting in facts.pods:
            # released meanwhile (it fits now: filter saw the view a moment before the release) or on its way back
            gone = being_released(view, waiting, facts.pods[waiting], priority)
            if fits_without(view.nodes[waiting], demand, gone, policy):
                return {"NodeNameToMetaVictims": {}}  # wait for the release, as kube-scheduler waits for its victims
    out: dict[str, Any] = {}
    for node_name, (uids, pdb) in args.victims.items():
        node = view.nodes.get(node_name)
        if not demand.wants_gpu or node is None:
            if not demand.wants_gpu:
                out[node_name] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
            continue
        listed = facts.pods.get(node_name) if facts.pods is not None else None
        if listed is None:  # only kube-scheduler's victims are known, and its count of violations
            pods = [_victim(view, node_name, PodFacts(u, "", "", {}, LOWEST_PRIORITY, None)) for u in uids]
            chosen = select_victims(
                node, demand, pods, preemptor_priority=priority, required=uids, policy=policy, now=now
            )
            if chosen is not None and chosen.uids:
                out[node_name] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
            continue
        pods = [_victim(view, node_name, f) for f in listed]
        known = {p.uid for p in pods}
        # a victim kube-scheduler knows and the list does not show yet: kept, least important
        pods += [
            _victim(view, node_name, PodFacts(u, "", "", {}, LOWEST_PRIORITY, None)) for u in uids if u not in known
        ]
        chosen = select_victims(
            node,
            demand,
            pods,
            preemptor_priority=priority,
            required=uids,
            budgets=facts.budgets,
            policy=policy,
            now=now,
        )
        if chosen is not None and chosen.uids:
            out[node_name] = {"Pods": [{"UID": u} for u in chosen.uids], "NumPDBViolations": chosen.pdb_violations}
    return {"NodeNameToMetaVictims": out}
