"""A preemptor whose victims are gone waits for their shares instead of preempting a second node.

Seen on the real v1.37.2 kube-scheduler (tests/e2e/test_preemption.py): it evicts the victims on the node it picked
(deleted without a grace period, they leave nothing terminating behind), and retries the preemptor 0.1 s later. Its
cache no longer holds the victims, the extender's view still holds their shares until the binder's release lands,
so filter refuses that node and kube-scheduler preempts again, with the preemptor's `status.nominatedNodeName` not
yet in its informer (`DefaultPreemption.PodEligibleToPreemptOthers` and the preempt call read the pod from the
lister). The extender then answered the other node and kube-scheduler evicted its pods too, the one a
PodDisruptionBudget guards among them. The extender now remembers its own answers (`Evictions`) and waits while the
pod fits where kube-scheduler evicted, whether the shares are back yet or not.
"""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import httpx

from services.extender.preempt import Evictions, nodes_to_read, preempt
from services.extender.service import ExtenderService
from services.extender.victims import Facts, PodFacts
from services.extender.wire import parse_preemption_args
from shared.ledger.ledger import Ledger
from shared.placement import Policy
from shared.settings import MemoryUnit
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args

T0 = datetime(2026, 12, 6, 10, 0, tzinfo=UTC)
PRIORITY = {"vip": 2000, "mid": 500, "small": 10, "guarded": 10}


async def place(client: httpx.AsyncClient, name: str, node: str, gib: int) -> str:
    pod = gpu_pod(name, gib)
    await client.post(f"{PREFIX}/filter", json=names_args(pod, [node]))
    assert (await client.post(f"{PREFIX}/bind", json=bind_args(pod, node))).json() == {"Error": ""}
    return pod["metadata"]["uid"]


def facts(uids: dict[str, str], on: dict[str, list[str]]) -> Facts:
    """The pods the API lists per node (name -> uid known from placing them)."""
    return Facts(
        {
            node: [
                PodFacts(uids[n], "default", n, {}, PRIORITY[n.split("-")[1]], T0 + timedelta(seconds=i))
                for i, n in enumerate(names)
            ]
            for node, names in on.items()
        },
        [],
    )


def call(pod: dict, victims: dict[str, list[str]]) -> object:
    return parse_preemption_args(
        {
            "Pod": pod,
            "NodeNameToVictims": None,
            "NodeNameToMetaVictims": {
                n: {"Pods": [{"UID": u} for u in uids], "NumPDBViolations": 0} for n, uids in victims.items()
            },
        }
    )


async def test_a_preemptor_waits_where_it_evicted_instead_of_evicting_a_second_node(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    await add_node(ledger, "x", [8, 8])
    await add_node(ledger, "y", [8, 8])
    await service.resync("test")
    uids = {}
    for name, node, gib in (
        ("x-vip", "x", 6), ("x-guarded", "x", 4), ("x-small", "x", 2),
        ("y-vip", "y", 6), ("y-mid", "y", 4), ("y-small", "y", 2),
    ):  # fmt: skip
        uids[name] = await place(client, name, node, gib)
    urgent = gpu_pod("urgent", 6)
    urgent["spec"]["priority"] = 1000
    everyone = {"x": ["x-vip", "x-guarded", "x-small"], "y": ["y-vip", "y-mid", "y-small"]}
    now = [100.0]
    evictions = Evictions(ttl_s=60, clock=lambda: now[0])
    uid = urgent["metadata"]["uid"]

    def answer(victims: dict[str, list[str]], listed: dict[str, list[str]]) -> dict:
        args = call(urgent, {n: [uids[v] for v in vs] for n, vs in victims.items()})
        answered = evictions.recent(uid)
        assert set(nodes_to_read(args, answered)) >= set(answered)
        out = preempt(
            service.view, args, facts(uids, listed), unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=T0,
            answered=answered,
        )  # fmt: skip
        evictions.remember(uid, out)
        return out["NodeNameToMetaVictims"]

    # kube-scheduler's victims by the nodes' totals; GPU 1 must be emptied on either node
    first = answer({"x": ["x-small"], "y": ["y-small"]}, everyone)
    assert {n: [p["UID"] for p in v["Pods"]] for n, v in first.items()} == {
        "x": [uids["x-guarded"], uids["x-small"]],
        "y": [uids["y-mid"], uids["y-small"]],
    }
    # kube-scheduler picked y (no budget violated there) and deleted its victims; the preemptor comes back before its
    # nomination shows and before the binder released the shares: x is offered again
    after = {"x": everyone["x"], "y": ["y-vip"]}
    assert answer({"x": ["x-small"]}, after) == {}
    # the shares are back: it fits on y now, which a filter call with the old view did not see
    for name in ("y-mid", "y-small"):
        await ledger.release_pod(uids[name], "pod deleted")
    await service.resync("test")
    assert answer({"x": ["x-small"]}, after) == {}
    # the memory lasts EVICTION_MEMORY_S: a pod that never gets onto y (kube-scheduler refuses it there for reasons
    # of its own) preempts elsewhere after that
    now[0] += 61
    assert set(answer({"x": ["x-small"]}, after)) == {"x"}


def test_evictions_keep_answers_that_named_victims() -> None:
    now = [0.0]
    evictions = Evictions(size=2, ttl_s=10, clock=lambda: now[0])
    evictions.remember("p", {"NodeNameToMetaVictims": {"n": {"Pods": [{"UID": "v"}], "NumPDBViolations": 0}}})
    evictions.remember("p", {"NodeNameToMetaVictims": {}})  # the wait itself does not erase what it waits for
    assert evictions.recent("p") == {"n": frozenset({"v"})}
    evictions.remember("q", {"NodeNameToMetaVictims": {"m": {"Pods": [{"UID": "w"}], "NumPDBViolations": 0}}})
    evictions.remember("r", {"NodeNameToMetaVictims": {"m": {"Pods": [{"UID": "w"}], "NumPDBViolations": 0}}})
    assert evictions.recent("p") == {} and evictions.recent("q") == {"m": frozenset({"w"})}  # the last 2 kept
    now[0] = 11
    assert evictions.recent("q") == {}


async def test_a_terminating_victim_on_the_nominated_node_is_waited_for(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, binder: StandInBinder
) -> None:
    """As `PodEligibleToPreemptOthers`: a lower-priority pod terminating on the nominated node (deleted with a grace
    period, still listed) means wait; a terminating pod of higher priority than the preemptor is no victim of it."""
    await add_node(ledger, "x", [8])
    await add_node(ledger, "y", [8])
    await service.resync("test")
    uids = {name: await place(client, name, node, 6) for name, node in (("x-small", "x"), ("y-small", "y"))}
    urgent = gpu_pod("urgent", 7)
    urgent["spec"]["priority"] = 1000
    urgent["status"] = {"nominatedNodeName": "y"}
    args = call(urgent, {"x": [uids["x-small"]]})

    def listed(y_priority: int) -> Facts:
        return Facts(
            {
                "x": [PodFacts(uids["x-small"], "default", "x-small", {}, 10, T0)],
                "y": [PodFacts(uids["y-small"], "default", "y-small", {}, y_priority, T0, terminating=True)],
            },
            [],
        )

    waited = preempt(service.view, args, listed(10), unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=T0)
    assert waited == {"NodeNameToMetaVictims": {}}
    other = preempt(service.view, args, listed(5000), unit=MemoryUnit.GIB, policy=Policy.BINPACK, now=T0)
    assert set(other["NodeNameToMetaVictims"]) == {"x"}
