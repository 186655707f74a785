"""A gated DRA pool (nodes labelled gpushare.io/dra-gate=ledger: the ledger decides before each bind), end to end on
the real kube-apiserver, kube-scheduler and kube-controller-manager (v1.37.2), with PostgreSQL, NATS, the services
as processes, the node agent as a DRA plugin and the kubelet stand-in playing kubelet's DRA side
(devstack/cluster/kubelet_dra.py): docs/dra.md section 7. (The default pool, without the gate: test_record.py.)

Each gated bind waits for kube-scheduler's PreBind poll (5 s), so the module keeps to a handful of pods."""

from __future__ import annotations

import os
import signal
from datetime import UTC, datetime
from pathlib import Path

import grpc
import pytest

from services.node_agent.assignment import PendingContainer, Share, container_env
from shared.annotations import ALLOCATION, GPU_MEM_IDX, parse_allocation
from shared.dra import CLAIM_ANNOTATION, DRIVER, REFUSED_CONDITION, RESERVED_CONDITION
from shared.dra.cdi import spec_file_name
from shared.dra.claims import LedgerGpu, read_claim
from shared.dra.quantity import parse_quantity
from shared.dra.slices import device_name
from shared.kubelet_api import load
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger
from shared.settings import MemoryUnit
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.reliability.harness import ledger_rebuild
from tests.waiting import eventually

pytestmark = needs_dra

STACK_NODES = 1
STACK_DRA_NODES = 1
STACK_DRA_GATED_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"


async def test_the_slice_round_trips_with_the_ledgers_capacities(stack, api) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    rows = await helpers.gpu_rows(stack.database_url, node)
    s = await eventually(lambda: w.resource_slice(api, node), what="the node's ResourceSlice", within=30)
    assert s["spec"]["driver"] == DRIVER and s["spec"]["nodeName"] == node
    assert s["spec"]["pool"]["name"] == node and s["spec"]["pool"]["generation"] >= 1
    (device,) = s["spec"]["devices"]
    (row,) = rows
    assert device["name"] == device_name(row["uuid"])
    assert device["capacity"]["memory"]["value"] == f"{row['memory_mib'] // 1024}Gi"
    assert device["capacity"]["compute"]["value"] == "100"
    assert device["allowMultipleAllocations"] is True
    # a gated pool: kube-scheduler binds only once the ledger said yes (or gives the allocation up when it said no)
    assert device["bindingConditions"] == [RESERVED_CONDITION]
    assert device["bindingFailureConditions"] == [REFUSED_CONDITION]
    allocator = await w.ledger_rows(stack.database_url, "SELECT allocator FROM nodes WHERE name = $1", node)
    assert allocator == [{"allocator": "dra"}]


