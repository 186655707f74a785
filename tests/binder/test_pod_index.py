"""The binder's index of GPU pods as the watch last showed them (pure)."""

from __future__ import annotations

from services.binder.decide import Action, decide
from services.binder.pod_index import binder_index


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
