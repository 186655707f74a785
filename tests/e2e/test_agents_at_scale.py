"""Node agents at cluster scale: one agent process per node, a burst of GPU pods through the real
kube-scheduler, and PostgreSQL connections that do not depend on the number of nodes.

The bounded profile runs 8 agents and 160 pods; `make soak` (GPUSHARE_SOAK=1) runs the issue's 40 agents and
1,000 pods. No pod sees a database error (not in kube-scheduler's answers, not at admission), every
container's GPU is the one the ledger records, no GPU holds more than it has, and the product's database
connections stay under the central services' caps the whole time.
"""

from __future__ import annotations

import asyncio
from collections import defaultdict

import pytest
from kubernetes_asyncio import client

from devstack.embedded import sample_connections
from tests.e2e import helpers as h
from tests.reliability.profile import PROFILE

pytestmark = pytest.mark.e2e

STACK_NODES = PROFILE.scale_nodes
STACK_GPUS = "4x16GiB:Tesla-T4"
IN_FLIGHT = 16
CONNECTION_CAP = (6 + 5 + 3) + 3  # the three pools and a commit probe each (docs/architecture.md); agents hold none
DB_ERROR_MARKERS = ("dbapierror", "asyncpg", "too many clients", "sqlalchemy", "operationalerror")


async def test_a_burst_over_many_agents(stack, api, namespace) -> None:
    pods = PROFILE.scale_pods
    names = [f"scale-{i:04d}" for i in range(pods)]
    samples: list[int] = []
    stop = asyncio.Event()
    sampler = asyncio.create_task(sample_connections(stack.database_url, samples, stop))
    gate = asyncio.Semaphore(IN_FLIGHT)

    async def create(i: int, name: str) -> None:
        async with gate:
            await h.create_pod(api, namespace, h.gpu_pod(name, [1 + i % 2]))

    try:
        await asyncio.gather(*(create(i, n) for i, n in enumerate(names)))
        placed = await h.wait_bound(api, namespace, names, timeout_s=600)

        async def all_started() -> dict | None:
            envs = {}
            for name in names:
                env = await h.kubelet_env(stack.kubelets[placed[name]], namespace, name, "c0")
                if env is not None:
                    envs[name] = env
            return envs if len(envs) == pods else None

        envs = await h.poll(all_started, 600, interval=2, what=f"{pods} containers started")
    finally:
        stop.set()
        await sampler

    ledger = await h.ledger_allocations(stack.database_url, namespace)
    assert len(ledger) == pods
    wrong = [n for n in names if envs[n]["NVIDIA_VISIBLE_DEVICES"] != ledger[n]["parts"][0]["gpu_uuid"]]
    assert not wrong, f"{len(wrong)} containers got another GPU than the ledger records, e.g. {wrong[:5]}"

    held: dict[str, int] = defaultdict(int)
    for alloc in ledger.values():
        for part in alloc["parts"]:
            held[part["gpu_uuid"]] += part["memory_mib"]
    for node in stack.node_names:
        for gpu in await h.gpu_rows(stack.database_url, node):
            assert held.get(gpu["uuid"], 0) <= gpu["memory_mib"] and gpu["allocated_memory_mib"] <= gpu["memory_mib"]

    core = client.CoreV1Api(api)
    messages = [(e.involved_object.name, e.message or "") for e in (await core.list_namespaced_event(namespace)).items]
    messages += [(key[1], err) for k in stack.kubelets.values() for key, err in k.errors.items()]
    leaked = [(n, m) for n, m in messages if any(marker in m.lower() for marker in DB_ERROR_MARKERS)]
    assert not leaked, f"database errors reached pods: {leaked[:3]}"

    assert samples and max(samples) <= CONNECTION_CAP, (max(samples), CONNECTION_CAP)
    print(f"\n{STACK_NODES} agent processes, {pods} pods: at most {max(samples)} PostgreSQL connections")
