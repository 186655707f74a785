"""DRA nodes in the views that read Kubernetes rather than the ledger: `inspect` when accounting is unreachable (the
API server alone: a DRA node advertises no aliyun.com/* capacity, its GPUs are its gpushare ResourceSlice's devices)
and `/v1/quotas` (Kubernetes' own quota on DRA claims counts the gpushare class's devices)."""

from __future__ import annotations

import json

from services.accounting import inspect_cluster, inspect_view
from services.accounting.resource_quotas import DRA_DEVICES, gpu_quota_rows
from shared.dra.slices import resource_slice, slice_spec
from shared.events.catalogue import AllocationPart, GpuInfo
from shared.settings import MemoryUnit

from .test_inspect import k8s_node, k8s_pod

GIB = 1024


def dra_slice(node: str) -> dict:
    gpus = [
        GpuInfo(uuid="GPU-T4", index=0, model="Tesla-T4", memory_mib=16 * GIB, memory_total_mib=16 * GIB),
        GpuInfo(uuid="GPU-A100", index=1, model="A100-SXM4", memory_mib=40 * GIB, memory_total_mib=40 * GIB),
    ]
    return resource_slice(node, "uid-1", slice_spec(node, gpus, MemoryUnit.GIB, generation=1))


def test_inspect_from_the_api_server_shows_dra_nodes_from_their_slices() -> None:
    part = AllocationPart(container="main", container_index=0, gpu_uuid="GPU-A100", gpu_index=1, memory_mib=4 * GIB)
    record = json.dumps({"id": "00000000-0000-0000-0000-000000000002", "node": "dra", "parts": [part.model_dump()]})
    dra_pod = k8s_pod("bert", "dra", [], {"gpushare.io/allocation": record, "ALIYUN_COM_GPU_MEM_IDX": "1"})
    nodes = [k8s_node("dp", 16, 1, "10.0.0.1"), k8s_node("dra", None, None, "10.0.0.2"), k8s_node("cpu", None)]
    pods = [dra_pod, k8s_pod("resnet", "dp", [2], {"ALIYUN_COM_GPU_MEM_IDX": "0"})]
    other_driver = {"spec": {"driver": "gpu.nvidia.com", "nodeName": "cpu", "devices": [{"name": "x"}]}}
    dp, dra = inspect_cluster.nodes_from_cluster(nodes, pods, MemoryUnit.GIB, [dra_slice("dra"), other_driver])
    assert dp["name"] == "dp" and dra["name"] == "dra"
    assert [(g["index"], g["uuid"], g["model"], g["memory_mib"], g["allocated_memory_mib"]) for g in dra["gpus"]] == [
        (0, "GPU-T4", "Tesla-T4", 16 * GIB, 0),
        (1, "GPU-A100", "A100-SXM4", 40 * GIB, 4 * GIB),
    ]
    assert dra["allocations"][0]["parts"] == [{"gpu_uuid": "GPU-A100", "gpu_index": 1, "memory_mib": 4 * GIB}]
    detail = inspect_view.details([dra], "GiB")
    assert "bert" in detail and "4/56" in detail


def test_kubernetes_quota_on_the_gpushare_device_class_is_shown() -> None:
    items = [
        {
            "metadata": {"namespace": "team", "name": "dra"},
            "status": {
                "hard": {DRA_DEVICES: "8", "count/resourceclaims.resource.k8s.io": "20"},
                "used": {DRA_DEVICES: "3"},
            },
        }
    ]
    assert gpu_quota_rows(items) == [
        {"namespace": "team", "name": "dra", "key": DRA_DEVICES, "resource": DRA_DEVICES, "hard": 8, "used": 3}
    ]
