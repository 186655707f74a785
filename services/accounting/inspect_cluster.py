"""What `inspect` shows when accounting cannot be reached: nodes and pods as the API server alone tells them (pure).

Aliyun's kubectl-inspect-gpushare works this way: a node's GPUs are its `aliyun.com/gpu-count` capacity, each
holding an equal part of its `aliyun.com/gpu-mem` capacity (in the resource unit), and a pod bound to it holds
the GPU index of its `ALIYUN_COM_GPU_MEM_IDX` annotation with the amount of `ALIYUN_COM_GPU_MEM_POD` (else its
containers' `aliyun.com/gpu-mem` limits). A pod that also carries gpushare's own `gpushare.io/allocation`
record is read from the record instead: per GPU and per container kind, as the ledger charges it. A bound pod
with neither annotation, or with an index the node does not have, is pending (gpushare's `PENDING` column).

A DRA node (docs/dra.md) advertises no `aliyun.com/*` capacity: its GPUs are the devices of its gpushare
ResourceSlice (driver `gpu.gpushare.io`), each with its `memory` capacity, `index`, `model` and `uuid` attributes,
and its pods carry the same `gpushare.io/allocation` record (written by the binder at the gate), so they are read
the same way.

The output has the shape of accounting's `/v1/nodes/{name}` answers, so every `inspect` layout renders it;
what only accounting knows (GPU UUIDs and models, usage, health) is `None` there.
"""

from __future__ import annotations

from typing import Any

from shared.annotations import ALLOCATION, GPU_MEM_IDX, GPU_MEM_POD, RESOURCE_COUNT, RESOURCE_MEM, parse_allocation
from shared.dra import DRIVER, MEMORY
from shared.dra.quantity import QuantityError, parse_quantity
from shared.kube import pods
from shared.ledger.rules import gpu_charges
from shared.settings import MemoryUnit

MODEL_LABEL = "gpushare.io/gpu-model"  # the node agent's label (a model name, or `mixed`)


def _count(value: Any) -> int:
    try:
        return max(int(str(value).strip()), 0)
    except (TypeError, ValueError):
        return 0


def _address(node: dict[str, Any]) -> str:
    for address in (node.get("status") or {}).get("addresses") or []:
        if address.get("type") == "InternalIP":
            return str(address.get("address") or "")
    return ""


