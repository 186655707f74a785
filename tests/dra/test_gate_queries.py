"""The binder's claim gate against real PostgreSQL: a claim's events that cannot change what the ledger holds cost
no ledger query (benchmark 12 counted six or seven claim events per DRA pod, each a query), and a claim
deallocated while nobody watched is still ended by reconciliation. No API call is made on these paths: the gate's
Kubernetes client is never used here."""

from __future__ import annotations

import asyncio
import copy
import uuid
from datetime import UTC, datetime
from typing import Any

import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from sqlalchemy import event, select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.binder import claims as claims_module
from services.binder.claims import ClaimGate, live_claim_allocations
from services.binder.lifecycle import Lifecycle
from services.binder.metrics import BinderMetrics
from services.binder.pod_index import binder_index
from shared.dra.claims import our_results, read_claim
from shared.dra.conditions import status_apply
from shared.events.catalogue import InventoryEvent
from shared.kube.retry import RetryPolicy
from shared.kube.watching import ADDED, DELETED, MODIFIED, WatchEvent
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations
from shared.settings import MemoryUnit
from tests.dra.objects import claim, gpu, ledger_gpus, pod, request

NODE = "dra-node"
GPUS = [gpu(NODE, 0)]


def _lookups(engine: AsyncEngine, marker: str = "allocations.claim_uid") -> list[str]:
    """Every ledger lookup whose text holds `marker` the engine runs from now on (the statements, as sent): by
    default the lookups of a claim's allocations."""
    seen: list[str] = []

    def before(conn: Any, cursor: Any, statement: str, *args: Any) -> None:
        if statement.lstrip().upper().startswith("SELECT") and marker in statement:
            seen.append(statement)

    event.listen(engine.sync_engine, "before_cursor_execute", before)
    return seen


async def _recorded(ledger: Ledger, name: str) -> tuple[dict[str, Any], uuid.UUID]:
    """A claim allocated by kube-scheduler, recorded in the ledger and carrying the gate's LedgerReserved."""
    p = pod(name, [("main", "r")], namespace="team")
    c = claim(f"{name}-gpushare", "team", [request("r", "4Gi")], [("r", GPUS[0], "4Gi", "0")], node=NODE)
    c["status"]["reservedFor"] = [{"resource": "pods", "name": name, "uid": p["metadata"]["uid"]}]
    allocation = read_claim(c, p, ledger_gpus(GPUS), MemoryUnit.GIB)
    await ledger.reserve_claim(allocation.event(source="test"))
    applied = status_apply(c, our_results(c), reserved=True, reason="Recorded", message="recorded")
    c["status"]["devices"] = applied["status"]["devices"]
    return c, allocation.allocation_id


def _deallocated(c: dict[str, Any]) -> dict[str, Any]:
    """The claim once the resourceclaim controller took its reservation and allocation away."""
    out = copy.deepcopy(c)
    out["status"] = {}
    return out


async def _state(engine: AsyncEngine, allocation_id: uuid.UUID) -> str:
    async with engine.connect() as conn:
        return str((await conn.execute(select(allocations.c.state).where(allocations.c.id == allocation_id))).scalar())


@pytest.fixture
async def gate(engine: AsyncEngine):  # type: ignore[no-untyped-def]
    ledger = Ledger(engine, prefix="t")
    await ledger.record(InventoryEvent(node=NODE, gpus=GPUS, allocator="dra"))  # type: ignore[arg-type]
    api = client.ApiClient()
    g = ClaimGate(ledger, api, unit=MemoryUnit.GIB, metrics=BinderMetrics())
    g.served = True
    yield g
    await g.close()
    await api.close()


async def _handled(gate: ClaimGate, *events: tuple[str, dict[str, Any]]) -> None:
    """Hand the gate watch events, as its watch does, and wait until it handled them all."""
    for kind, obj in events:
        gate.submit(kind, obj)
        await _drained(gate)
    await _drained(gate)


async def _drained(gate: ClaimGate) -> None:
    while gate._tasks:
        await asyncio.gather(*list(gate._tasks))


async def test_a_claim_never_allocated_costs_no_ledger_query(gate: ClaimGate, engine: AsyncEngine) -> None:
    fresh = claim("idle-gpushare", "team", [request("r", "4Gi")], [], node=NODE)
    lookups = _lookups(engine)
    # created by the resourceclaim controller, a finalizer added, deleted with its pod before it was scheduled
    await _handled(gate, (ADDED, fresh), (MODIFIED, fresh), (DELETED, fresh))
    assert lookups == []


