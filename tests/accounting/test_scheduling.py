"""Scheduling waits from the pods' own timestamps: once per pod across restarts and replicas (claims in the real
PostgreSQL), pods bound while accounting was away found by the next listing, pending pods' waits from creation.

The pods are shaped as kube-apiserver serves them: `creationTimestamp` and condition times in whole seconds, and
the Binding sets `PodScheduled` True with `lastTransitionTime` now (pkg/registry/core/pod/storage/storage.go,
`UpdatePodCondition`); a pod's earlier False condition (Unschedulable) is replaced by it.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta
from typing import Any

from sqlalchemy.ext.asyncio import AsyncEngine

from services.accounting.scheduling import SchedulingWaits, finished_wait
from shared.kube.watching import ADDED, DELETED, MODIFIED, SYNCED, WatchEvent

from .conftest import Stack

# The pods' times, a day after the run: the seeded ledger records its refusals at the real time, and the tests
# order kube-scheduler's verdicts (at T0 + n s) after them. A fixed date turned into the past on that day at 10:00
# UTC, and the order with it.
T0 = datetime.now(UTC).replace(microsecond=0) + timedelta(days=1)


def stamp(t: datetime) -> str:
    return t.strftime("%Y-%m-%dT%H:%M:%SZ")


def pod(name: str, *, created: datetime, bound: datetime | None = None, gpu: bool = True, ns: str = "ml") -> dict:
    limits = {"aliyun.com/gpu-mem": "2"} if gpu else {"cpu": "1"}
    body: dict[str, Any] = {
        "metadata": {"name": name, "namespace": ns, "uid": f"uid-{name}", "creationTimestamp": stamp(created)},
        "spec": {"containers": [{"name": "c", "resources": {"limits": limits}}]},
        "status": {
            "phase": "Pending",
            "conditions": [
                {
                    "type": "PodScheduled",
                    "status": "False",
                    "reason": "Unschedulable",
                    "lastTransitionTime": stamp(created),
                }
            ],
        },
    }
    if bound is not None:
        body["spec"]["nodeName"] = "node-1"
        body["status"]["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": stamp(bound)}]
    return body


def test_a_wait_ends_when_the_pod_is_bound_or_deleted_unbound() -> None:
    now = T0 + timedelta(minutes=5)
    done = finished_wait(MODIFIED, pod("a", created=T0, bound=T0 + timedelta(seconds=7)), now)
    assert done is not None and (done.outcome, done.seconds, done.namespace) == ("bound", 7.0, "ml")
    assert finished_wait(MODIFIED, pod("a", created=T0), now) is None  # still waiting
    gone = pod("b", created=T0)
    gone["metadata"]["deletionTimestamp"] = stamp(T0 + timedelta(seconds=40))
    done = finished_wait(DELETED, gone, now)
    assert done is not None and (done.outcome, done.seconds) == ("deleted", 40.0)
    assert finished_wait(MODIFIED, pod("c", created=T0, bound=T0, gpu=False), now) is None  # not a GPU pod
    static = pod("d", created=T0)
    static["spec"]["nodeName"], static["status"]["conditions"] = "node-1", []  # created bound: never scheduled
    assert finished_wait(ADDED, static, now) is None


async def test_each_pod_is_counted_once_across_restarts_and_none_bound_meanwhile_is_lost(engine: AsyncEngine) -> None:
    clock = {"now": T0 + timedelta(seconds=30)}
    seen: list[tuple[str, str, float]] = []

    def start() -> SchedulingWaits:
        return SchedulingWaits(engine, lambda *a: seen.append(a), horizon_s=3600, clock=lambda: clock["now"])

    first = start()
    first.handle(WatchEvent(ADDED, pod("fast", created=T0)))
    first.handle(WatchEvent(ADDED, pod("slow", created=T0 + timedelta(seconds=5))))
    first.handle(WatchEvent(ADDED, pod("cpu-only", created=T0, gpu=False)))
    first.handle(WatchEvent(SYNCED))
    assert first.waiting("uid-slow") == (T0 + timedelta(seconds=5), 25.0)
    assert first.waiting("uid-cpu-only") is None
    first.handle(WatchEvent(MODIFIED, pod("fast", created=T0, bound=T0 + timedelta(seconds=3))))
    first.handle(WatchEvent(MODIFIED, pod("fast", created=T0, bound=T0 + timedelta(seconds=3))))  # status updates
    assert await first.flush() == 1
    assert seen == [("ml", "bound", 3.0)] and first.waiting("uid-fast") is None

    # accounting restarts; meanwhile "slow" was bound and "gone" was created and deleted (that one is lost with
    # the API server's memory of it: no listing shows it)
    clock["now"] = T0 + timedelta(minutes=10)
    second = start()
    for body in (
        pod("fast", created=T0, bound=T0 + timedelta(seconds=3)),
        pod("slow", created=T0 + timedelta(seconds=5), bound=T0 + timedelta(minutes=2)),
        pod("late", created=T0 + timedelta(minutes=9)),
    ):
        second.handle(WatchEvent(ADDED, body))
    second.handle(WatchEvent(SYNCED))
    assert await second.flush() == 1  # "fast" was claimed before the restart: not counted again
    assert seen == [("ml", "bound", 3.0), ("ml", "bound", 115.0)]
    assert second.waiting("uid-late") == (T0 + timedelta(minutes=9), 60.0)  # from its creation, not our start

    # a pod deleted while waiting ends with outcome `deleted`; one no longer listed stops waiting
    late = pod("late", created=T0 + timedelta(minutes=9))
    second.handle(WatchEvent(DELETED, late))
    assert await second.flush() == 1 and seen[-1] == ("ml", "deleted", 60.0)
    second.handle(WatchEvent(ADDED, pod("vanishing", created=T0)))
    second.handle(WatchEvent(SYNCED))
    second.handle(WatchEvent(SYNCED))  # a relist without it: deleted while the watch was down
    assert second.waiting("uid-vanishing") is None

    # a replica beside it relisting the same pods counts nothing twice; a pod bound before the claims' horizon is
    # not counted at all (its claim may have been pruned)
    replica = start()
    replica.handle(WatchEvent(ADDED, pod("slow", created=T0 + timedelta(seconds=5), bound=T0 + timedelta(minutes=2))))
    replica.handle(WatchEvent(ADDED, pod("ancient", created=T0 - timedelta(days=2), bound=T0 - timedelta(days=2))))
    replica.handle(WatchEvent(SYNCED))
    assert await replica.flush() == 0 and len(seen) == 3


async def test_pending_pods_show_how_long_they_waited(seeded: Stack) -> None:
    waits = SchedulingWaits(seeded.engine, lambda *a: None, horizon_s=3600, clock=lambda: T0 + timedelta(seconds=95))
    huge = pod("huge-0", created=T0, ns="team-b")
    huge["metadata"]["uid"] = "uid-big"
    waits.handle(WatchEvent(ADDED, huge))
    before = (await seeded.client.get("/v1/pending")).json()["items"]
    assert [(p["created_at"], p["waiting_seconds"]) for p in before] == [(None, None)]  # no pod watch: not known
    seeded.app.state.scheduling = waits
    (item,) = (await seeded.client.get("/v1/pending")).json()["items"]
    assert (item["pod_name"], item["created_at"], item["waiting_seconds"]) == ("huge-0", T0.isoformat(), 95)
    view = (await seeded.client.get("/v1/pods/team-b/huge-0")).json()
    assert view["pending"]["waiting_seconds"] == 95


def refused_by_scheduler(pod_body: dict, message: str, *, since: datetime, reason: str = "Unschedulable") -> dict:
    """The pod as kube-scheduler leaves it after a failed attempt: PodScheduled False with its FailedScheduling
    message (pkg/scheduler/schedule_one.go, handleSchedulingFailure -> updatePod)."""
    pod_body["status"]["conditions"] = [
        {
            "type": "PodScheduled",
            "status": "False",
            "reason": reason,
            "message": message,
            "lastTransitionTime": stamp(since),
        }
    ]
    return pod_body


SHORT = (
    "0/2 nodes are available: 2 Insufficient aliyun.com/gpu-mem. preemption: 0/2 nodes are available: "
    "2 No preemption victims found for incoming pod."
)


async def test_pods_kube_scheduler_refuses_before_the_extender_sees_them_are_pending_with_its_reason(
    seeded: Stack,
) -> None:
    """kube-scheduler counts aliyun.com/gpu-mem per node (the shipped configuration): a node short of it in total
    never reaches the extender, so no refusal event names it; a pod every node refuses so was not listed at all."""
    now = T0 + timedelta(seconds=95)
    waits = SchedulingWaits(seeded.engine, lambda *a: None, horizon_s=3600, clock=lambda: now)
    short = refused_by_scheduler(pod("short-0", created=T0, ns="team-c"), SHORT, since=T0 + timedelta(seconds=2))
    gated = refused_by_scheduler(pod("gated-0", created=T0, ns="team-c"), "", since=T0, reason="SchedulingGated")
    fresh = pod("fresh-0", created=T0, ns="team-c")  # not tried yet: no message
    del fresh["status"]["conditions"]
    # bert-2 holds a reservation (its Binding on the way): kube-scheduler's word from an earlier attempt is stale
    placing = refused_by_scheduler(pod("bert-2", created=T0, ns="team-a"), SHORT, since=T0)
    placing["metadata"]["uid"] = "uid-b"
    for body in (short, gated, fresh, placing):
        waits.handle(WatchEvent(ADDED, body))
    waits.handle(WatchEvent(SYNCED))
    seeded.app.state.scheduling = waits

    items = (await seeded.client.get("/v1/pending")).json()["items"]
    # the latest refusal first: short-0's (T0 + 2 s) is later than the seeded extender refusal of huge-0
    assert [(p["pod_name"], p["source"]) for p in items] == [("short-0", "kube-scheduler"), ("huge-0", "extender")]
    item = items[0]
    assert item["summary"] == f"kube-scheduler: {SHORT}" and item["reasons"] == {}
    assert item["scheduler"] == {
        "reason": "Unschedulable",
        "message": SHORT,
        "since": (T0 + timedelta(seconds=2)).isoformat(),
    }
    assert (item["refused_at"], item["created_at"], item["waiting_seconds"]) == (
        (T0 + timedelta(seconds=2)).isoformat(),
        T0.isoformat(),
        95,
    )
    assert items[1]["scheduler"] is None  # the watch does not know huge-0
    assert [p["pod_name"] for p in (await seeded.client.get("/v1/pending?namespace=team-c")).json()["items"]] == [
        "short-0"
    ]
    view = (await seeded.client.get("/v1/pods/team-c/short-0")).json()
    assert view["status"] == "pending" and view["pod_uid"] == "uid-short-0" and view["allocations"] == []
    assert view["pending"]["summary"] == item["summary"] and view["last_refusal"]["source"] == "kube-scheduler"
    assert (await seeded.client.get("/v1/pods/team-c/gated-0")).status_code == 404
    assert (await seeded.client.get("/v1/pods/team-a/bert-2")).json()["status"] == "bound"
    assert (await seeded.client.get("/v1/cluster")).json()["pending_pods"] == 2
    metrics = (await seeded.client.get("/metrics")).text
    assert (
        'gpushare_pending_pods{reason="kube-scheduler: N/N nodes are available: N Insufficient aliyun.com/gpu-mem.'
        in metrics
    )


async def test_an_extender_refusal_carries_kube_schedulers_verdict_and_every_terminating_holder(
    seeded: Stack,
) -> None:
    """huge-0 was refused by the extender on node-0 and node-1; now kube-scheduler refuses node-1 by its total (a
    terminating holder still counts there), so the extender saw node-0 only: its verdict says both."""
    assert await seeded.ledger.mark_terminating("uid-c") == 1
    await seeded.settle()
    message = (
        "0/2 nodes are available: 1 Insufficient aliyun.com/gpu-mem, 1 node-0: needs 20 GiB on one GPU. preemption: "
        "0/2 nodes are available: 2 No preemption victims found for incoming pod."
    )
    huge = refused_by_scheduler(pod("huge-0", created=T0, ns="team-b"), message, since=T0)
    huge["metadata"]["uid"] = "uid-big"
    waits = SchedulingWaits(seeded.engine, lambda *a: None, horizon_s=3600, clock=lambda: T0 + timedelta(seconds=9))
    waits.handle(WatchEvent(ADDED, huge))
    seeded.app.state.scheduling = waits
    (item,) = (await seeded.client.get("/v1/pending")).json()["items"]
    assert item["source"] == "extender" and set(item["reasons"]) == {"node-0", "node-1"}
    assert item["scheduler"]["message"] == message and item["waiting_seconds"] == 9
    assert [h["pod_name"] for h in item["terminating_holders"]] == ["train-0"]
    view = (await seeded.client.get("/v1/pods/team-b/huge-0")).json()
    assert view["pending"]["scheduler"]["message"] == message


def test_kube_schedulers_verdict_is_read_from_the_condition_and_kept_short() -> None:
    from services.accounting.scheduling import MAX_MESSAGE, scheduler_verdict

    body = refused_by_scheduler(pod("p", created=T0), "x" * (MAX_MESSAGE + 10), since=T0)
    verdict = scheduler_verdict(body)
    assert verdict is not None and len(verdict.message) == MAX_MESSAGE and verdict.message.endswith("(cut here)")
    assert scheduler_verdict(refused_by_scheduler(pod("q", created=T0), "boom", since=T0, reason="SchedulerError"))
    assert scheduler_verdict(pod("r", created=T0)).message == "Unschedulable"  # no message: its reason
    assert scheduler_verdict(pod("s", created=T0, bound=T0)) is None
