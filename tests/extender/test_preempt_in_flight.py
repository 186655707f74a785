"""A preemption under way is waited for, not repeated elsewhere (real PostgreSQL and NATS for the view).

kube-scheduler 1.37 preempts asynchronously: it deletes the victims and may try the preemptor again tens of
milliseconds later, before the pod's `status.nominatedNodeName` shows and before the victims' shares are back in
the extender's view (the binder releases them from the pod deletion). Its own rule
(`DefaultPreemption.PodEligibleToPreemptOthers`, pkg/scheduler/framework/plugins/defaultpreemption in
k8s.io/kubernetes v1.37.2) waits while a lower-priority pod on the nominated node is terminating. The extender
waits the same way on the nominated node and on the nodes it answered victims on for the same preemptor a moment
before (`Preemptions`): otherwise the second attempt preempts on another node, and can evict a pod a
PodDisruptionBudget protects there (seen in tests/e2e/test_preemption.py once the release came late).
"""

from __future__ import annotations

from datetime import UTC, datetime

import httpx

from services.extender.preempt import Preemptions, nodes_to_read, preempt
from services.extender.service import ExtenderService
from services.extender.victims import Facts, PodFacts
from services.extender.wire import parse_preemption_args
from shared.ledger.ledger import Ledger
from shared.placement import Policy
from shared.settings import MemoryUnit
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args

NOW = datetime(2026, 12, 5, tzinfo=UTC)


def facts(uid: str, *, priority: int = 0, terminating: bool = False) -> PodFacts:
    return PodFacts(uid, "default", uid[:8], {}, priority, NOW, terminating)


async def _placed(client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService) -> dict[str, str]:
    """x and y, one 8 GiB GPU each, each holding a low-priority 6 GiB pod."""
    await add_node(ledger, "x", [8])
    await add_node(ledger, "y", [8])
    await service.resync("test")
    placed = {}
    for name, node in (("x-low", "x"), ("y-low", "y")):
        pod = gpu_pod(name, 6)
        await client.post(f"{PREFIX}/filter", json=names_args(pod, [node]))
        assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, node))).json() == {"Error": ""}
        placed[name] = pod["metadata"]["uid"]
    return placed


def _urgent(candidates: dict[str, list[str]], nominated: str = "") -> dict:
    pod = gpu_pod("urgent", 7, uid="urgent-uid")  # the same pod, tried again
    pod["spec"]["priority"] = 1000
    if nominated:
        pod["status"] = {"nominatedNodeName": nominated}
    meta = {node: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": 0} for node, uids in candidates.items()}
    return {"Pod": pod, "NodeNameToVictims": None, "NodeNameToMetaVictims": meta}


async def test_a_second_attempt_before_the_nomination_shows_waits_for_the_first_preemption(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    placed = await _placed(client, ledger, service)
    remembered = Preemptions()
    # first attempt: y's pod is the victim; the answer is remembered
    first = parse_preemption_args(_urgent({"y": [placed["y-low"]]}))
    listed = Facts({"y": [facts(placed["y-low"])]}, [])
    answer = preempt(service.view, first, listed, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW)
    assert set(answer["NodeNameToMetaVictims"]) == {"y"}
    remembered.answered(first.pod["metadata"]["uid"], frozenset(answer["NodeNameToMetaVictims"]))
    # kube-scheduler deleted y's victim; the view still holds its share; the pod comes back without a nomination
    again = parse_preemption_args(_urgent({"x": [placed["x-low"]]}))
    recent = remembered.recent(again.pod["metadata"]["uid"])
    assert recent == {"y"} and nodes_to_read(again, recent) == ["x", "y"]
    listed = Facts({"x": [facts(placed["x-low"])], "y": []}, [])
    waited = preempt(service.view, again, listed, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW, recent=recent)
    assert waited == {"NodeNameToMetaVictims": {}}  # not x's pod as well
    # nothing remembered (another extender replica answered the first time): kube-scheduler's own answer stands
    other = preempt(service.view, again, listed, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW)
    assert set(other["NodeNameToMetaVictims"]) == {"x"}
    # the release reached the view between the filter that refused y and this call: the pod fits y now, wait
    alloc = service.view.allocations[placed["y-low"]]
    await ledger.release(alloc.allocation_id, placed["y-low"], "y", "preempted")
    await service.resync("test")
    assert placed["y-low"] not in service.view.allocations
    waited = preempt(service.view, again, listed, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW, recent=recent)
    assert waited == {"NodeNameToMetaVictims": {}}


async def test_a_terminating_victim_on_the_nominated_node_is_waited_for(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    """As PodEligibleToPreemptOthers: a lower-priority pod terminating on the nominated node means wait (the old
    rule waited only for pods the API no longer listed)."""
    placed = await _placed(client, ledger, service)
    args = parse_preemption_args(_urgent({"x": [placed["x-low"]]}, nominated="y"))
    terminating = Facts({"x": [facts(placed["x-low"])], "y": [facts(placed["y-low"], terminating=True)]}, [])
    answer = preempt(service.view, args, terminating, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW)
    assert answer == {"NodeNameToMetaVictims": {}}
    # a terminating pod of higher priority than the preemptor is no victim of it: no reason to wait
    senior = Facts({"x": [facts(placed["x-low"])], "y": [facts(placed["y-low"], priority=5000, terminating=True)]}, [])
    answer = preempt(service.view, args, senior, unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=NOW)
    assert set(answer["NodeNameToMetaVictims"]) == {"x"}


def test_preemptions_are_remembered_for_a_while_and_bounded() -> None:
    memory = Preemptions(keep_s=60, size=2)
    memory.answered("a", frozenset({"n1"}), now=0)
    memory.answered("b", frozenset({"n2"}), now=1)
    memory.answered("none", frozenset(), now=1)  # an empty answer is nothing to wait for
    assert memory.recent("a", now=30) == {"n1"} and memory.recent("none", now=30) == frozenset()
    memory.answered("c", frozenset({"n3"}), now=2)  # the oldest goes
    assert memory.recent("a", now=30) == frozenset() and memory.recent("b", now=30) == {"n2"}
    assert memory.recent("c", now=61) == {"n3"} and memory.recent("c", now=63) == frozenset()