async def test_a_recorded_claim_is_looked_up_when_something_may_have_changed_and_ended_once(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    reserved, allocation_id = await _recorded(gate.ledger, "p1")
    lookups = _lookups(engine)
    await _handled(gate, (MODIFIED, reserved))  # first sight of it in this term: looked up, found recorded
    assert len(lookups) == 1 and await _state(engine, allocation_id) == "reserved"
    await _handled(gate, (MODIFIED, reserved), (MODIFIED, reserved))  # the gate's own condition, a finalizer
    assert len(lookups) == 1
    gone = _deallocated(reserved)
    await _handled(gate, (MODIFIED, gone))  # deallocated: the allocation it found is ended, with no lookup
    assert len(lookups) == 1 and await _state(engine, allocation_id) == "failed"  # it never bound
    await _handled(gate, (MODIFIED, gone), (DELETED, gone))  # its finalizer removed, then deleted
    assert len(lookups) == 1
    assert await live_claim_allocations(engine) == []


async def test_a_claim_deallocated_while_nobody_watched_is_ended_by_reconciliation(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """The gate takes a claim it first sees without an allocation to hold nothing; the reconciliation that follows
    every (re)list reads the ledger and hands it back to be checked."""
    reserved, allocation_id = await _recorded(gate.ledger, "p2")
    gone = _deallocated(reserved)
    await _handled(gate, (ADDED, gone))  # as a relist delivers it
    assert await _state(engine, allocation_id) == "reserved"
    uid = gone["metadata"]["uid"]
    await gate._reconcile_with({uid: gone}, await live_claim_allocations(engine))
    await _handled(gate)
    assert await _state(engine, allocation_id) == "failed"
    assert await live_claim_allocations(engine) == []


async def test_a_claim_released_with_its_pod_costs_no_query_when_it_is_deallocated(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """Without the gate the pod watch usually ends the allocation first (the pod is gone before the resourceclaim
    controller deallocates its claim): told so, the gate's deallocation costs no query and ends nothing twice."""
    reserved, allocation_id = await _recorded(gate.ledger, "p3")
    await _handled(gate, (MODIFIED, reserved))
    lookups = _lookups(engine)
    p3 = reserved["status"]["reservedFor"][0]["uid"]
    assert await gate.ledger.release_pod(p3, "pod deleted") == 1  # the pod watch's release
    gate.released_with_pod(reserved["metadata"]["uid"])
    await _handled(gate, (MODIFIED, _deallocated(reserved)), (DELETED, _deallocated(reserved)))
    assert lookups == [] and await _state(engine, allocation_id) == "released"


def _pod_lookups(engine: AsyncEngine) -> list[str]:
    """Every ledger lookup of a pod's live allocations from now on (`Ledger.release_pod`'s read)."""
    return _lookups(engine, "allocations.pod_uid =")


def _lifecycle(gate: ClaimGate) -> Lifecycle:
    """The binder's pod watch, handing DRA pods to `gate` as the binder wires them."""
    watch = Lifecycle(gate.ledger, gate.api, metrics=BinderMetrics())
    watch.claims = gate
    return watch


def _pod_of(c: dict[str, Any]) -> dict[str, Any]:
    """The (bound) pod the claim is reserved for, as the pod watch shows it."""
    consumer = c["status"]["reservedFor"][0]
    p = pod(consumer["name"], [("main", "r")], namespace=c["metadata"]["namespace"])
    p["metadata"]["uid"] = consumer["uid"]
    p["spec"]["nodeName"] = NODE
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")  # bound just now: the record is on time, no API write
    p.setdefault("status", {})["conditions"] = [{"type": "PodScheduled", "status": "True", "lastTransitionTime": now}]
    return p


async def test_a_pod_whose_claim_ended_its_allocation_costs_no_query_when_it_is_deleted(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """The other order: the resourceclaim controller deallocated the claim before the pod watch saw the pod go. The
    gate ended the allocation, so the pod's deletion needs no lookup (before: one `release_pod` read per pod)."""
    reserved, allocation_id = await _recorded(gate.ledger, "p4")
    await _handled(gate, (MODIFIED, reserved))
    await _handled(gate, (MODIFIED, _deallocated(reserved)))
    assert await _state(engine, allocation_id) == "failed"
    lookups = _pod_lookups(engine)
    assert await _lifecycle(gate).on_pod(WatchEvent(DELETED, _pod_of(reserved))) == 0
    assert lookups == []


async def test_a_pod_recorded_again_after_its_claim_ended_is_released_when_it_is_deleted(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """What the gate remembers of an ended allocation is forgotten when it records the pod's claim anew: the pod's
    deletion then ends the new allocation (no share is left held by a pod that is gone)."""
    reserved, first = await _recorded(gate.ledger, "p5")
    await _handled(gate, (MODIFIED, reserved))
    await _handled(gate, (MODIFIED, _deallocated(reserved)))
    again = copy.deepcopy(reserved)  # allocated anew on the same GPU (a new share id: a new allocation), no gate
    (result,) = again["status"]["allocation"]["devices"]["results"]
    result["shareID"] = str(uuid.uuid4())
    result.pop("bindingConditions")
    result.pop("bindingFailureConditions")
    again["status"].pop("devices", None)
    p5 = _pod_of(reserved)
    gate.pods = binder_index()  # the binder's pod watch, listed: the gate reads the pod from it
    gate.pods.update(MODIFIED, p5)
    gate.pods.synced()
    await _handled(gate, (MODIFIED, again))
    (live,) = await live_claim_allocations(engine)
    assert live.id != first and live.pod_uid == p5["metadata"]["uid"]
    lookups = _pod_lookups(engine)
    assert await _lifecycle(gate).on_pod(WatchEvent(DELETED, p5)) == 1
    assert lookups == [] and await _state(engine, live.id) == "released"  # the new one, known to the gate
    assert await live_claim_allocations(engine) == []


async def test_a_throttled_api_server_does_not_end_the_term_at_its_dra_question(
    gate: ClaimGate, monkeypatch: pytest.MonkeyPatch
) -> None:
    """At the start of each term the gate asks whether the API server serves resource.k8s.io/v1. Throttled past the
    retries (kube-apiserver's 429 with Retry-After, as tests/reliability/test_slow_apiserver.py's proxy answers), the
    question raised and ended the binder's term, and the binder with it. Now it is asked again until answered."""
    answers: list[BaseException | bool] = [ApiException(status=429, reason="Too Many Requests")] * 3 + [True]

    async def served() -> bool:
        answer = answers.pop(0)
        if isinstance(answer, BaseException):
            raise answer
        return answer

    monkeypatch.setattr(gate, "_resource_api_served", served)
    monkeypatch.setattr(gate, "retry", RetryPolicy(attempts=1))  # no retry inside: each 429 reaches the gate
    monkeypatch.setattr(claims_module, "ASK_AGAIN_S", 0.01)
    assert await gate._ask_served(asyncio.Event()) is True and answers == []
    stopped = asyncio.Event()
    stopped.set()
    assert await gate._ask_served(stopped) is None  # the term ended before an answer: nothing is raised

    async def refused() -> bool:
        raise ApiException(status=403, reason="Forbidden")

    monkeypatch.setattr(gate, "_resource_api_served", refused)
    with pytest.raises(ApiException):  # not a passing failure: raised at once, as before
        await gate._ask_served(asyncio.Event())


def _allocated(name: str, gib: str = "4Gi") -> tuple[dict[str, Any], dict[str, Any]]:
    """A claim kube-scheduler allocated on the default (ungated) pool and reserved for its pod, the ledger not told
    yet, and that pod as the binder's pod watch shows it."""
    c = claim(f"{name}-gpushare", "team", [request("r", gib)], [("r", GPUS[0], gib, "0")], node=NODE)
    for result in c["status"]["allocation"]["devices"]["results"]:
        result.pop("bindingConditions")
        result.pop("bindingFailureConditions")
    p = pod(name, [("main", "r")], namespace="team")
    c["status"]["reservedFor"] = [{"resource": "pods", "name": name, "uid": p["metadata"]["uid"]}]
    return c, _pod_of(c)


async def _recorded_by_gate(gate: ClaimGate, name: str, gib: str = "4Gi") -> tuple[dict[str, Any], dict[str, Any], Any]:
    """A claim allocated on the ungated pool for pod `name`, the pod bound and shown by the binder's pod watch, the
    claim handed to the gate, which records it: (claim, pod, its live allocation)."""
    if gate.pods is None:
        gate.pods = binder_index()
        gate.pods.synced()
    c, p = _allocated(name, gib)
    gate.pods.update(ADDED, p)
    await _handled(gate, (ADDED, c))
    (live,) = await live_claim_allocations(gate.ledger.engine, c["metadata"]["uid"])
    return c, p, live


async def test_the_gate_keeps_the_record_it_gave_the_ledger_for_the_annotations_at_assigned(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """The binder writes a DRA pod's annotations when the node agent assigned its claim. The gate hands it the record
    it has just given the ledger (`record_of`), so that write needs no ledger read (before: three statements per DRA
    pod, `reads.pod_record`). That record is the very one the ledger returns; it is taken once, and an allocation
    that ended leaves none behind."""
    from services.binder import reads

    c6, _, live = await _recorded_by_gate(gate, "p6")
    kept = gate.record_of(live.id)
    assert kept is not None and kept.claim_uid == c6["metadata"]["uid"] and not kept.assigned
    assert await gate.ledger.mark_assigned(live.id, live.pod_uid, NODE, "main", [GPUS[0].uuid])
    assert kept.assigned_now() == await reads.pod_record(engine, live.id)  # what the event's sync read before
    assert gate.record_of(live.id) is None  # taken once: a sync that tries again reads the ledger

    c7, _, seven = await _recorded_by_gate(gate, "p7", "2Gi")
    await _handled(gate, (MODIFIED, _deallocated(c7)))  # ended before its pod's containers were handed the GPU
    assert await _state(engine, seven.id) == "released" and gate.record_of(seven.id) is None

    c8, p8, eight = await _recorded_by_gate(gate, "p8", "2Gi")
    assert await gate.ledger.release_pod(p8["metadata"]["uid"], "pod deleted") == 1  # the pod watch's release
    gate.released_with_pod(c8["metadata"]["uid"])
    assert gate.record_of(eight.id) is None


async def _recorded_anew_elsewhere(gate: ClaimGate, c: dict[str, Any], p: dict[str, Any]) -> Any:
    """What another term's leader did while this gate was not looking: ended the claim's (only) live allocation and
    recorded the claim allocated anew (a new share id: a new allocation); returns the new one."""
    (first,) = await live_claim_allocations(gate.ledger.engine, c["metadata"]["uid"])
    assert await gate.ledger.release(first.id, first.pod_uid, NODE, "ended by another leader")
    again = copy.deepcopy(c)
    (result,) = again["status"]["allocation"]["devices"]["results"]
    result["shareID"] = str(uuid.uuid4())
    allocation = read_claim(again, p, ledger_gpus(GPUS), MemoryUnit.GIB)
    await gate.ledger.reserve_claim(allocation.event(source="other leader"))
    return allocation


async def test_a_claims_allocation_the_gate_knows_is_ended_without_a_lookup_and_one_ended_meanwhile_is_looked_up(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """The gate ends the allocation it recorded for a deallocated claim in one transaction, with no lookup before
    (`Ledger.end_allocation`: released, as its pod bound; before: a lookup, then the release). When what it knows is
    no longer true (the allocation ended meanwhile and the claim holds a new one, recorded by another term's leader),
    the end changes nothing and the gate looks the claim up and ends what it holds: no share is left behind."""
    c9, _, live = await _recorded_by_gate(gate, "p9")
    assert await _state(engine, live.id) == "bound"
    lookups = _lookups(engine)
    await _handled(gate, (MODIFIED, _deallocated(c9)))
    assert lookups == [] and await _state(engine, live.id) == "released"
    assert gate.metrics.value("gpushare_binder_released_total", reason="claim_deallocated") == 1

    c10, p10, _ = await _recorded_by_gate(gate, "p10")
    allocation = await _recorded_anew_elsewhere(gate, c10, p10)
    lookups = _lookups(engine)
    await _handled(gate, (MODIFIED, _deallocated(c10)))  # this gate still believes it holds the first
    assert len(lookups) == 1 and await _state(engine, allocation.allocation_id) == "failed"
    assert await live_claim_allocations(engine) == []


async def test_a_recorded_pods_deletion_releases_its_allocation_without_a_lookup(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """The pod watch releases a DRA pod that is gone with the allocation its claim's record made, when the gate
    knows it (before: a lookup of the pod's live allocations, then the release); one the gate knew that had ended
    meanwhile leads to the lookup, which releases what the pod holds now."""
    _, p11, live = await _recorded_by_gate(gate, "p11")
    lookups = _pod_lookups(engine)
    assert await _lifecycle(gate).on_pod(WatchEvent(DELETED, p11)) == 1
    assert lookups == [] and await _state(engine, live.id) == "released"

    c12, p12, _ = await _recorded_by_gate(gate, "p12")
    allocation = await _recorded_anew_elsewhere(gate, c12, p12)
    lookups = _pod_lookups(engine)
    assert await _lifecycle(gate).on_pod(WatchEvent(DELETED, p12)) == 1
    assert len(lookups) == 1 and await _state(engine, allocation.allocation_id) == "released"
    assert await live_claim_allocations(engine) == []


async def test_dra_pods_seen_bound_one_after_another_are_marked_bound_in_one_transaction(
    gate: ClaimGate, engine: AsyncEngine
) -> None:
    """kube-scheduler binds DRA pods one after another, so each `bound` mark was a transaction of its own, and the
    binder's pod watch waited for it. The pod watch now only starts the mark; the marks that come within
    `BOUND_LINGER_S` share one transaction, each stamped with the moment its pod was seen bound."""
    gate.pods = binder_index()
    gate.pods.synced()
    bound_pods = []
    for name in ("p13", "p14", "p15"):
        c, p = _allocated(name, "2Gi")
        waiting = copy.deepcopy(p)
        waiting["spec"].pop("nodeName")  # allocated, its pod not bound yet: recorded, not marked bound
        gate.pods.update(ADDED, waiting)
        await _handled(gate, (ADDED, c))
        bound_pods.append(p)
    assert {a.state for a in await live_claim_allocations(engine)} == {"reserved"}
    gate.bound.linger_s = 1.0  # longer than the binder's 0.1 s: a loaded machine may be slow between the binds
    batches = gate.bound.batches
    seen = []
    for p in bound_pods:
        gate.pods.update(MODIFIED, p)
        seen.append(datetime.now(UTC))
        started = asyncio.get_running_loop().time()
        assert await gate.on_pod(MODIFIED, p) is True
        assert asyncio.get_running_loop().time() - started < gate.bound.linger_s  # not waited for
        await asyncio.sleep(0.01)
    await _drained(gate)
    assert gate.bound.batches == batches + 1
    async with engine.connect() as conn:
        rows = (await conn.execute(select(allocations.c.pod_uid, allocations.c.state, allocations.c.bound_at))).all()
    stamps = {r.pod_uid: r.bound_at for r in rows if r.state == "bound"}
    assert len(stamps) == 3
    for p, when in zip(bound_pods, seen, strict=True):
        assert abs((stamps[p["metadata"]["uid"]] - when).total_seconds()) < 0.5  # when seen, not when committed


async def test_a_claims_events_that_can_change_nothing_are_settled_without_a_task(gate: ClaimGate) -> None:
    """Most of a claim's events (created, a finalizer added or removed, deleted) find nothing to do: the claim
    watch settles them at once, without a task each. An allocation, a claim the ledger holds, one with events in
    hand, one the ledger refused and the deletion of a claim that holds quota are handled as before."""
    idle = claim("idle-gpushare", "team", [request("r", "4Gi")], [], node=NODE)
    uid = idle["metadata"]["uid"]
    assert gate._settled(ADDED, idle, uid) and gate._settled(MODIFIED, idle, uid)
    assert gate._settled(DELETED, idle, uid)
    c, _ = _allocated("p16")
    assert not gate._settled(MODIFIED, c, c["metadata"]["uid"])  # allocated: to be recorded
    gate._held[uid] = uuid.uuid4()
    assert not gate._settled(MODIFIED, idle, uid)  # deallocated while the ledger holds it: to be ended
    gate._held[uid] = None
    gate._running.add(uid)
    assert not gate._settled(MODIFIED, idle, uid)  # an earlier event in hand: this one goes after it
    gate._running.discard(uid)
    assert gate._settled(DELETED, idle, uid) and uid not in gate._held
    gate._quota_namespaces.add("team")
    assert not gate._settled(DELETED, idle, uid)  # its quota hold is given back by the task
    assert gate._tasks == set()
