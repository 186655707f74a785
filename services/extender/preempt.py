"""The preempt verb: per candidate node, the victims kube-scheduler's own preemption would choose if it knew the GPUs.

kube-scheduler (`SelectVictimsOnNode`) chose its victims by the resources it checks itself; with `aliyun.com/gpu-mem`
left to the extender (`ignoredByScheduler: true`) those free no GPU. The extender runs kube-scheduler's rule again
with the GPU rule added (`shared.placement.preempt.select_victims`): it keeps kube-scheduler's victims, adds the
lower-priority GPU holders that must go too, drops the node when no eviction frees the right GPUs, and answers
what kube-scheduler would: the victims most important first (kube-scheduler takes the first as the highest
priority when it picks a node) and the number of them that violate a PodDisruptionBudget, counted as
kube-scheduler counts (`shared.placement.disruption`). The pods and budgets come from the API
(`services.extender.victims`).

A preemptor already nominated to a node whose victims are gone while the ledger still releases their shares gets
no node: kube-scheduler would preempt a second time elsewhere (its cache forgot the victims, the extender's view
still holds their shares for a moment, so its filter refuses the nominated node). kube-scheduler itself waits
while victims on the nominated node are terminating (`PodEligibleToPreemptOthers`); this is the same wait for
shares on their way back.
"""

from __future__ import annotations

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


def nodes_to_read(args: PreemptionArgs) -> list[str]:
    """The nodes whose pods preempt reads: the candidates, and the node the preemptor is nominated to."""
    nodes = list(args.victims)
    waiting = nominated_node(args.pod)
    return [*nodes, waiting] if waiting and waiting not in args.victims else nodes


def being_released(view: ClusterView, node: str, listed: list[PodFacts]) -> list[Victim]:
    """Shares the view still holds on `node` for pods the API no longer has there (their release is on its way)."""
    present = {p.uid for p in listed}
    held = {a.pod_uid: a for g in view.nodes[node].gpus for a in view.pods_on(node, g.uuid)}
    return [Victim(uid, a.charges) for uid, a in held.items() if uid not in present]


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
) -> dict[str, Any]:
    """Keep the nodes where evictions free the right GPUs, each with kube-scheduler's victims and the GPU holders
    that must go too, in kube-scheduler's order and with its count of PodDisruptionBudget violations."""
    try:
        demand = parse_pod(args.pod, unit)
    except DemandError:
        return {"NodeNameToMetaVictims": {}}
    if demand.gated:
        return {"NodeNameToMetaVictims": {}}
    now = now or datetime.now(UTC)
    priority = preemptor_priority(args.pod)
    waiting = nominated_node(args.pod)
    if waiting in view.nodes and facts.pods is not None and waiting in facts.pods:
        gone = being_released(view, waiting, facts.pods[waiting])
        if gone and fits_without(view.nodes[waiting], demand, gone, policy):
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
