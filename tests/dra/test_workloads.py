"""Pod shapes on a DRA node with two 16 GiB GPUs, end to end on the real 1.37.2 control plane: a two-container pod,
a pod with an init container and a sidecar, and a pod asking two GPUs (`count: 2`). The ledger records what
kube-scheduler consumed (its counters equal the claims' `consumedCapacity`), and each container gets, through CDI,
the environment the device-plugin path would give it for its share."""

from __future__ import annotations

import pytest

from shared.annotations import ALLOCATION, parse_allocation
from shared.dra.quantity import parse_quantity
from shared.dra.slices import device_name
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.waiting import eventually

pytestmark = needs_dra

STACK_NODES = 1
STACK_DRA_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"


async def _parts(api, namespace: str, pod: str) -> dict[str, list[tuple[int, int, bool, bool]]]:  # type: ignore[no-untyped-def]
    """container -> [(GPU index, MiB, init, sidecar)] from the pod's allocation record."""
    raw = await w.annotated_pod(api, namespace, pod)
    _, _, parts = parse_allocation(raw["metadata"]["annotations"][ALLOCATION])
    out: dict[str, list[tuple[int, int, bool, bool]]] = {}
    for p in parts:
        out.setdefault(p.container, []).append((p.gpu_index, p.memory_mib, p.init, p.sidecar))
    return out


async def _ledger_equals_claims(stack, api) -> None:  # type: ignore[no-untyped-def]
    """Each GPU's allocated memory in the ledger is the sum of what the claims consumed on its device (once the
    claims of the previous test's pods are gone: the controller deletes them after their pods)."""
    node = stack.node_names[0]

    async def equal() -> bool:
        rows = await helpers.gpu_rows(stack.database_url, node)
        consumed: dict[str, int] = {}
        for c in await w.claims(api):
            for _, device, memory, _ in w.consumed(c):
                consumed[device] = consumed.get(device, 0) + int(parse_quantity(memory) / 2**20)
        return {device_name(r["uuid"]): r["allocated_memory_mib"] for r in rows} == {
            device_name(r["uuid"]): consumed.get(device_name(r["uuid"]), 0) for r in rows
        }

    assert await eventually(equal, what="the ledger's counters to equal the claims' consumedCapacity", within=30)


async def test_a_two_container_pod_gets_a_share_per_container(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    await w.create(
        api,
        namespace,
        w.template("two", [("r-a", "4Gi", None, 1), ("r-b", "2Gi", "20", 1)]),
        w.pod("duo", [("a", "r-a"), ("b", "r-b")], template_name="two"),
    )
    await helpers.wait_bound(api, namespace, ["duo"])
    await w.wait_recorded(api, namespace, ["duo"])
    parts = await _parts(api, namespace, "duo")
    assert [m for _, m, _, _ in parts["a"]] == [4096] and [m for _, m, _, _ in parts["b"]] == [2048]
    env_a = await helpers.container_env(stack, node, namespace, "duo", "a")
    env_b = await helpers.container_env(stack, node, namespace, "duo", "b")
    assert (env_a["ALIYUN_COM_GPU_MEM_CONTAINER"], env_b["ALIYUN_COM_GPU_MEM_CONTAINER"]) == ("4", "2")
    assert env_a["ALIYUN_COM_GPU_MEM_POD"] == env_b["ALIYUN_COM_GPU_MEM_POD"] == "6"
    assert env_b["GPUSHARE_GPU_MEMORY_MIB"] == "2048"
    await _ledger_equals_claims(stack, api)


async def test_init_containers_and_sidecars_hold_their_shares_as_dra_charges_them(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    await w.create(
        api,
        namespace,
        w.template("side", [("r-init", "1Gi", None, 1), ("r-side", "1Gi", None, 1), ("r-app", "2Gi", None, 1)]),
        w.pod(
            "sidecar",
            [("main", "r-app")],
            inits=[("setup", "r-init", False), ("proxy", "r-side", True)],
            template_name="side",
        ),
    )
    await helpers.wait_bound(api, namespace, ["sidecar"])
    await w.wait_recorded(api, namespace, ["sidecar"])
    parts = await _parts(api, namespace, "sidecar")
    assert {c: [(m, i, s) for _, m, i, s in v] for c, v in parts.items()} == {
        "setup": [(1024, True, True)],  # held for the pod's life under DRA: charged beside the app (see claims.py)
        "proxy": [(1024, True, True)],
        "main": [(2048, False, False)],
    }
    allocs = await w.claim_allocations(stack.database_url, namespace)
    assert allocs["sidecar"]["memory_mib"] == 4096  # 1 + 1 + 2: what kube-scheduler consumed
    for container, gib in (("setup", "1"), ("proxy", "1"), ("main", "2")):
        env = await helpers.container_env(stack, node, namespace, "sidecar", container)
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == gib
    await _ledger_equals_claims(stack, api)


async def test_a_count_two_request_gets_two_gpus(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.node_names[0]
    await w.create(
        api,
        namespace,
        w.template("pair", [("both", "8Gi", None, 2)]),
        w.pod("pair", [("main", "both")], template_name="pair"),
    )
    await helpers.wait_bound(api, namespace, ["pair"])
    await w.wait_recorded(api, namespace, ["pair"])
    claim = await w.pod_claim(api, namespace, "pair")
    devices = [d for _, d, _, _ in w.consumed(claim)]
    assert len(set(devices)) == 2  # a request's devices are distinct
    parts = await _parts(api, namespace, "pair")
    assert sorted((g, m) for g, m, _, _ in parts["main"]) == [(0, 8192), (1, 8192)]
    env = await helpers.container_env(stack, node, namespace, "pair", "main")
    gpus = await helpers.gpu_rows(stack.database_url, node)
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(g["uuid"] for g in gpus)
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1" and env["ALIYUN_COM_GPU_MEM_CONTAINER"] == "16"
    assert await eventually(
        lambda: _assigned(stack.database_url, namespace, "pair"), what="the pair assigned", within=30
    )
    await _ledger_equals_claims(stack, api)


async def _assigned(database_url: str, namespace: str, pod: str) -> bool:
    allocs = await w.claim_allocations(database_url, namespace)
    return pod in allocs and allocs[pod]["state"] == "assigned"


@pytest.fixture(autouse=True)
async def _exact_after(stack):  # type: ignore[no-untyped-def]
    yield
    assert await w.ledger_exact(stack.database_url) == []
