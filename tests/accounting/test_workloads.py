"""Per-pod SM utilisation in accounting (REST, right-sizing) and workloads named by their controllers."""

from __future__ import annotations

import pytest

from services.accounting.owners import WorkloadNames, controller_of, derived_owner
from services.accounting.rightsizing import compute_advice
from shared.events.catalogue import UsageEvent, UsageSample
from shared.ledger.reservations import ReservationRequest

from .conftest import GIB, Stack, part


async def _pod(s: Stack, key: str, ns: str, name: str, gpu: str, mib: int, kind: str, owner: str, compute: int = 0):
    p = part(gpu, int(gpu[-1]), mib)
    if compute:
        p = p.model_copy(update={"compute": compute})
    r = await s.ledger.reserve(
        ReservationRequest(
            pod_uid=f"uid-{key}",
            namespace=ns,
            pod_name=name,
            node="node-0",
            parts=(p,),
            owner_kind=kind,
            owner_name=owner,
        )
    )
    await s.ledger.mark_bound(r.allocation_id, r.pod_uid, r.node)
    return r


async def _sample(s: Stack, key: str, ns: str, name: str, gpu: str, mib: int, sm: float | None) -> None:
    sample = UsageSample(
        gpu_uuid=gpu,
        pod_uid=f"uid-{key}",
        namespace=ns,
        pod_name=name,
        container="main",
        used_memory_mib=mib,
        utilization_pct=80.0,
        sm_utilization_pct=sm,
    )
    await s.bus.publish(UsageEvent(node="node-0", samples=[sample]))


async def test_sm_utilization_reaches_rest_and_right_sizing(seeded: Stack) -> None:
    """A notebook whose SMs idle (and its Deployment named, not its ReplicaSet), an inference pod with a gpu-core
    share it never fills, and a pod from an agent that could not measure SMs."""
    await _pod(seeded, "nb", "lab", "notebook-6c9f7d8b4-x2x9z", "GPU-0-0", 512, "ReplicaSet", "notebook-6c9f7d8b4")
    await _pod(seeded, "inf", "lab", "infer-0", "GPU-0-1", GIB, "StatefulSet", "infer", compute=30)
    await _pod(seeded, "old", "lab", "legacy-0", "GPU-0-1", GIB, "Job", "legacy")
    for sm in (0.0, 0.4):
        await _sample(seeded, "nb", "lab", "notebook-6c9f7d8b4-x2x9z", "GPU-0-0", 300, sm)
    for sm in (8.0, 12.0):
        await _sample(seeded, "inf", "lab", "infer-0", "GPU-0-1", 700, sm)
    await _sample(seeded, "old", "lab", "legacy-0", "GPU-0-1", 500, None)
    await seeded.settle()

    pods = {p["pod_name"]: p for p in (await seeded.client.get("/v1/usage/pods?namespace=lab")).json()["items"]}
    nb = pods["notebook-6c9f7d8b4-x2x9z"]
    assert (nb["owner_kind"], nb["owner_name"]) == ("Deployment", "notebook")  # not the ReplicaSet's hash
    assert (nb["allocated_memory_mib"], nb["used_memory_mib"], nb["sm_utilization_pct"]) == (512, 300, 0.4)
    assert (pods["infer-0"]["allocated_compute"], pods["infer-0"]["sm_utilization_pct"]) == (30, 12.0)
    assert pods["legacy-0"]["sm_utilization_pct"] is None and pods["legacy-0"]["used_memory_mib"] == 500

    view = (await seeded.client.get("/v1/pods/lab/infer-0")).json()
    assert view["usage"]["sm_utilization_pct"] == 12.0 and view["usage"]["used_memory_mib"] == 700
    assert view["usage"]["gpus"] == [
        {"gpu_uuid": "GPU-0-1", "container": "main", "used_memory_mib": 700, "sm_utilization_pct": 12.0}
    ]
    assert (await seeded.client.get("/v1/pods/team-b/huge-0")).json()["usage"] is None  # pending: nothing yet

    items = (await seeded.client.get("/v1/rightsizing?namespace=lab&step_mib=256")).json()["items"]
    by = {(i["owner_kind"], i["owner_name"]): i for i in items}
    notebook = by[("Deployment", "notebook")]
    assert notebook["compute_idle"] and (notebook["sm_mean_pct"], notebook["sm_peak_pct"]) == (0.2, 0.4)
    assert notebook["summary"] == (
        "allocates 512 MiB, peaks at 300 MiB: right-sized; "
        "its compute idles (SM peak 0.4 % of a GPU): scale it to zero while idle"
    )
    infer = by[("StatefulSet", "infer")]
    assert not infer["compute_idle"] and infer["recommended_compute"] == 14  # 12 % + 10 % headroom, rounded up
    assert infer["summary"].endswith("SM peak 12 % of its gpu-core 30: gpu-core 14")
    legacy = by[("Job", "legacy")]
    assert legacy["sm_peak_pct"] is None and not legacy["compute_idle"] and ";" not in legacy["summary"]
    workloads = (await seeded.client.get("/v1/usage/workloads?namespace=lab")).json()["items"]
    assert ("Deployment", "notebook") in {(w["owner_kind"], w["owner_name"]) for w in workloads}


