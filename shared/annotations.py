"""Pod annotations: gpushare's compatible set plus the project's own allocation record.

Existing gpushare tools read the `ALIYUN_COM_GPU_MEM_*` keys (values are strings, memory in the
configured resource unit). The project's own `gpushare.io/allocation` annotation carries the full
allocation as JSON: enough for the node agent and for reconciliation to rebuild the ledger entry.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any

from shared.events.catalogue import AllocationPart
from shared.ledger.rules import long_running
from shared.settings import MemoryUnit

GPU_MEM_IDX = "ALIYUN_COM_GPU_MEM_IDX"
GPU_MEM_POD = "ALIYUN_COM_GPU_MEM_POD"
GPU_MEM_DEV = "ALIYUN_COM_GPU_MEM_DEV"
GPU_MEM_ASSIGNED = "ALIYUN_COM_GPU_MEM_ASSIGNED"
GPU_MEM_ASSUME_TIME = "ALIYUN_COM_GPU_MEM_ASSUME_TIME"
ALLOCATION = "gpushare.io/allocation"

# Scheduling hints a pod may carry (documented in docs/extender.md).
GPU_MODEL_INCLUDE = "gpushare.io/gpu-model-include"
GPU_MODEL_EXCLUDE = "gpushare.io/gpu-model-exclude"
GPU_UUID_INCLUDE = "gpushare.io/gpu-uuid-include"
GPU_UUID_EXCLUDE = "gpushare.io/gpu-uuid-exclude"
MIN_CUDA_VERSION = "gpushare.io/min-cuda-version"
POLICY = "gpushare.io/policy"

RESOURCE_MEM = "aliyun.com/gpu-mem"
RESOURCE_CORE = "aliyun.com/gpu-core"
RESOURCE_COUNT = "aliyun.com/gpu-count"
RESOURCES = (RESOURCE_MEM, RESOURCE_CORE, RESOURCE_COUNT)  # the extended resources gpushare serves


def allocation_record(
    allocation_id: uuid.UUID, node: str, parts: list[AllocationPart], version: int = 1
) -> dict[str, Any]:
    """The JSON body of the `gpushare.io/allocation` annotation (`version`: the ledger's, raised by exchanges)."""
    return {
        "id": str(allocation_id),
        "node": node,
        "version": version,
        "parts": [p.model_dump() for p in parts],
    }


def record_version(value: str | None) -> int:
    """The version of a `gpushare.io/allocation` annotation (records written before versions: 1; none: 0)."""
    if not value:
        return 0
    try:
        raw = json.loads(value)
        return int(raw.get("version", 1)) if isinstance(raw, dict) else 0
    except (ValueError, TypeError):
        return 0


def parse_allocation(value: str) -> tuple[uuid.UUID, str, list[AllocationPart]]:
    """Read a `gpushare.io/allocation` annotation; raises ValueError naming the problem."""
    try:
        raw = json.loads(value)
        return uuid.UUID(raw["id"]), str(raw["node"]), [AllocationPart.model_validate(p) for p in raw["parts"]]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"unreadable {ALLOCATION} annotation: {exc}") from None


def record_annotations(
    allocation_id: uuid.UUID,
    node: str,
    parts: list[AllocationPart],
    gpu_memory_mib: dict[str, int],
    unit: MemoryUnit,
    *,
    version: int = 1,
) -> dict[str, str]:
    """The annotations that describe where the allocation is: gpushare's GPU index, pod and device memory,
    and the project's full record.

    `gpu_memory_mib` maps GPU UUID to that GPU's schedulable memory (for `ALIYUN_COM_GPU_MEM_DEV`).
    `ALIYUN_COM_GPU_MEM_IDX` is the GPU index, or the comma-separated indices when the pod spans GPUs
    (which gpushare never supported, so no existing tool depends on the single-value form there).
    """
    app_parts = [p for p in parts if long_running(p)] or parts
    indices = sorted({p.gpu_index for p in app_parts})
    first_gpu = min(app_parts, key=lambda p: p.gpu_index).gpu_uuid
    pod_total_mib = sum(p.memory_mib for p in app_parts)
    return {
        GPU_MEM_IDX: ",".join(str(i) for i in indices),
        GPU_MEM_POD: str(pod_total_mib // unit.mib),
        GPU_MEM_DEV: str(gpu_memory_mib.get(first_gpu, 0) // unit.mib),
        ALLOCATION: json.dumps(allocation_record(allocation_id, node, parts, version), separators=(",", ":")),
    }


def binding_annotations(
    allocation_id: uuid.UUID,
    node: str,
    parts: list[AllocationPart],
    gpu_memory_mib: dict[str, int],
    unit: MemoryUnit,
    *,
    now_ns: int | None = None,
) -> dict[str, str]:
    """All annotations written with the Binding: the record (version 1) and gpushare's not-yet-assigned flag."""
    return {
        **record_annotations(allocation_id, node, parts, gpu_memory_mib, unit),
        GPU_MEM_ASSIGNED: "false",
        GPU_MEM_ASSUME_TIME: str(now_ns if now_ns is not None else time.time_ns()),
    }
