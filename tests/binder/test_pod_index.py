"""The binder's index of GPU pods as the watch last showed them (pure)."""

from __future__ import annotations

from datetime import datetime

from services.binder.claims import LATE_RECORD_S, recorded_late
from services.binder.decide import Action, decide
from services.binder.pod_index import binder_index, summary
from shared.dra.claims import read_claim
from shared.settings import MemoryUnit
from tests.dra.objects import claim, gpu, ledger_gpus, request
from tests.dra.objects import pod as dra_pod

GIB = MemoryUnit.GIB


def pod(name: str, uid: str, node: str = "", deleting: bool = False) -> dict:
    meta = {"name": name, "namespace": "ml", "uid": uid, "annotations": {"big": "x" * 1000}}
    if deleting:
        meta["deletionTimestamp"] = "2026-12-02T00:00:00Z"
    return {"metadata": meta, "spec": {"nodeName": node, "containers": [{"name": "c"}]}, "status": {"phase": "Pending"}}


def test_answers_only_after_the_first_list_and_keeps_what_decide_reads() -> None:
    index = binder_index()
    index.update("ADDED", pod("a", "u1"))
    assert index.get("ml", "a") is None  # not synced yet: the caller reads the pod
    index.synced()
    seen = index.get("ml", "a")
    assert seen is not None and "annotations" not in seen["metadata"] and "containers" not in seen["spec"]
    # what the annotations' follower compares before its conditional patch: gpushare's annotations, the version
    index.update(
        "MODIFIED",
        {
            **pod("a", "u1"),
            "metadata": {
                **pod("a", "u1")["metadata"],
                "resourceVersion": "9",
                "annotations": {"big": "x", "ALIYUN_COM_GPU_MEM_ASSIGNED": "true"},
            },
        },
    )
    seen = index.get("ml", "a")
    assert seen["metadata"]["annotations"] == {"ALIYUN_COM_GPU_MEM_ASSIGNED": "true"}
    assert seen["metadata"]["resourceVersion"] == "9"
    assert decide(state="reserved", pod=seen, pod_uid="u1", node="n1").action is Action.BIND
    assert decide(state="reserved", pod=seen, pod_uid="other", node="n1").action is Action.FAIL


def test_follows_binding_deletion_and_replacement() -> None:
    index = binder_index()
    index.synced()
    index.update("ADDED", pod("a", "u1"))
    index.update("MODIFIED", pod("a", "u1", node="n2"))
    assert decide(state="reserved", pod=index.get("ml", "a"), pod_uid="u1", node="n1").action is Action.FAIL
    index.update("MODIFIED", pod("a", "u1", node="n2", deleting=True))
    index.update("ADDED", pod("a", "u2"))  # a same-named replacement arrives before the old pod's DELETED
    index.update("DELETED", pod("a", "u1", node="n2", deleting=True))
    assert index.get("ml", "a")["metadata"]["uid"] == "u2"  # the late DELETED of the old pod removes nothing
    index.update("DELETED", pod("a", "u2"))
    assert index.get("ml", "a") is None and len(index) == 0


def test_a_relist_forgets_pods_deleted_while_the_watch_was_down() -> None:
    index = binder_index()
    for name in ("a", "b", "c"):
        index.update("ADDED", pod(name, f"u-{name}"))
    index.synced()
    index.update("MODIFIED", pod("c", "u-c", node="n1"))  # changed during the watch
    # the watch broke; a and c were deleted meanwhile; the relist shows only b
    index.update("ADDED", pod("b", "u-b"))
    index.synced()
    assert index.get("ml", "a") is None
    assert index.get("ml", "b") is not None
    # c changed during the last cycle, so it stays until the next relist; binding it would fail and be read
    index.update("ADDED", pod("b", "u-b"))  # every relist lists every live pod again
    index.synced()
    assert index.get("ml", "c") is None and index.get("ml", "b") is not None and len(index) == 1


def test_finds_a_pod_by_its_uid_and_never_a_same_named_replacement() -> None:
    index = binder_index()
    index.update("ADDED", pod("a", "u1"))
    index.synced()
    assert index.by_uid("u1")["metadata"]["name"] == "a"
    index.update("ADDED", pod("a", "u2"))  # a same-named replacement: u1 is gone
    assert index.by_uid("u1") is None and index.by_uid("u2")["metadata"]["uid"] == "u2"
    index.update("DELETED", pod("a", "u2"))
    assert index.by_uid("u2") is None and index.by_uid("nope") is None


def _claim_pod() -> tuple[dict, dict]:
    """A pod from a Deployment with an init container, a sidecar and two app containers on a template's claim,
    as the API server shows it (images, env, a second condition and more), and its allocated claim."""
    gpus = [gpu("n1", 0), gpu("n1", 1)]
    p = dra_pod(
        "trainer",
        [("main", "r-main"), ("logger", None)],
        inits=[("setup", "r-init", False), ("proxy", "r-side", True)],
        template="t1",
        claim_name="trainer-gpushare-x1",
        uid="u-dra",
    )
    p["metadata"]["ownerReferences"] = [{"kind": "ReplicaSet", "name": "trainer-5d", "controller": True}]
    p["metadata"]["annotations"] = {"big": "x" * 1000}
    p["spec"]["nodeName"] = "n1"
    p["spec"]["containers"][0]["env"] = [{"name": "A", "value": "b"}]
    p["status"]["conditions"] = [
        {"type": "Ready", "status": "False"},
        {"type": "PodScheduled", "status": "True", "lastTransitionTime": "2026-12-06T10:00:00Z"},
    ]
    c = claim(
        "trainer-gpushare-x1",
        "default",
        [request("r-init", "2Gi"), request("r-side", "1Gi"), request("r-main", "4Gi", "30")],
        [("r-init", gpus[0], "2Gi", "0"), ("r-side", gpus[0], "1Gi", "0"), ("r-main", gpus[1], "4Gi", "30")],
        node="n1",
        pod_uid="u-dra",
    )
    return p, c


def test_a_pod_with_claims_keeps_what_the_claim_gate_reads_so_the_gate_needs_no_get() -> None:
    """`read_claim` on the index's summary gives exactly what it gives on the whole pod: the claim gate reads the
    claim's pod from the index instead of the API server (services/binder/claims.py)."""

    p, c = _claim_pod()
    kept = summary(p)
    gpus = ledger_gpus([gpu("n1", 0), gpu("n1", 1)])
    assert read_claim(c, kept, gpus, GIB) == read_claim(c, p, gpus, GIB)
    assert "env" not in kept["spec"]["containers"][0] and "annotations" not in kept["metadata"]
    assert [x["type"] for x in kept["status"]["conditions"]] == ["PodScheduled"]
    assert "resourceClaims" not in summary(pod("plain", "u2"))["spec"]  # a pod without claims: as before


def test_a_record_is_late_five_seconds_after_the_bind() -> None:
    p, _ = _claim_pod()
    bound_at = datetime.fromisoformat("2026-12-06T10:00:00+00:00").timestamp()
    assert not recorded_late(p, bound_at + 1.0)
    assert recorded_late(p, bound_at + LATE_RECORD_S)
    assert not recorded_late({**p, "spec": {**p["spec"], "nodeName": ""}}, bound_at + 60)  # not bound: not late
    assert recorded_late({**p, "status": {}}, bound_at)  # bound, but when is unknown: late (annotate at once)