@pytest.mark.parametrize(
    ("kind", "name", "owner"),
    [
        ("ReplicaSet", "bert-training-5c9d7f6b8", ("Deployment", "bert-training")),
        ("ReplicaSet", "resnet-inference-6447cf96d4", ("Deployment", "resnet-inference")),
        ("ReplicaSet", "web-v2", None),  # a ReplicaSet a person named: kept
        ("ReplicaSet", "cache-4bcdf9", None),  # a leading zero cannot be: not a hash
        ("ReplicaSet", "api-5b9", None),  # too short to tell from a chosen name
        ("StatefulSet", "db-5c9d7f6b8", None),
        ("Job", "train", None),
    ],
)
def test_deployments_are_derived_from_replica_set_names(kind: str, name: str, owner: tuple | None) -> None:
    assert derived_owner(kind, name) == owner


def test_the_replica_sets_own_controller_is_read_first() -> None:
    rs = {"metadata": {"ownerReferences": [{"kind": "Deployment", "name": "bert", "controller": True}]}}
    assert controller_of(rs) == ("Deployment", "bert")
    assert controller_of({"metadata": {"ownerReferences": [{"kind": "Deployment", "name": "x"}]}}) is None
    assert controller_of({"metadata": {}}) is None


async def test_without_kubernetes_names_come_from_the_replica_set_names() -> None:
    names = WorkloadNames(kubernetes=False)
    keys = {("a", "ReplicaSet", "bert-5c9d7f6b8"), ("a", "ReplicaSet", "web-v2"), ("a", "Job", "train")}
    assert await names.resolve(keys) == {("a", "ReplicaSet", "bert-5c9d7f6b8"): ("Deployment", "bert")}


@pytest.mark.parametrize(
    ("peak", "compute", "idle", "recommended", "text"),
    [
        (None, 30, False, None, ""),
        (0.0, 0, True, None, "its compute idles (SM peak 0.0 % of a GPU): scale it to zero while idle"),
        (40.0, 0, False, None, ""),
        (20.0, 50, False, 22, "SM peak 20 % of its gpu-core 50: gpu-core 22"),
        (46.0, 50, False, None, ""),
        (75.0, 50, False, None, "SM peak 75 % exceeds its gpu-core 50"),
    ],
)
def test_compute_advice(peak, compute, idle, recommended, text) -> None:  # type: ignore[no-untyped-def]
    advice = compute_advice(peak, compute)
    assert (advice.idle, advice.recommended_compute, advice.text) == (idle, recommended, text)