async def test_one_pod_is_recorded_before_it_binds_and_gets_the_device_plugin_environment(
    stack, api, namespace
) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    await w.create(
        api,
        namespace,
        w.template("gpu-4", [("main", "4Gi", "30", 1)]),
        w.pod("one", [("main", "main")], template_name="gpu-4"),
    )
    (bound,) = (await helpers.wait_bound(api, namespace, ["one"])).values()
    assert bound == node
    claim = await w.pod_claim(api, namespace, "one")
    ((request, _device, memory, share_id),) = w.consumed(claim)
    assert (request, memory) == ("main", "4Gi") and share_id
    allocs = await w.claim_allocations(stack.database_url, namespace)
    assert allocs["one"]["claim_uid"] == claim["metadata"]["uid"] and allocs["one"]["memory_mib"] == 4096
    pod = await w.raw_pod(api, namespace, "one")
    ann = pod["metadata"]["annotations"]
    allocation_id, annotated_node, _ = parse_allocation(ann[ALLOCATION])
    assert allocation_id == allocs["one"]["id"] and annotated_node == node
    assert ann[CLAIM_ANNOTATION] == claim["metadata"]["uid"] and ann[GPU_MEM_IDX] == "0"
    # the container got, through CDI, what the device-plugin path computes for the same share
    env = await helpers.container_env(stack, node, namespace, "one", "main")
    gpu = (await helpers.gpu_rows(stack.database_url, node))[0]
    expected = container_env(
        PendingContainer(
            allocation_id,
            pod["metadata"]["uid"],
            namespace,
            "one",
            "main",
            0,
            False,
            (Share(gpu["uuid"], 0, 4096, 30),),
            reserved_at=datetime.now(UTC),
            pod_memory_mib=4096,
        ),
        {gpu["uuid"]: gpu["memory_mib"]},
        {gpu["uuid"]: gpu["memory_mib"]},
        MemoryUnit.GIB,
        mps=False,
    )
    assert env == expected
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "4" and env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]
    # recorded before it was bound (the binder's claim_reserved, then bound from the pod watch), then assigned
    assert await eventually(
        lambda: _state_when(stack.database_url, namespace, "one", "assigned"), what="assigned", within=30
    )
    (row,) = await w.ledger_rows(
        stack.database_url, "SELECT reserved_at, bound_at, assigned_at FROM allocations WHERE id = $1", allocation_id
    )
    assert row["reserved_at"] <= row["bound_at"] <= row["assigned_at"]
    cdi = cdi_dir(stack, node) / spec_file_name(claim["metadata"]["uid"])
    assert cdi.exists()

    # release: the pod goes, the controller deletes its claim, kubelet unprepares, the ledger gives the share back
    await helpers.delete_pod(api, namespace, "one")
    await helpers.wait_released(stack.database_url, namespace, "one")
    assert await eventually(lambda: _gone(api, namespace, claim["metadata"]["name"]), what="claim deleted", within=30)
    await eventually(lambda: not cdi.exists(), what="the CDI spec removed by NodeUnprepareResources", within=30)
    assert ("NodeUnprepareResources", [claim["metadata"]["uid"]]) in stack.kubelets[node].dra.calls
    assert [g["allocated_memory_mib"] for g in await helpers.gpu_rows(stack.database_url, node)] == [0]


