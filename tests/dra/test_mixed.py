"""Both paths in one cluster, end to end on the real 1.37.2 control plane: a device-plugin node (extender, device
plugins) and a DRA node (kube-scheduler's allocator, the binder's record), one ledger, filled at the same time. No
pod of one path lands on the other path's node (kube-scheduler's own count keeps aliyun.com/* pods off the DRA node,
which advertises none), no GPU is ever overcommitted in the ledger or in the claims'
`consumedCapacity` (sampled all along), and accounting shows the DRA shares like the extender's."""

from __future__ import annotations

import asyncio

from shared.dra.quantity import parse_quantity
from shared.dra.slices import device_name
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.waiting import eventually

pytestmark = needs_dra

STACK_NODES = 2
STACK_DRA_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"
GPU_MIB = 16384


async def _violations(stack, api) -> list[str]:  # type: ignore[no-untyped-def]
    """What is wrong right now: a ledger counter past capacity or not what its shares charge, or a device whose
    claims consumed more than it holds."""
    out = list(await w.ledger_exact(stack.database_url))
    for node in stack.node_names:
        for g in await helpers.gpu_rows(stack.database_url, node):
            if g["allocated_memory_mib"] > g["memory_mib"]:
                out.append(f"ledger overcommit on {node}: {g}")
    consumed: dict[str, int] = {}
    for c in await w.claims(api):
        for _, device, memory, _ in w.consumed(c):
            consumed[device] = consumed.get(device, 0) + int(parse_quantity(memory) / 2**20)
    out += [f"claims consumed {mib} MiB of {d}" for d, mib in consumed.items() if mib > GPU_MIB]
    return out


async def test_device_plugin_and_dra_nodes_fill_at_once_without_sharing_a_gpu(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    dp_node, dra_node = stack.node_names
    assert stack.dra_node_names == [dra_node]
    seen: list[str] = []
    done = asyncio.Event()

    async def watch() -> None:
        while not done.is_set():
            seen.extend(await _violations(stack, api))
            await asyncio.sleep(0.3)

    watcher = asyncio.create_task(watch())
    try:
        dp_pods = [f"dp{i}" for i in range(5)]
        dra_pods = [f"dra{i}" for i in range(5)]
        await w.create(api, namespace, w.template("gpu-4", [("main", "4Gi", None, 1)]))
        await asyncio.gather(
            *(helpers.create_pod(api, namespace, helpers.gpu_pod(n, [4])) for n in dp_pods),
            *(w.create(api, namespace, w.pod(n, [("main", "main")], template_name="gpu-4")) for n in dra_pods),
        )
        placed = await eventually(
            lambda: _placed(api, namespace, dp_pods + dra_pods, 8), what="eight pods bound", within=150, interval=0.5
        )
        assert sorted(n for n, node in placed.items() if node == dp_node) == sorted(
            n for n in placed if n.startswith("dp")
        ), placed
        assert sorted(n for n, node in placed.items() if node == dra_node) == sorted(
            n for n in placed if n.startswith("dra")
        ), placed
        assert sum(n.startswith("dp") for n in placed) == 4 and sum(n.startswith("dra") for n in placed) == 4
        waiting = sorted(set(dp_pods + dra_pods) - set(placed))
        for name in waiting:
            assert await helpers.stays_pending(api, namespace, name, 3)
        # kube-scheduler keeps aliyun.com/* pods off the DRA node by itself: it counts aliyun.com/gpu-mem per node
        # (the shipped configuration) and a DRA node advertises none, so NodeResourcesFit refuses it (allocatable 0
        # is below any request: unresolvable, so preemption skips it too) before the extender is asked
        (dp_waiting,) = [n for n in waiting if n.startswith("dp")]
        condition = await helpers.scheduled_condition(api, namespace, dp_waiting)
        assert "0/2 nodes are available: 2 Insufficient aliyun.com/gpu-mem" in condition, condition
        assert "DRA node" not in condition, condition  # the extender's own reason for a DRA node never shows
    finally:
        done.set()
        await watcher
    assert seen == []
    await w.wait_recorded(api, namespace, [n for n in placed if n.startswith("dra")])
    for node in (dp_node, dra_node):
        assert [g["allocated_memory_mib"] for g in await helpers.gpu_rows(stack.database_url, node)] == [GPU_MIB]
    # the DRA node's GPU holds claim shares only, the device-plugin node's none
    rows = await w.ledger_rows(
        stack.database_url,
        "SELECT node, claim_uid IS NOT NULL AS dra, count(*) AS n FROM allocations"
        " WHERE namespace = $1 AND state IN ('reserved', 'bound', 'assigned') GROUP BY node, dra",
        namespace,
    )
    assert {(r["node"], r["dra"]): r["n"] for r in rows} == {(dp_node, False): 4, (dra_node, True): 4}
    # one ledger, one view: accounting shows a DRA share like any other
    dra_pod = next(n for n in placed if n.startswith("dra"))
    view = await eventually(
        lambda: helpers.accounting_pod(stack, namespace, dra_pod), what="accounting's view of a DRA pod", within=30
    )
    assert view["allocation"]["node"] == dra_node and view["allocation"]["memory_mib"] == 4096
    slice_devices = [d["name"] for d in (await w.resource_slice(api, dra_node))["spec"]["devices"]]
    dp_gpu = (await helpers.gpu_rows(stack.database_url, dp_node))[0]["uuid"]
    assert device_name(dp_gpu) not in slice_devices  # the device-plugin node's GPU is in no slice


async def _placed(api, namespace: str, names: list[str], want: int) -> dict[str, str] | None:  # type: ignore[no-untyped-def]
    nodes = {n: await helpers.pod_node(api, namespace, n) for n in names}
    bound = {n: node for n, node in nodes.items() if node}
    return bound if len(bound) >= want else None
