"""The default DRA pool (no binding conditions), end to end on the real kube-apiserver, kube-scheduler and
kube-controller-manager (v1.37.2), PostgreSQL, NATS, the services as processes, the node agent as a DRA plugin and
the kubelet stand-in (devstack/cluster/kubelet_dra.py, retrying a refused pod as kubelet's pod worker does):
kube-scheduler binds as soon as PreBind wrote the claim's allocation, the binder records it from its claim watch,
and no container starts on a share the ledger does not hold. docs/dra.md section 3.

The node: one DRA node with two 16 GiB GPUs. (A gated pool: test_gate.py; quotas at claim creation:
test_claim_quota.py.)"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import statistics
import time
from datetime import datetime
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client

from services.binder.claims import LATE_RECORD_S
from shared.annotations import ALLOCATION, GPU_MEM_ASSIGNED, GPU_MEM_IDX, parse_allocation
from shared.dra import CLAIM_ANNOTATION, DRIVER
from shared.dra.quantity import parse_quantity
from shared.kube.watching import DELETED, SYNCED, watch_objects
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.waiting import eventually

pytestmark = needs_dra

STACK_NODES = 1
STACK_DRA_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"
GPU_MIB = 16384


async def _metric(url: str, name: str, **labels: str) -> float:
    """The sum of a Prometheus metric's samples with `labels` (0 when none)."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{url}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if not line.startswith(name) or line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        series = head[len(name) :]
        if series and not series.startswith("{"):
            continue
        if all(f'{k}="{v}"' in series for k, v in labels.items()):
            total += float(value)
    return total


def _base(proc: Any) -> str:
    return str(proc.command.ready_url).rsplit("/", 1)[0]


def _kill9(proc: Any) -> None:
    if proc.popen is not None and proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)


async def _running(stack: Any, node: str, namespace: str, pod: str) -> bool:
    return await helpers.kubelet_env(stack.kubelets[node], namespace, pod, "main") is not None