def gpu_layout(node: dict[str, Any], unit: MemoryUnit) -> list[int]:
    """Each GPU's memory in MiB from the node's capacity (empty: not a GPU-sharing node).

    Like gpushare: `aliyun.com/gpu-count` GPUs (1 when the count is missing), each with an equal, whole number
    of units of `aliyun.com/gpu-mem`.
    """
    capacity = (node.get("status") or {}).get("capacity") or {}
    units = _count(capacity.get(RESOURCE_MEM))
    if units <= 0:
        return []
    count = _count(capacity.get(RESOURCE_COUNT)) or 1
    return [units // count * unit.mib] * count


def _attribute(device: dict[str, Any], name: str) -> Any:
    value = (device.get("attributes") or {}).get(name) or {}
    return next(iter(value.values()), None) if isinstance(value, dict) else None


def slice_layouts(slices: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    """node -> its GPUs from gpushare ResourceSlices (pure): `index`, `memory_mib`, `model`, `uuid`, by index."""
    out: dict[str, list[dict[str, Any]]] = {}
    for item in slices:
        spec = item.get("spec") or {}
        if spec.get("driver") != DRIVER or not spec.get("nodeName"):
            continue
        gpus = []
        for position, device in enumerate(spec.get("devices") or []):
            try:
                memory = parse_quantity(((device.get("capacity") or {}).get(MEMORY) or {}).get("value"))
            except QuantityError:
                continue
            index = _attribute(device, "index")
            gpus.append(
                {
                    "index": index if isinstance(index, int) else position,
                    "memory_mib": int(memory) // 2**20,
                    "model": _attribute(device, "model"),
                    "uuid": _attribute(device, "uuid"),
                }
            )
        out[str(spec["nodeName"])] = sorted(gpus, key=lambda g: g["index"])
    return out


def pod_shares(pod: dict[str, Any], unit: MemoryUnit) -> dict[int | None, int] | None:
    """MiB the pod holds per GPU index (`None`: pending, no GPU known), or None when it holds nothing here."""
    notes = pods.annotations(pod)
    if ALLOCATION in notes:
        try:
            _, _, parts = parse_allocation(notes[ALLOCATION])
        except ValueError:
            parts = []
        if parts:
            index_of = {p.gpu_uuid: p.gpu_index for p in parts}
            shares: dict[int | None, int] = {}
            for uuid, (memory_mib, _compute) in gpu_charges(parts).items():
                shares[index_of[uuid]] = shares.get(index_of[uuid], 0) + memory_mib
            return shares
    limits = sum(c.amount for c in pods.container_amounts(pod, RESOURCE_MEM) if not c.init or c.sidecar)
    units = _count(notes.get(GPU_MEM_POD)) or limits
    if units <= 0:
        return None
    try:
        indices = sorted({int(i) for i in notes.get(GPU_MEM_IDX, "").split(",") if i.strip()})
    except ValueError:
        indices = []
    if not indices or min(indices) < 0:
        return {None: units * unit.mib}
    # gpushare never split a pod over GPUs; a list of indices without a record shares the amount equally
    per, rest = divmod(units * unit.mib, len(indices))
    return {index: per + (rest if n == 0 else 0) for n, index in enumerate(indices)}


def nodes_from_cluster(
    nodes: list[dict[str, Any]],
    pod_list: list[dict[str, Any]],
    unit: MemoryUnit,
    slices: list[dict[str, Any]] | None = None,
) -> list[dict]:
    """API-shaped nodes (as `/v1/nodes/{name}` answers, in MiB) from Kubernetes nodes and pods (JSON dicts), and
    the gpushare ResourceSlices of DRA nodes."""
    dra = slice_layouts(slices or [])
    out: dict[str, dict[str, Any]] = {}
    node: dict[str, Any] | None
    for node in sorted(nodes, key=lambda n: pods.metadata(n).get("name", "")):
        name = str(pods.metadata(node).get("name") or "")
        model = (pods.metadata(node).get("labels") or {}).get(MODEL_LABEL)
        gpus = [
            {"uuid": None, "index": i, "model": model if model and model != "mixed" else None, "memory_mib": mib}
            for i, mib in enumerate(gpu_layout(node, unit))
        ] or dra.get(name, [])
        if not gpus:
            continue
        out[name] = {
            "name": name,
            "address": _address(node),
            "memory_mib": sum(g["memory_mib"] for g in gpus),
            "gpu_count": len(gpus),
            "pending_memory_mib": 0,
            "gpus": [
                {**g, "allocated_memory_mib": 0, "used_memory_mib": None, "healthy": None}
                for g in sorted(gpus, key=lambda g: g["index"])
            ],
            "allocations": [],
        }
    for pod in sorted(
        pod_list, key=lambda p: (pods.metadata(p).get("namespace", ""), pods.metadata(p).get("name", ""))
    ):
        node = out.get(pods.node_name(pod))
        if node is None or pods.is_terminated(pod):
            continue
        shares = pod_shares(pod, unit)
        if not shares:
            continue
        by_index = {g["index"]: g for g in node["gpus"]}
        parts = []
        for index, memory_mib in sorted(shares.items(), key=lambda kv: -1 if kv[0] is None else kv[0]):
            gpu = by_index.get(index) if index is not None else None
            if gpu is not None:
                gpu["allocated_memory_mib"] += memory_mib
            else:
                node["pending_memory_mib"] += memory_mib
            where = {"gpu_uuid": gpu["uuid"], "gpu_index": index} if gpu else {"gpu_uuid": None, "gpu_index": None}
            parts.append({**where, "memory_mib": memory_mib})
        meta = pods.metadata(pod)
        node["allocations"].append(
            {
                "pod_uid": pods.pod_uid(pod),
                "pod_name": str(meta.get("name") or ""),
                "namespace": str(meta.get("namespace") or ""),
                "terminating_at": meta.get("deletionTimestamp"),
                "parts": parts,
            }
        )
    return list(out.values())
