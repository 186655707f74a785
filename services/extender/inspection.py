"""gpushare's inspect JSON from the view: nodes with totalGPU / usedGPU and per-GPU devs, in the resource unit."""

from __future__ import annotations

from typing import Any

from services.extender.view import ClusterView
from shared.settings import MemoryUnit


def inspect(view: ClusterView, unit: MemoryUnit, node_name: str | None = None) -> dict[str, Any]:
    """Every node (or the one named; none when it is unknown) with its GPUs and the pods holding shares."""
    mib = unit.mib
    out = []
    for name in sorted(view.nodes) if node_name is None else [node_name]:
        node = view.nodes.get(name)
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
                    "usedGPU": a.charge_on(g.uuid)[0] // mib,
                }
                for a in view.pods_on(name, g.uuid)
            ]
            devs.append(
                {
                    "id": g.index,
                    "uuid": g.uuid,
                    "model": g.model,
                    "healthy": g.healthy,
                    "totalGPU": g.memory_mib // mib,
                    "usedGPU": g.allocated_memory_mib // mib,
                    "pods": pods,
                }
            )
        out.append(
            {
                "name": name,
                "totalGPU": sum(int(d["totalGPU"]) for d in devs),  # type: ignore[call-overload]
                "usedGPU": sum(int(d["usedGPU"]) for d in devs),  # type: ignore[call-overload]
                "devs": devs,
            }
        )
    return {"nodes": out}