async def test_a_pod_binds_without_waiting_and_starts_once_the_ledger_holds_its_share(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    s = await eventually(lambda: w.resource_slice(api, node), what="the node's ResourceSlice", within=30)
    assert all("bindingConditions" not in d for d in s["spec"]["devices"])  # the default pool: no gate
    await w.create(
        api,
        namespace,
        w.template("gpu-4", [("main", "4Gi", "30", 1)]),
        w.pod("one", [("main", "main")], template_name="gpu-4"),
    )
    await helpers.wait_bound(api, namespace, ["one"], timeout_s=30)
    claim = await w.wait_claim_allocated(api, namespace, "one")
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert result["driver"] == DRIVER and "bindingConditions" not in result
    assert "devices" not in (claim.get("status") or {})  # the binder writes no condition here
    env = await helpers.container_env(stack, node, namespace, "one", "main")
    allocs = await w.claim_allocations(stack.database_url, namespace)
    assert allocs["one"]["claim_uid"] == claim["metadata"]["uid"] and allocs["one"]["memory_mib"] == 4096
    pod = await eventually(lambda: _annotated(api, namespace, "one"), what="the pod's annotations", within=30)
    allocation_id, annotated_node, _ = parse_allocation(pod["metadata"]["annotations"][ALLOCATION])
    assert (allocation_id, annotated_node) == (allocs["one"]["id"], node)
    assert pod["metadata"]["annotations"][CLAIM_ANNOTATION] == claim["metadata"]["uid"]
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4"
    assert await eventually(
        lambda: _assigned(stack.database_url, allocation_id), what="the container assigned", within=30
    )
    (row,) = await w.ledger_rows(
        stack.database_url, "SELECT reserved_at, assigned_at FROM allocations WHERE id = $1", allocation_id
    )
    assert row["reserved_at"] <= row["assigned_at"]  # prepared (and assigned) only once the ledger held it
    agent = stack.processes[f"node-agent-{node}"]
    assert await _metric(_base(agent), "gpushare_node_agent_dra_prepares_total", outcome="prepared") >= 1
    waits = await _metric(_base(agent), "gpushare_node_agent_dra_prepare_ledger_wait_seconds_count")
    assert waits >= 1  # every prepare observes how long it waited for the ledger
    await helpers.delete_pod(api, namespace, "one")
    await helpers.wait_released(stack.database_url, namespace, "one")


async def _annotated(api: Any, namespace: str, name: str) -> dict[str, Any] | None:
    pod = await w.raw_pod(api, namespace, name)
    return pod if pod is not None and ALLOCATION in (pod["metadata"].get("annotations") or {}) else None


async def test_a_dra_pods_annotations_are_written_once_with_the_assigned_flag(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """The binder writes a DRA pod's gpushare annotations in one update, once the node agent has prepared the
    claim (the `assigned` event), not at the record and again at the assignment: every pod update reaches every
    pod watcher (kube-scheduler, kube-controller-manager, kubelet, the binder...). The pod watch still marks the
    allocation `bound` before that, from the gate's record (services/binder/claims.py)."""
    states: list[dict[str, str]] = []  # each new state of the pod's gpushare annotations, as the watch saw them
    stop, synced = asyncio.Event(), asyncio.Event()
    keys = {ALLOCATION, CLAIM_ANNOTATION, GPU_MEM_IDX, GPU_MEM_ASSIGNED}

    async def follow() -> None:
        core = client.CoreV1Api(api)
        async for event in watch_objects(core.list_namespaced_pod, namespace=namespace, what="pods", stop=stop):
            if event.type == SYNCED:
                synced.set()
                continue
            if event.object["metadata"]["name"] != "once":
                continue
            ann = event.object["metadata"].get("annotations") or {}
            now = {k: v for k, v in ann.items() if k in keys}
            if now and (not states or states[-1] != now):
                states.append(now)

    follower = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(synced.wait(), 30)
        await w.create(
            api,
            namespace,
            w.template("gpu-3", [("main", "3Gi", None, 1)]),
            w.pod("once", [("main", "main")], template_name="gpu-3"),
        )
        await helpers.container_env(stack, stack.node_names[0], namespace, "once", "main", timeout_s=60)
        await eventually(
            lambda: states and states[-1].get(GPU_MEM_ASSIGNED) == "true",
            what="the assigned flag on the pod",
            within=30,
        )
        allocation = (await w.claim_allocations(stack.database_url, namespace))["once"]
        (row,) = await w.ledger_rows(
            stack.database_url,
            "SELECT bound_at, assigned_at, extract(epoch FROM reserved_at) AS reserved FROM allocations WHERE id = $1",
            allocation["id"],
        )
        pod = await w.raw_pod(api, namespace, "once")
    finally:
        stop.set()
        follower.cancel()
        with contextlib.suppress(BaseException):
            await follower
    (scheduled,) = [c for c in pod["status"]["conditions"] if c["type"] == "PodScheduled"]
    if float(row["reserved"]) - datetime.fromisoformat(scheduled["lastTransitionTime"]).timestamp() >= LATE_RECORD_S:
        # recorded late (a loaded machine): written at the record too, so that kubelet would ask again
        assert len(states) == 2 and states[0][GPU_MEM_ASSIGNED] == "false", states
        states = states[1:]
    assert len(states) == 1, states  # one update: before this change, the record's (assigned "false"), then this
    (only,) = states
    assert only[CLAIM_ANNOTATION] == allocation["claim_uid"] and only[GPU_MEM_IDX] in ("0", "1")
    assert parse_allocation(only[ALLOCATION])[0] == allocation["id"]
    assert row["bound_at"] is not None and row["assigned_at"] is not None  # marked bound from the record
    await helpers.delete_pod(api, namespace, "once")
    await helpers.wait_released(stack.database_url, namespace, "once")


async def _assigned(database_url: str, allocation_id: Any) -> bool:
    rows = await w.ledger_rows(database_url, "SELECT state FROM allocations WHERE id = $1", allocation_id)
    return bool(rows) and rows[0]["state"] == "assigned"


async def test_a_bound_pod_whose_claim_the_ledger_has_not_recorded_does_not_start(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """With the binder down, kube-scheduler still binds the pod (no gate), but the node agent refuses to prepare a
    claim the ledger does not hold, so kubelet starts nothing; it retries at the pod's next update, which the
    restarted binder's record and annotations are, and the pod starts on the share the ledger holds."""
    node = stack.node_names[0]
    binder = stack.processes["binder"]
    kubelet = stack.kubelets[node]
    _kill9(binder)
    try:
        await w.create(
            api,
            namespace,
            w.template("gpu-2", [("main", "2Gi", None, 1)]),
            w.pod("early", [("main", "main")], template_name="gpu-2"),
        )
        await helpers.wait_bound(api, namespace, ["early"], timeout_s=30)
        claim = await w.wait_claim_allocated(api, namespace, "early")
        uid = claim["metadata"]["uid"]
        refused = await eventually(
            lambda: kubelet.errors.get((namespace, "early")), what="kubelet's prepare refused", within=60
        )
        assert "holds no live allocation" in refused, refused
        assert not await _running(stack, node, namespace, "early")
        assert "early" not in await w.claim_allocations(stack.database_url, namespace)
    finally:
        binder.start()
        await binder.wait_ready(90)
    await helpers.container_env(stack, node, namespace, "early", "main", timeout_s=60)
    prepares = [c for c in kubelet.dra.calls if c == ("NodePrepareResources", [uid])]
    assert len(prepares) == 2, kubelet.dra.calls  # refused once, prepared at the retry the binder's update caused
    assert (await w.claim_allocations(stack.database_url, namespace))["early"]["claim_uid"] == uid
    agent = stack.processes[f"node-agent-{node}"]
    assert await _metric(_base(agent), "gpushare_node_agent_dra_prepares_total", outcome="refused") >= 1


async def test_a_record_the_ledger_refuses_is_an_alert_and_the_pod_waits_until_it_is_recorded(
    stack, api, namespace
) -> None:  # type: ignore[no-untyped-def]
    """A share the extender path holds on each GPU (which kube-scheduler's allocator cannot see) makes the ledger
    refuse the claim kube-scheduler allocated: counted, logged, and a LedgerRefused event on the pod; the pod is
    bound but nothing starts. Once the extender's shares end, the binder's next try records it and it starts."""
    node = stack.node_names[0]
    gpus = await helpers.gpu_rows(stack.database_url, node)
    engine = make_engine(stack.database_url, pool_size=1)
    ledger = Ledger(engine, prefix=stack.config.subject_prefix, source="test")
    outsiders = []
    binder_url = stack.binder_url
    before = await _metric(binder_url, "gpushare_binder_claim_record_refusals_total", reason="PathConflict")
    try:
        for g in gpus:
            outsiders.append(await w.extender_share(api, ledger, namespace, f"outsider-{g['index']}", node, g))
        await w.create(
            api,
            namespace,
            w.template("gpu-4", [("main", "4Gi", None, 1)]),
            w.pod("refused", [("main", "main")], template_name="gpu-4"),
        )
        await helpers.wait_bound(api, namespace, ["refused"], timeout_s=30)
        event = await eventually(
            lambda: _event_with(api, namespace, "refused", "LedgerRefused"), what="the alert on the pod", within=60
        )
        assert "PathConflict" in event and "containers wait" in event, event
        assert await _metric(binder_url, "gpushare_binder_claim_record_refusals_total", reason="PathConflict") > before
        assert not await _running(stack, node, namespace, "refused")
        assert "refused" not in await w.claim_allocations(stack.database_url, namespace)
        for g in gpus:  # the extender's shares end with their pods
            await helpers.delete_pod(api, namespace, f"outsider-{g['index']}")
        await helpers.container_env(stack, node, namespace, "refused", "main", timeout_s=90)
        assert (await w.claim_allocations(stack.database_url, namespace))["refused"]["memory_mib"] == 4096
    finally:
        for o in outsiders:
            await ledger.release(o.allocation_id, o.pod_uid, node, "test done")
        await engine.dispose()


async def _event_with(api: Any, namespace: str, name: str, text: str) -> str | None:
    found = [e for e in await w.events_of(api, namespace, name) if text in e]
    return " | ".join(found) if found else None


class ClaimClock:
    """When each claim allocation (claim UID, share ids) was first seen, and when it was last seen gone, by a watch
    of the claims (the test's own clock, the machine the ledger's database runs on)."""

    def __init__(self) -> None:
        self.allocated: dict[str, tuple[float, tuple[str, ...], dict[str, int]]] = {}  # uid -> (at, shares, MiB/dev)
        self.gone: dict[str, float] = {}
        self.synced = asyncio.Event()

    async def follow(self, api: Any, stop: asyncio.Event) -> None:
        resource = client.ResourceV1Api(api)
        async for event in watch_objects(resource.list_resource_claim_for_all_namespaces, what="claims", stop=stop):
            if event.type == SYNCED:
                self.synced.set()
                continue
            uid = str(event.object["metadata"]["uid"])
            consumed = w.consumed(event.object) if event.type != DELETED else []
            if consumed and uid not in self.allocated:
                per_device: dict[str, int] = {}
                for _, device, memory, _ in consumed:
                    per_device[device] = per_device.get(device, 0) + int(parse_quantity(memory) / 2**20)
                self.allocated[uid] = (time.time(), tuple(sorted(str(c[3]) for c in consumed)), per_device)
            elif not consumed and uid in self.allocated and uid not in self.gone:
                self.gone[uid] = time.time()


async def _sample(stack: Any, api: Any, clock: ClaimClock) -> tuple[list[str], dict[str, Any]]:
    """One sample: what is wrong now (an overcommit in the ledger or in the claims, counters not what the shares
    charge), and the ledger's claim allocations (claim UID -> reserved_at, ended_at as epoch seconds)."""
    wrong = list(await w.ledger_exact(stack.database_url))
    for node in stack.node_names:
        for g in await helpers.gpu_rows(stack.database_url, node):
            if g["allocated_memory_mib"] > g["memory_mib"]:
                wrong.append(f"ledger overcommit: {g}")
    consumed: dict[str, int] = {}
    for c in await w.claims(api):
        for _, device, memory, _ in w.consumed(c):
            consumed[device] = consumed.get(device, 0) + int(parse_quantity(memory) / 2**20)
    wrong += [f"claims consumed {mib} MiB of {d}" for d, mib in consumed.items() if mib > GPU_MIB]
    rows = await w.ledger_rows(
        stack.database_url,
        "SELECT claim_uid, extract(epoch FROM reserved_at) AS r, extract(epoch FROM ended_at) AS e"
        " FROM allocations WHERE claim_uid IS NOT NULL",
    )
    return wrong, {r["claim_uid"]: (float(r["r"]), r["e"] and float(r["e"])) for r in rows}


async def test_a_fill_sampled_every_0_3_s_never_overcommits_and_the_ledger_follows_the_claims(
    stack, api, namespace
) -> None:  # type: ignore[no-untyped-def]
    """40 pods of 2 GiB created at once on two 16 GiB GPUs (16 fit), then 8 deleted and 8 more placed. Sampled every
    0.3 s all along: no ledger counter and no device's summed consumedCapacity ever passes 16 GiB, the counters are
    always what their shares charge, and every claim allocation reaches the ledger (the lag, from the claim watch
    seeing the allocation to the ledger's record, is measured and printed: docs/benchmarks.md reports it)."""
    clock = ClaimClock()
    stop = asyncio.Event()
    follower = asyncio.create_task(clock.follow(api, stop))
    await asyncio.wait_for(clock.synced.wait(), 30)
    seen: list[str] = []
    ledger: dict[str, Any] = {}
    done = asyncio.Event()

    async def sampler() -> None:
        while not done.is_set():
            wrong, rows = await _sample(stack, api, clock)
            seen.extend(wrong)
            ledger.update(rows)
            await asyncio.sleep(0.3)

    sampling = asyncio.create_task(sampler())
    names = [f"f{i:02d}" for i in range(40)]
    try:
        await w.create(api, namespace, w.template("gpu-2", [("main", "2Gi", None, 1)]))
        await asyncio.gather(
            *(w.create(api, namespace, w.pod(n, [("main", "main")], template_name="gpu-2")) for n in names)
        )
        first = await eventually(lambda: _bound(api, namespace, names, 16), what="16 pods bound", within=120)
        for n in first[:8]:
            await helpers.delete_pod(api, namespace, n)
        await eventually(lambda: _bound(api, namespace, names, 16, not_in=first[:8]), what="8 more bound", within=120)
        await eventually(
            lambda: _recorded(stack.database_url, namespace, 16), what="the ledger holding the 16 claims", within=60
        )
    finally:
        done.set()
        with contextlib.suppress(Exception):
            await sampling
        stop.set()
        follower.cancel()
        with contextlib.suppress(BaseException):
            await follower
    assert seen == [], seen[:10]
    _, rows = await _sample(stack, api, clock)
    ledger.update(rows)
    lags = [ledger[uid][0] - at for uid, (at, _, _) in clock.allocated.items() if uid in ledger]
    releases = [ledger[uid][1] - at for uid, at in clock.gone.items() if uid in ledger and ledger[uid][1]]
    assert len(lags) == len(clock.allocated) >= 24, (len(lags), len(clock.allocated))
    report = {
        "claims_allocated": len(lags),
        "record_lag_s": {"p50": statistics.median(lags), "max": max(lags)},
        "release_lag_s": {"p50": statistics.median(releases), "max": max(releases)} if releases else None,
    }
    print("ledger lag behind the claims:", json.dumps(report))
    # the ledger is the claims: every live claim allocation recorded, with what it consumed on each GPU
    live = await w.claim_allocations(stack.database_url, namespace)
    claims = {c["metadata"]["uid"]: c for c in await w.claims(api) if w.consumed(c)}
    assert {r["claim_uid"] for r in live.values()} == set(claims)
    assert sum(r["memory_mib"] for r in live.values()) == 16 * 2048


async def _bound(api: Any, namespace: str, names: list[str], want: int, not_in: list[str] = ()) -> list[str] | None:  # type: ignore[assignment]
    out = []
    for n in names:
        if n in not_in:
            continue
        with contextlib.suppress(client.ApiException):
            if await helpers.pod_node(api, namespace, n):
                out.append(n)
    return out if len(out) >= want else None


async def _recorded(database_url: str, namespace: str, want: int) -> bool:
    return len(await w.claim_allocations(database_url, namespace)) == want


async def test_a_higher_priority_dra_pod_on_a_full_gpu_and_preemption(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """Both GPUs held whole by low-priority DRA pods, then a high-priority DRA pod asking a whole GPU. What
    kube-scheduler 1.37.2 does is observed for 30 s, sampled every 0.3 s for overcommit (see docs/dra.md,
    "Preemption", for what the sources say and what this shows)."""
    scheduling = client.SchedulingV1Api(api)
    for name, value in ((f"{namespace}-low", 100), (f"{namespace}-high", 100000)):
        await scheduling.create_priority_class({"metadata": {"name": name}, "value": value})
    try:
        await w.create(api, namespace, w.template("whole", [("main", "16Gi", None, 1)]))
        for name in ("low-0", "low-1"):
            body = w.pod(name, [("main", "main")], template_name="whole")
            body["spec"]["priorityClassName"] = f"{namespace}-low"
            await w.create(api, namespace, body)
        await helpers.wait_bound(api, namespace, ["low-0", "low-1"], timeout_s=60)
        high = w.pod("high", [("main", "main")], template_name="whole")
        high["spec"]["priorityClassName"] = f"{namespace}-high"
        seen: list[str] = []
        clock = ClaimClock()
        await w.create(api, namespace, high)
        end = time.monotonic() + 30
        victims: set[str] = set()
        while time.monotonic() < end:
            wrong, _ = await _sample(stack, api, clock)
            seen.extend(wrong)
            for name in ("low-0", "low-1"):
                pod = await w.raw_pod(api, namespace, name)
                if pod is None or pod["metadata"].get("deletionTimestamp"):
                    victims.add(name)
            if await helpers.pod_node(api, namespace, "high"):
                break
            await asyncio.sleep(0.3)
        assert seen == [], seen[:5]
        high_node = await helpers.pod_node(api, namespace, "high")
        condition = await helpers.scheduled_condition(api, namespace, "high")
        print("preemption:", json.dumps({"victims": sorted(victims), "high_bound": high_node, "why": condition}))
        # kube-scheduler 1.37.2 does not preempt for DRA device capacity: DynamicResources has no
        # PreFilterExtensions, so DefaultPreemption's SelectVictimsOnNode removing the low pods from the node does
        # not free their claims' devices in the allocator's state, and the node never fits (docs/dra.md)
        assert not victims and high_node is None, (victims, high_node)
        assert "preemption" in condition and "cannot allocate all claims" in condition, condition
        held = await w.claim_allocations(stack.database_url, namespace)
        assert sorted(held) == ["low-0", "low-1"] and all(r["memory_mib"] == GPU_MIB for r in held.values())
    finally:
        await helpers.delete_all_pods(api, namespace)
        for name in (f"{namespace}-low", f"{namespace}-high"):
            await scheduling.delete_priority_class(name)


@pytest.fixture(autouse=True)
async def _exact_after(stack):  # type: ignore[no-untyped-def]
    yield
    assert await w.ledger_exact(stack.database_url) == []


async def test_a_dra_pods_allocation_ends_with_one_event(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """A deleted DRA pod's allocation is ended by whichever of the binder's two watches sees it first: the pod
    watch (the pod is gone) or the claim watch (kube-controller-manager took the pod off the claim, deallocated it
    and deleted it). The other one finds nothing left to end and writes nothing. Before, both read the allocation
    live and both recorded a `released` event: the second one changed no row, but went through the stream to
    accounting and every node agent (benchmark 12 measured it in the binder's, PostgreSQL's and accounting's CPU)."""
    from shared.events.bus import BusNames, EventBus
    from tests.waiting import stream_events

    names = [f"end-{i}" for i in range(6)]
    await w.create(
        api,
        namespace,
        w.template("gpu-2", [("main", "2Gi", None, 1)]),
        *[w.pod(n, [("main", "main")], template_name="gpu-2") for n in names],
    )
    for n in names:
        await helpers.container_env(stack, stack.node_names[0], namespace, n, "main", timeout_s=60)
    ids = {r["id"] for r in (await w.claim_allocations(stack.database_url, namespace)).values()}
    assert len(ids) == len(names)
    await helpers.delete_all_pods(api, namespace)
    for n in names:
        await helpers.wait_released(stack.database_url, namespace, n)
    resource = client.ResourceV1Api(api)

    async def claims_gone() -> bool:
        return not (await resource.list_namespaced_resource_claim(namespace)).items

    await eventually(claims_gone, what="the pods' claims deleted", within=60)
    await asyncio.sleep(3)  # the later of the two watches has seen its event by now (and the outbox relayed it)
    bus = await EventBus.connect(stack.nats_url, BusNames(stack.config.stream_name, stack.config.subject_prefix))
    try:
        ended = [e for kind in ("released", "failed") for e in await stream_events(bus, kind) if e.allocation_id in ids]
    finally:
        await bus.close()
    per_allocation = {i: sum(e.allocation_id == i for e in ended) for i in ids}
    assert all(n == 1 for n in per_allocation.values()), per_allocation
