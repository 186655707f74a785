"""The preempt verb: per candidate node, the victims kube-scheduler's own preemption would choose if it knew the GPUs.

kube-scheduler (`SelectVictimsOnNode`) chose its victims by what it counts itself: each `aliyun.com/*` resource per
node in total (the shipped configuration, `ignoredByScheduler: false`), never per GPU, so its victims may free enough
memory in total and too little on every GPU. The extender runs kube-scheduler's rule again
with the GPU rule added (`shared.placement.preempt.select_victims`): it keeps kube-scheduler's victims, adds the
lower-priority GPU holders that must go too, drops the node when no eviction frees the right GPUs, and answers
what kube-scheduler would: the victims most important first (kube-scheduler takes the first as the highest
priority when it picks a node) and the number of them that violate a PodDisruptionBudget, counted as
kube-scheduler counts (`shared.placement.disruption`). The pods and budgets come from the API
(`services.extender.victims`).

A preemptor whose victims are gone while the ledger still releases their shares gets no node: kube-scheduler would
preempt a second time elsewhere (its cache forgot the victims, the extender's view still holds their shares for a
moment, so its filter refuses the node it preempted on). kube-scheduler itself waits while victims on the nominated
node are terminating (`PodEligibleToPreemptOthers`); this is the same wait for shares on their way back. The node
is known two ways: the preemptor's `status.nominatedNodeName`, and this extender's own recent answers for it
(`Evictions`): kube-scheduler's status write can reach its informer after the next attempt has begun, and victims
deleted without a grace period leave nothing terminating to wait for, so without the memory a preemptor retried at
once evicted a second node's pods (tests/e2e/test_preemption.py: the pod a PodDisruptionBudget guards, too).
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Collection, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from services.extender.victims import Facts, PodFacts
from services.extender.view import ClusterView
from services.extender.wire import PreemptionArgs
from shared.placement import DemandError, PodDemand, Policy, parse_pod
from shared.placement.preempt import Victim, fits_without, select_victims
from shared.settings import MemoryUnit

LOWEST_PRIORITY = -(2**31)
EVICTION_MEMORY_S = 60.0  # how long a preemptor waits for the node it preempted on before preempting elsewhere


@dataclass(frozen=True)
class Answered:
    """The victims a preempt answer named on each node for one preemptor, and when (monotonic seconds)."""

    victims: dict[str, frozenset[str]]
    at: float


class Evictions:
    """This extender's recent preempt answers, by preemptor UID (the last `size` preemptors, for `ttl_s`).

    kube-scheduler evicts the victims of the one node it picks among the answer's; which one shows later, as the
    victims that are gone from the API."""

    def __init__(
        self, *, size: int = 10_000, ttl_s: float = EVICTION_MEMORY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.size = size
        self.ttl_s = ttl_s
        self.clock = clock
        self._answers: OrderedDict[str, Answered] = OrderedDict()

    def remember(self, pod_uid: str, answer: dict[str, Any]) -> None:
        """Keep an answer that named victims (an empty one leaves the last answer in place: it may be the wait)."""
        named = {
            node: frozenset(p["UID"] for p in victims["Pods"])
            for node, victims in answer.get("NodeNameToMetaVictims", {}).items()
            if victims["Pods"]
        }
        if not pod_uid or not named:
            return
        self._answers[pod_uid] = Answered(named, self.clock())
        self._answers.move_to_end(pod_uid)
        while len(self._answers) > self.size:
            self._answers.popitem(last=False)

    def recent(self, pod_uid: str) -> dict[str, frozenset[str]]:
        """The victims per node of the pod's last answer, when it is recent enough to wait for."""
        answered = self._answers.get(pod_uid)
        if answered is None or self.clock() - answered.at > self.ttl_s:
            return {}
        return answered.victims


def preemptor_priority(pod: dict[str, Any]) -> int:
    """The preemptor's `spec.priority` (0 when unset, as `corev1helpers.PodPriority`)."""
    priority = (pod.get("spec") or {}).get("priority")
    return priority if isinstance(priority, int) and not isinstance(priority, bool) else 0


def nominated_node(pod: dict[str, Any]) -> str:
    """The node kube-scheduler nominated the preemptor to after an earlier preemption ("" when none)."""
    name = (pod.get("status") or {}).get("nominatedNodeName")
    return name if isinstance(name, str) else ""


def nodes_to_read(args: PreemptionArgs, answered: Collection[str] = ()) -> list[str]:
    """The nodes whose pods preempt reads: the candidates, the node the preemptor is nominated to, and the nodes
    this extender recently answered victims on for it."""
    nodes = list(args.victims)
    for node in (nominated_node(args.pod), *answered):
        if node and node not in nodes:
            nodes.append(node)
    return nodes


def being_released(view: ClusterView, node: str, listed: list[PodFacts], priority: int | None = None) -> list[Victim]:
    """Shares the view still holds on `node` for pods the API no longer has there, or (given the preemptor's
    `priority`) for lower-priority pods there that are terminating, as `PodEligibleToPreemptOthers` reads a pod
    being preempted: their release is on its way."""
    present = {p.uid: p for p in listed}
    held = {a.pod_uid: a for g in view.nodes[node].gpus for a in view.pods_on(node, g.uuid)}
    out = []
    for uid, a in held.items():
        facts = present.get(uid)
        if facts is None or (priority is not None and facts.terminating and facts.priority < priority):
            out.append(Victim(uid, a.charges))
    return out


def waited_for(
    view: ClusterView,
    demand: PodDemand,
    pod: dict[str, Any],
    facts: Facts,
    answered: Mapping[str, Collection[str]],
    policy: Policy,
) -> str | None:
    """The node the preemptor waits for instead of preempting again, or None.

    Its nominated node, when shares of pods gone from the API (or of lower-priority pods terminating there) are still
    held there and the pod fits once they are back; or a node this extender recently named victims on for it, when
    some of them are gone from the API or terminating (kube-scheduler evicted there) and the pod fits there now or
    once those shares are back."""
    if facts.pods is None:
        return None
    nominated = nominated_node(pod)
    priority = preemptor_priority(pod)
    for node in (nominated, *answered):
        if node not in view.nodes or node not in facts.pods:
            continue
        listed = facts.pods[node]
        gone = being_released(view, node, listed, priority)
        present = {p.uid for p in listed if not p.terminating}
        evicted = node in answered and not set(answered[node]) <= present
        if (gone or evicted) and fits_without(view.nodes[node], demand, gone, policy):
            return node
    return None


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
    answered: Mapping[str, Collection[str]] | None = None,
) -> dict[str, Any]:
    """Keep the nodes where evictions free the right GPUs, each with kube-scheduler's victims and the GPU holders
    that must go too, in kube-scheduler's order and with its count of PodDisruptionBudget violations. `answered`:
    the victims per node this extender recently answered for the pod (`Evictions.recent`)."""
    try:
        demand = parse_pod(args.pod, unit)
    except DemandError:
        return {"NodeNameToMetaVictims": {}}
    if demand.gated:
        return {"NodeNameToMetaVictims": {}}
    now = now or datetime.now(UTC)
    priority = preemptor_priority(args.pod)
    if demand.wants_gpu and waited_for(view, demand, args.pod, facts, answered or {}, policy) is not None:
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
