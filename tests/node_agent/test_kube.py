"""Against a real kube-apiserver (devstack/cluster): node labels and the ASSIGNED pod annotation."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from kubernetes_asyncio import client

from devstack.cluster import ControlPlane
from devstack.cluster.nodes import create_gpu_node
from services.node_agent.agent import RESOURCES, NodeAgent
from services.node_agent.cli import _kube
from services.node_agent.discovery import FakeBackend
from shared.annotations import GPU_MEM_ASSIGNED
from shared.events.catalogue import AllocationPart
from shared.ledger.reservations import ReservationRequest
from tests.node_agent.conftest import NODE, Harness
from tests.system_tools import running_control_plane


@pytest.fixture(scope="module")
def control_plane() -> Iterator[ControlPlane]:
    with running_control_plane() as cp:
        yield cp


async def test_labels_node_and_marks_pod_assigned(control_plane: ControlPlane, harness: Harness) -> None:
    kube = await _kube(str(control_plane.kubeconfig_path))
    api = kube.pop("api")
    core = client.CoreV1Api(api)
    try:
        await create_gpu_node(api, NODE, gpus=[(16, "Tesla-T4"), (16, "Tesla-T4"), (80, "A100")])
        # a second agent for the same node, with Kubernetes access (the harness agent has none)
        await harness.agent.close()
        agent = NodeAgent(
            harness.agent.config,
            FakeBackend(NODE, harness.backend.spec),
            ledger=harness.ledger,
            bus=harness.bus,
            **kube,
        )
        await agent.start()
        try:
            await harness.kubelet.wait_registered(RESOURCES, timeout_s=30, min_count=2)
            node = await core.read_node(NODE)
            assert node.metadata.labels["gpu-type"] == "mixed"
            assert node.metadata.labels["gpushare.io/gpu-count"] == "3"
            assert node.metadata.labels["gpushare.io/model.tesla-t4"] == "2"

            body = {
                "metadata": {"name": "labelled", "namespace": "default"},
                "spec": {
                    "nodeName": NODE,
                    "containers": [
                        {"name": "main", "image": "busybox", "resources": {"limits": {"aliyun.com/gpu-mem": "3"}}}
                    ],
                },
            }
            created = await core.create_namespaced_pod("default", body)
            pod = api.sanitize_for_serialization(created)

            res = await harness.ledger.reserve(
                ReservationRequest(
                    pod_uid=created.metadata.uid,
                    namespace="default",
                    pod_name="labelled",
                    node=NODE,
                    parts=(AllocationPart(container="main", container_index=0, gpu_uuid=agent.gpus[2].uuid,
                                          gpu_index=2, memory_mib=3 * 1024),),
                )
            )  # fmt: skip
            await harness.ledger.mark_bound(res.allocation_id, created.metadata.uid, NODE)
            env = (await harness.kubelet.admit(pod))["main"]
            assert env["NVIDIA_VISIBLE_DEVICES"] == agent.gpus[2].uuid
            for _ in range(50):
                annotations = (await core.read_namespaced_pod("labelled", "default")).metadata.annotations or {}
                if annotations.get(GPU_MEM_ASSIGNED) == "true":
                    break
                await asyncio.sleep(0.1)
            assert annotations.get(GPU_MEM_ASSIGNED) == "true"
        finally:
            await agent.close()
    finally:
        await api.close()
