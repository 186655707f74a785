"""Against a real kube-apiserver (devstack/cluster): node labels."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from kubernetes_asyncio import client

from devstack.cluster import ControlPlane
from devstack.cluster.nodes import create_gpu_node
from services.node_agent.agent import RESOURCES, NodeAgent
from services.node_agent.cli import _kube
from services.node_agent.discovery import FakeBackend
from tests.node_agent.conftest import NODE, Harness
from tests.system_tools import running_control_plane
from tests.waiting import eventually


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        yield cp


async def test_labels_the_node_once_the_ledger_holds_its_inventory(
    control_plane: ControlPlane, harness: Harness
) -> None:
    """Node labels need only node access: pod annotations are the binder's (they follow the ledger)."""
    kube = await _kube(str(control_plane.kubeconfig_path))
    api = kube.pop("api")
    assert set(kube) == {"patch_node_labels", "evict_pod"}, "the agent writes no pod annotations"
    core = client.CoreV1Api(api)
    try:
        await create_gpu_node(api, NODE, gpus=[(16, "Tesla-T4"), (16, "Tesla-T4"), (80, "A100")])
        # a second agent for the same node, with Kubernetes access (the harness agent has none)
        await harness.agent.close()
        agent = NodeAgent(harness.agent.config, FakeBackend(NODE, harness.backend.spec), bus=harness.bus, **kube)
        await agent.start()
        try:
            await harness.kubelet.wait_registered(RESOURCES, timeout_s=30, min_count=2)

            async def labels() -> dict[str, str] | None:
                found = (await core.read_node(NODE)).metadata.labels or {}
                return found if "gpu-type" in found else None

            found = await eventually(labels, what="the node labels")
            assert found["gpu-type"] == "mixed"
            assert found["gpushare.io/gpu-count"] == "3"
            assert found["gpushare.io/model.tesla-t4"] == "2"
        finally:
            await agent.close()
    finally:
        await api.close()
