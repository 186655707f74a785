"""The preempt verb: per node, the smallest set of GPU-holding victims whose eviction lets the pod fit."""

from __future__ import annotations

from typing import Any

from services.extender.view import ClusterView
from services.extender.wire import PreemptionArgs
from shared.placement import DemandError, Policy, Victim, parse_pod, select_victims
from shared.settings import MemoryUnit


def preempt(view: ClusterView, args: PreemptionArgs, *, unit: MemoryUnit, policy: Policy) -> dict[str, Any]:
    """Keep only nodes where evicting victims frees the right GPUs, with a minimal set of GPU victims.

    Victims holding no GPU share on the node are kept as kube-scheduler chose them (it needed them
    for other resources); among GPU holders only the minimal set is kept.
    """
    try:
        demand = parse_pod(args.pod, unit)
    except DemandError:
        return {"NodeNameToMetaVictims": {}}
    if demand.gated:
        return {"NodeNameToMetaVictims": {}}
    out: dict[str, Any] = {}
    for node_name, (uids, pdb) in args.victims.items():
        node = view.nodes.get(node_name)
        if demand.wants_gpu and node is None:
            continue
        if not demand.wants_gpu or node is None:
            out[node_name] = {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": pdb}
            continue
        gpu_victims, others = [], []
        for uid in uids:
            alloc = view.allocations.get(uid)
            if alloc is not None and alloc.node == node_name and alloc.charges:
                gpu_victims.append(Victim(uid, alloc.charges))
            else:
                others.append(uid)
        chosen = select_victims(node, demand, gpu_victims, policy)
        if chosen is None:
            continue
        out[node_name] = {"Pods": [{"UID": u} for u in [*others, *chosen]], "NumPDBViolations": pdb}
    return {"NodeNameToMetaVictims": out}