async def test_four_4gib_pods_pack_one_16gib_gpu_and_a_fifth_waits(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    names = [f"p{i}" for i in range(5)]
    await w.create(
        api,
        namespace,
        w.template("gpu-4", [("main", "4Gi", None, 1)]),
        *(w.pod(n, [("main", "main")], template_name="gpu-4") for n in names),
    )
    # four of the five bind (which four is the scheduler's choice), the fifth stays Pending
    bound = await eventually(lambda: _bound_names(api, namespace, names, 4), what="four pods bound", within=90)
    (waiting,) = set(names) - set(bound)
    assert await helpers.stays_pending(api, namespace, waiting, 8)
    claims = [await w.pod_claim(api, namespace, n) for n in bound]
    consumed_mib = sum(_mib(memory) for c in claims for _, _, memory, _ in w.consumed(c))
    (gpu,) = await helpers.gpu_rows(stack.database_url, node)
    assert consumed_mib == gpu["allocated_memory_mib"] == 16384
    assert sorted(await w.claim_allocations(stack.database_url, namespace)) == sorted(bound)
    events = " ".join(await w.events_of(api, namespace, waiting))
    assert "FailedScheduling" in events


async def test_a_pod_found_not_to_fit_while_another_waits_at_the_gate_binds_soon_after(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """While pod `a` waits in PreBind for its binding condition, kube-scheduler 1.37.2 counts its claim's 4 GiB twice
    (in flight and allocated), so `b` (10 GiB: 4 + 10 fit 16) is found not to fit; nothing in DRA requeues it once
    `a` is bound, so it would wait for the scheduler's 5-minute flush. The binder nudges the node when `a` binds."""
    await w.create(
        api,
        namespace,
        w.template("gpu-4", [("main", "4Gi", None, 1)]),
        w.template("gpu-10", [("main", "10Gi", None, 1)]),
        w.pod("a", [("main", "main")], template_name="gpu-4"),
    )
    await w.wait_claim_allocated(api, namespace, "a")
    await w.create(api, namespace, w.pod("b", [("main", "main")], template_name="gpu-10"))
    await helpers.wait_bound(api, namespace, ["a", "b"], timeout_s=40)  # fails after 40 s, long before the flush
    held = await w.claim_allocations(stack.database_url, namespace)
    assert {name: row["memory_mib"] for name, row in held.items()} == {"a": 4096, "b": 10240}, held
    assert await w.ledger_exact(stack.database_url) == []


async def test_a_share_the_extender_path_holds_makes_the_gate_refuse_the_gpu(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    (gpu,) = await helpers.gpu_rows(stack.database_url, node)
    engine = make_engine(stack.database_url, pool_size=1)
    ledger = Ledger(engine, prefix=stack.config.subject_prefix, source="test")
    try:
        await w.extender_share(api, ledger, namespace, "outsider", node, gpu)
        await w.create(
            api,
            namespace,
            w.template("gpu-4", [("main", "4Gi", None, 1)]),
            w.pod("c", [("main", "main")], template_name="gpu-4"),
        )
        refused = await eventually(
            lambda: _event_with(api, namespace, "c", "PathConflict"), what="the ledger's path conflict", within=60
        )
        assert "scheduler extender placed" in refused and f"{namespace}/outsider" in refused
        # never both: the claim's share was not recorded while the extender's was live
        rows = await w.ledger_rows(
            stack.database_url, "SELECT state FROM allocations WHERE namespace = $1 AND pod_name = 'c'", namespace
        )
        assert rows == []
        # the extender's share ends with its pod, and the claim gets the GPU
        await helpers.delete_pod(api, namespace, "outsider")
        await helpers.wait_bound(api, namespace, ["c"], timeout_s=90)
    finally:
        await engine.dispose()


async def test_a_binder_killed_between_the_ledger_write_and_the_condition_binds_the_pod_once(
    stack, api, namespace
) -> None:  # type: ignore[no-untyped-def]
    """The binder dies after `Ledger.reserve_claim` committed and before `LedgerReserved` was written (the test
    makes that state: it records the claim exactly as the binder does, with the binder down). While it is down a
    prepare call for the claim (the ledger has not seen it yet at first) is refused; once it is back, the pod binds
    with the one allocation the ledger already holds (the same id: the claim's UID and share ids)."""
    node = stack.node_names[0]
    binder = stack.processes["binder"]
    _kill9(binder)
    try:
        await w.create(
            api,
            namespace,
            w.template("gpu-2", [("main", "2Gi", None, 1)]),
            w.pod("k", [("main", "main")], template_name="gpu-2"),
        )
        claim = await w.wait_claim_allocated(api, namespace, "k")
        uid = claim["metadata"]["uid"]
        reply = await _prepare_directly(stack, node, namespace, uid, claim["metadata"]["name"])
        assert "holds no live allocation" in reply.claims[uid].error  # a claim the ledger never saw
        pod = await w.raw_pod(api, namespace, "k")
        gpus = {
            device_name(g["uuid"]): LedgerGpu(g["uuid"], g["index"], g["memory_mib"])
            for g in await helpers.gpu_rows(stack.database_url, node)
        }
        event = read_claim(claim, pod, gpus, MemoryUnit.GIB).event(source="binder")
        engine = make_engine(stack.database_url, pool_size=1)
        try:
            assert (
                await Ledger(engine, prefix=stack.config.subject_prefix, source="binder").reserve_claim(event)
            ).created
        finally:
            await engine.dispose()
        assert await helpers.pod_node(api, namespace, "k") is None  # no condition yet: the scheduler waits
    finally:
        binder.start()
        await binder.wait_ready(90)
    await helpers.wait_bound(api, namespace, ["k"], timeout_s=90)
    rows = await w.ledger_rows(
        stack.database_url, "SELECT id, state FROM allocations WHERE namespace = $1 AND pod_name = 'k'", namespace
    )
    assert [r["id"] for r in rows] == [event.allocation_id]
    assert await eventually(
        lambda: _state_when(stack.database_url, namespace, "k", "assigned"), what="assigned", within=30
    )


async def test_bad_claims_are_refused_clearly_and_nothing_is_recorded(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    await w.create(
        api,
        namespace,
        w.template("too-big", [("main", "20Gi", None, 1)]),
        w.template("no-class", [("main", "1Gi", None, 1)], device_class="gpushare-gpu-typo"),
        w.template("off-step", [("main", "1500Mi", "12.5", 1)]),
        w.pod("big", [("main", "main")], template_name="too-big"),
        w.pod("typo", [("main", "main")], template_name="no-class"),
        w.pod("odd", [("main", "main")], template_name="off-step"),
    )
    # off the request policy's steps: kube-scheduler rounds up (2Gi, 13), and the ledger charges what it counted
    await helpers.wait_bound(api, namespace, ["odd"], timeout_s=90)
    claim = await w.pod_claim(api, namespace, "odd")
    result = claim["status"]["allocation"]["devices"]["results"][0]
    assert (result["consumedCapacity"]["memory"], result["consumedCapacity"]["compute"]) == ("2Gi", "13")
    assert (await w.claim_allocations(stack.database_url, namespace))["odd"]["memory_mib"] == 2048
    # more than a GPU holds, and a class that does not exist: Pending, with kube-scheduler's reason, nothing recorded
    assert await helpers.stays_pending(api, namespace, "big", 3)
    big = await eventually(
        lambda: _event_with(api, namespace, "big", "FailedScheduling"), what="big's event", within=30
    )
    assert "claim" in big
    typo = await eventually(
        lambda: _event_with(api, namespace, "typo", "gpushare-gpu-typo"), what="typo's event", within=30
    )
    assert "FailedScheduling" in typo
    assert set(await w.claim_allocations(stack.database_url, namespace)) == {"odd"}


async def test_the_stream_rebuilds_the_ledger_with_its_dra_rows(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    await w.create(
        api,
        namespace,
        w.template("gpu-1", [("main", "1Gi", None, 1)]),
        w.pod("r", [("main", "main")], template_name="gpu-1"),
    )
    await helpers.wait_bound(api, namespace, ["r"])
    await eventually(lambda: _state_when(stack.database_url, namespace, "r", "assigned"), what="assigned", within=30)
    await eventually(lambda: _outbox_empty(stack.database_url), what="the outbox published", within=30)
    done = await ledger_rebuild(stack)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "ledger verified" in done.stderr
    dra_rows = await w.ledger_rows(
        stack.database_url, "SELECT count(*) AS n FROM allocations WHERE claim_uid IS NOT NULL"
    )
    assert dra_rows[0]["n"] >= 1


def _kill9(proc) -> None:  # type: ignore[no-untyped-def]
    if proc.popen is not None and proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)


async def _prepare_directly(stack, node: str, namespace: str, uid: str, name: str):  # type: ignore[no-untyped-def]
    """NodePrepareResources on the node agent's DRA socket, as kubelet calls it."""
    pb, stub_mod = load("dra_v1")
    socket = stack._socket_dir / node / "plugins" / "dra.sock"
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        stub = stub_mod.DRAPluginStub(channel)
        request = pb.NodePrepareResourcesRequest(claims=[pb.Claim(namespace=namespace, uid=uid, name=name)])
        return await stub.NodePrepareResources(request, timeout=30)


async def _bound_names(api, namespace: str, names: list[str], want: int) -> list[str] | None:  # type: ignore[no-untyped-def]
    bound = [n for n in names if await helpers.pod_node(api, namespace, n)]
    return bound if len(bound) >= want else None


async def _event_with(api, namespace: str, name: str, text: str) -> str | None:  # type: ignore[no-untyped-def]
    events = await w.events_of(api, namespace, name)
    found = [e for e in events if text in e]
    return " | ".join(found) if found else None


async def _outbox_empty(database_url: str) -> bool:
    return (await w.ledger_rows(database_url, "SELECT count(*) AS n FROM outbox"))[0]["n"] == 0


def _mib(quantity: str) -> int:
    return int(parse_quantity(quantity) / 2**20)


def cdi_dir(stack, node: str) -> Path:  # type: ignore[no-untyped-def]
    """Where the node's agent writes CDI specs (the stack's per-node directory)."""
    return stack._socket_dir / node / "cdi"


async def _gone(api, namespace: str, name: str) -> bool:  # type: ignore[no-untyped-def]
    return await w.claim(api, namespace, name) is None


async def _state_when(database_url: str, namespace: str, pod: str, state: str) -> bool:
    allocs = await w.claim_allocations(database_url, namespace)
    return pod in allocs and allocs[pod]["state"] == state


@pytest.fixture(autouse=True)
async def _no_overcommit_after(stack):  # type: ignore[no-untyped-def]
    yield
    assert await w.ledger_exact(stack.database_url) == []


# Last: it deletes a row behind the ledger's back (a restored backup), which no replay of the stream can
# reproduce, so the rebuild test above must have run before it on this module's stack.
async def test_a_restarted_binder_reconciles_the_claims_it_missed(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    """While the binder is down: one pod's allocation is lost from the ledger (a restored backup), another pod is
    deleted (its claim goes with it). The restarted binder adopts the running claim again (same allocation, bound)
    and ends the deleted pod's allocation."""
    node = stack.node_names[0]
    await w.create(
        api,
        namespace,
        w.template("gpu-2", [("main", "2Gi", None, 1)]),
        w.pod("keep", [("main", "main")], template_name="gpu-2"),
        w.pod("gone", [("main", "main")], template_name="gpu-2"),
    )
    await helpers.wait_bound(api, namespace, ["keep", "gone"])
    before = await w.claim_allocations(stack.database_url, namespace)
    kept = before["keep"]["id"]
    binder = stack.processes["binder"]
    _kill9(binder)
    try:
        await w.ledger_rows(
            stack.database_url,
            "WITH gone AS (DELETE FROM allocation_parts WHERE allocation_id = $1 RETURNING gpu_uuid, memory_mib),"
            " d AS (DELETE FROM allocations WHERE id = $1)"
            " UPDATE gpus g SET allocated_memory_mib = g.allocated_memory_mib - gone.memory_mib FROM gone"
            " WHERE g.uuid = gone.gpu_uuid RETURNING g.uuid",
            kept,
        )
        await helpers.delete_pod(api, namespace, "gone")
        await eventually(lambda: _no_pod(api, namespace, "gone"), what="the pod gone", within=30)
    finally:
        binder.start()
        await binder.wait_ready(90)
    after = await eventually(
        lambda: _adopted(stack.database_url, namespace, kept), what="the claim adopted, the other ended", within=60
    )
    assert after["keep"]["state"] in ("bound", "assigned") and after["keep"]["memory_mib"] == 2048
    (gpu,) = await helpers.gpu_rows(stack.database_url, node)
    assert gpu["allocated_memory_mib"] == 2048


async def _no_pod(api, namespace: str, name: str) -> bool:  # type: ignore[no-untyped-def]
    return await w.raw_pod(api, namespace, name) is None


async def _adopted(database_url: str, namespace: str, kept) -> dict | None:  # type: ignore[no-untyped-def]
    allocs = await w.claim_allocations(database_url, namespace)
    # adoption records the claim (reserved) and then marks it bound through the binder's group commit: wait for both
    done = set(allocs) == {"keep"} and allocs["keep"]["id"] == kept and allocs["keep"]["state"] in ("bound", "assigned")
    return allocs if done else None
