"""Why a rewritten DRA pod waits reaches accounting: the binder's pod watch publishes kube-scheduler's PodScheduled
message as a `refused` event on the real bus (services/binder/dra_pending.py), once per message, again while the
pod keeps waiting, and never for pods gpushare admission did not rewrite."""

from __future__ import annotations

from services.binder.dra_pending import REPUBLISH_S, DraPending, scheduling_refusal
from shared.dra.admission import DEMAND_ANNOTATION
from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent
from shared.kube.watching import DELETED
from shared.ledger.replay import read_events

MESSAGE = "0/2 nodes are available: 1 cannot allocate all claims, 1 node(s) didn't match Pod's node affinity."


def pod(*, rewritten: bool = True, reason: str = "Unschedulable", message: str = MESSAGE, node: str = "") -> dict:
    annotations = {DEMAND_ANNOTATION: "{}"} if rewritten else {}
    condition = {"type": "PodScheduled", "status": "False", "reason": reason, "message": message}
    return {
        "metadata": {"name": "bert-abc", "namespace": "team", "uid": "uid-1", "annotations": annotations},
        "spec": {"nodeName": node} if node else {},
        "status": {"phase": "Pending", "conditions": [condition]},
    }


async def refusals(bus: EventBus) -> list[RefusedEvent]:
    found = [e async for e in read_events(bus, stream=bus.names.samples_stream, idle_timeout_s=2)]
    return [e for e in found if isinstance(e, RefusedEvent)]


def test_the_refusal_is_kube_schedulers_message_while_unbound() -> None:
    assert scheduling_refusal(pod()) == MESSAGE
    assert scheduling_refusal(pod(reason="SchedulerError", message="binding condition failed: QuotaExceeded")) == (
        "binding condition failed: QuotaExceeded"
    )
    assert scheduling_refusal(pod(node="n1")) is None
    assert scheduling_refusal(pod(reason="SchedulingGated")) is None


async def test_published_once_per_message_again_when_due_and_forgotten_once_placed(bus: EventBus) -> None:
    now = [1000.0]
    pending = DraPending(bus, clock=lambda: now[0])
    assert await pending.on_pod("ADDED", pod())
    assert not await pending.on_pod("MODIFIED", pod())  # the same message: nothing new
    assert not await pending.on_pod("MODIFIED", pod(rewritten=False))  # not gpushare admission's pod
    assert await pending.on_pod("MODIFIED", pod(message="0/2 nodes are available: 2 cannot allocate all claims."))
    assert await pending.republish() == 0
    now[0] += REPUBLISH_S
    assert await pending.republish() == 1
    assert await pending.on_pod("MODIFIED", pod(node="n1")) is False and not pending.waiting
    events = await refusals(bus)
    assert {(e.pod_uid, e.namespace, e.pod_name, e.source) for e in events} == {("uid-1", "team", "bert-abc", "binder")}
    assert [e.summary for e in events] == [
        f"kube-scheduler (DRA): {MESSAGE}",
        "kube-scheduler (DRA): 0/2 nodes are available: 2 cannot allocate all claims.",
        "kube-scheduler (DRA): 0/2 nodes are available: 2 cannot allocate all claims.",
    ]


async def test_a_deleted_pod_is_forgotten(bus: EventBus) -> None:
    pending = DraPending(bus)
    await pending.on_pod("ADDED", pod())
    assert await pending.on_pod(DELETED, pod()) is False and not pending.waiting
