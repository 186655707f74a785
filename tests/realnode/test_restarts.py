"""Restarts and refusals on a real node (kubelet v1.37.2, containerd, runc): kubelet restarted while pods run, the
node agent restarted (and killed with kubelet's Allocate in flight), and a kubelet that refuses the node agent's
registration. Every container's printed environment is compared with the ledger; nothing is charged for what
did not run."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import signal
import sys
from pathlib import Path
from typing import Any

import grpc
import pytest
from kubernetes_asyncio import client

from devstack.cluster import node_cleanup
from devstack.embedded import free_port
from devstack.stack import spec
from devstack.stack.processes import ServiceProcess
from shared.kubelet_api import load
from tests.e2e import helpers as h
from tests.realnode import helpers as r
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

STACK_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"
STACK_NODES_KIND = "real"


def node_of(stack: Any) -> Any:
    return stack.real_nodes[stack.node_names[0]]


async def assigned_parts(stack: Any, namespace: str, pod: str) -> list[dict[str, Any]]:
    async def assigned() -> dict[str, Any] | None:
        now = (await h.ledger_allocations(stack.database_url, namespace)).get(pod)
        return now if now and now["state"] == "assigned" else None

    return list((await h.poll(assigned, 60, what=f"{namespace}/{pod} assigned in the ledger"))["parts"])


async def run_exact(stack: Any, api: Any, namespace: str, name: str, gib: int) -> dict[str, str]:
    """Start a one-container pod of `gib` GiB and check what it received against the ledger; returns its env."""
    await h.create_pod(api, namespace, r.pod(name, [r.container("main", node_of(stack).workload_image, mem=gib)]))
    await r.wait_running(api, namespace, name, timeout_s=90)
    env = await r.printed_env(api, namespace, name, "main")
    (part,) = await assigned_parts(stack, namespace, name)
    assert env["NVIDIA_VISIBLE_DEVICES"] == part["gpu_uuid"], (env, part)
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(gib) == str(part["memory_mib"] // 1024)
    return env


async def kubelet_devices(stack: Any) -> dict[str, set[str]]:
    """What the real kubelet's pod-resources API lists: `pod name` -> its aliyun.com/gpu-mem device IDs."""
    pb2, grpc_mod = load("podresources")
    socket = node_of(stack).pod_resources_socket
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        answer = await grpc_mod.PodResourcesListerStub(channel).List(pb2.ListPodResourcesRequest(), timeout=10)
    out: dict[str, set[str]] = {}
    for pod in answer.pod_resources:
        ids = {
            i
            for c in pod.containers
            for d in c.devices
            if d.resource_name == "aliyun.com/gpu-mem"
            for i in d.device_ids
        }
        if ids:
            out[pod.name] = ids
    return out


async def kubelet_healthy_devices(stack: Any) -> int:
    """How many aliyun.com/gpu-mem devices kubelet can allocate now: pod-resources `GetAllocatableResources` (the
    healthy devices of its registered plugins; k8s.io/kubelet/pkg/apis/podresources/v1/api.proto, its response's
    field 1 the repeated `ContainerDevices`). The project's proto leaves that call out (the agent never makes it),
    so the answer is read here field by field."""
    pb2, _ = load("podresources")
    socket = node_of(stack).pod_resources_socket
    async with grpc.aio.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(
            "/v1.PodResourcesLister/GetAllocatableResources",
            request_serializer=lambda _: b"",
            response_deserializer=lambda raw: raw,
        )
        raw = await call(None, timeout=10)
    devices = [pb2.ContainerDevices.FromString(value) for field, value in _fields(raw) if field == 1]
    return sum(len(d.device_ids) for d in devices if d.resource_name == "aliyun.com/gpu-mem")


def _fields(raw: bytes) -> list[tuple[int, bytes]]:
    """The length-delimited fields of a protobuf message, (number, bytes) (other wire types skipped)."""

    def varint(i: int) -> tuple[int, int]:
        value = shift = 0
        while True:
            byte = raw[i]
            value |= (byte & 0x7F) << shift
            i, shift = i + 1, shift + 7
            if byte < 0x80:
                return value, i

    out, i = [], 0
    while i < len(raw):
        key, i = varint(i)
        wire = key & 7
        if wire == 2:
            size, i = varint(i)
            out.append((key >> 3, raw[i : i + size]))
            i += size
        elif wire == 0:
            _, i = varint(i)
        else:
            i += 8 if wire == 1 else 4
    return out


async def served_again(stack: Any) -> None:
    """Until kubelet has the node agent's 32 gpu-mem devices healthy again (it registered and listed them): a pod
    kubelet admits before that fails (see `test_the_node_agent_restarted_and_killed_with_an_allocate_in_flight`)."""
    await eventually(
        lambda: _is(kubelet_healthy_devices(stack), 32), what="kubelet's healthy gpu-mem devices", within=60
    )


async def _is(value: Any, expected: Any) -> bool:
    return bool(await value == expected)


async def container_id(api: Any, namespace: str, pod: str) -> str:
    p = await client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
    (status,) = p.status.container_statuses
    return str(status.container_id)


async def test_kubelet_restarted_while_pods_run_keeps_them_and_its_devices(stack, api, namespace) -> None:
    await run_exact(stack, api, namespace, "before", 4)
    held = (await kubelet_devices(stack))["before"]
    started = await container_id(api, namespace, "before")
    await asyncio.to_thread(node_of(stack).restart_kubelet)
    # the container ran on: same container, never restarted; kubelet read its device checkpoint
    assert await container_id(api, namespace, "before") == started
    p = await client.CoreV1Api(api).read_namespaced_pod("before", namespace)
    assert p.status.container_statuses[0].restart_count == 0

    async def listed_again() -> set[str] | None:  # kubelet lists its pods once it synced them after the restart
        return (await kubelet_devices(stack)).get("before")

    assert await eventually(listed_again, what="kubelet listing the running pod's devices again", within=30) == held
    await served_again(stack)
    # a new pod on the same GPU (binpack: 12 GiB fill it up) gets the 12 devices kubelet knows are free, and
    # exactly its ledger share (the node agent registered again with the new kubelet)
    env = await run_exact(stack, api, namespace, "after", 12)
    assert (
        env["NVIDIA_VISIBLE_DEVICES"]
        == (await r.printed_env(api, namespace, "before", "main"))["NVIDIA_VISIBLE_DEVICES"]
    )
    devices = await kubelet_devices(stack)
    assert len(devices["after"]) == 12 and not devices["after"] & devices["before"]
    assert await h.ledger_disagreements(stack.database_url) == []


async def test_the_node_agent_restarted_and_killed_with_an_allocate_in_flight(stack, api, namespace) -> None:
    agent = stack.processes[f"node-agent-{stack.node_names[0]}"]
    await run_exact(stack, api, namespace, "steady", 4)
    steady = await container_id(api, namespace, "steady")
    # a plain restart: registration, ListAndWatch and Allocate work again, the running pod is left alone
    await asyncio.to_thread(agent.stop)
    agent.start()
    await agent.wait_ready(60)
    await served_again(stack)
    await run_exact(stack, api, namespace, "after-restart", 4)
    assert await container_id(api, namespace, "steady") == steady

    # kubelet's Allocate reaches an agent that never answers (stopped), which then dies: kubelet refuses the pod
    # at admission, naming the call, and the ledger keeps nothing for it
    assert agent.popen is not None
    os.kill(agent.popen.pid, signal.SIGSTOP)
    try:
        await h.create_pod(
            api, namespace, r.pod("in-flight", [r.container("main", node_of(stack).workload_image, mem=4)])
        )
        await h.wait_bound(api, namespace, ["in-flight"])
        await r.settle(3)  # kubelet admits a pod within a second of its binding: its Allocate is now waiting
    finally:
        os.kill(agent.popen.pid, signal.SIGKILL)
        os.kill(agent.popen.pid, signal.SIGCONT)
        agent.popen.wait(10)
    failed = await r.wait_pod(api, namespace, "in-flight", lambda p: p.status.phase == "Failed", "Failed")
    assert failed.status.reason == "UnexpectedAdmissionError", failed.status
    assert "Allocate" in failed.status.message or "rpc error" in failed.status.message, failed.status.message
    agent.start()
    await agent.wait_ready(60)
    await h.wait_released(stack.database_url, namespace, "in-flight", timeout_s=60)
    await served_again(stack)
    await run_exact(stack, api, namespace, "after-kill", 4)
    assert await container_id(api, namespace, "steady") == steady
    assert await h.ledger_disagreements(stack.database_url) == []


async def test_a_kubelet_refusing_the_registration_is_named_and_nothing_is_charged(
    stack, api, namespace, tmp_path: Path
) -> None:
    """The agent's plugin sockets are where kubelet cannot reach them (the agent is given a device-plugin folder
    that is not kubelet's, though it reaches kubelet.sock): kubelet v1.37.2 tries to dial the endpoint it was told
    for 10 s, then refuses the registration (`server.Register`, `connectClient` in pkg/kubelet/cm/devicemanager/
    plugin/v1beta1)."""
    node_name = stack.node_names[0]
    node = node_of(stack)
    agent = stack.processes[f"node-agent-{node_name}"]
    elsewhere = tmp_path / "dp"
    elsewhere.mkdir()
    (elsewhere / "kubelet.sock").symlink_to(node.device_plugin_dir / "kubelet.sock")
    command = spec.node_agent_command(
        stack._common(),
        node=node_name,
        gpus=stack.config.gpus,
        device_plugin_dir=str(elsewhere),
        pod_resources_socket=str(node.pod_resources_socket),
        metrics_port=free_port(),
        kubeconfig=stack.services_kubeconfig,
        address="127.0.0.1",
    )
    misplaced = ServiceProcess(dataclasses.replace(command, name=f"node-agent-{node_name}-misplaced"), stack.log_dir)
    await asyncio.to_thread(agent.stop)
    misplaced.start()
    try:
        await misplaced.wait_ready(60)

        def refusal() -> list[dict[str, Any]]:
            records = [json.loads(line) for line in misplaced.log_path.read_text().splitlines() if line.startswith("{")]
            return [rec for rec in records if "kubelet refused" in rec.get("msg", "")]

        await eventually(lambda: bool(refusal()), what="the agent's log naming kubelet's refusal", within=40)
        (first, *_) = refusal()
        assert first["level"] == "error", first
        assert "aliyun.com/" in first["msg"] and "failed to dial device plugin" in first["msg"], first
        await h.create_pod(api, namespace, r.pod("unserved", [r.container("main", node.workload_image, mem=4)]))
        view = await h.wait_pending_reason(stack, namespace, "unserved", timeout_s=60)
        assert "Insufficient aliyun.com/gpu-mem" in view["pending"]["summary"], view["pending"]
        assert "unserved" not in await h.ledger_allocations(stack.database_url, namespace)
    finally:
        await asyncio.to_thread(misplaced.stop)
        agent.start()
    await agent.wait_ready(60)
    await served_again(stack)
    await r.wait_running(api, namespace, "unserved", timeout_s=90)  # served once the agent is back in place
    env = await r.printed_env(api, namespace, "unserved", "main")
    (part,) = await assigned_parts(stack, namespace, "unserved")
    assert env["NVIDIA_VISIBLE_DEVICES"] == part["gpu_uuid"]


async def test_a_node_whose_owner_was_killed_leaves_nothing_behind(stack, api, namespace) -> None:
    """A test run killed with its real node up (no teardown ran) leaves kubelet, containerd, a shim and a container
    running, mounts and cgroups: the next node's start sweeps them all (`node_cleanup.sweep_stale`)."""
    cp = stack.control_plane
    script = "\n".join(
        [
            "import sys, time, types",
            "from pathlib import Path",
            "from devstack.cluster.realnode import RealNode",
            "from devstack.cluster.releases import CURRENT",
            f"cp = types.SimpleNamespace(release=CURRENT, kubeconfig_path=Path({str(cp.kubeconfig_path)!r}),",
            f"    kubelet_client_ca=Path({str(cp.kubelet_client_ca)!r}),",
            f"    server_url={cp.server_url!r}, token={cp.token!r})",
            "node = RealNode('orphaned', cp, progress=lambda m: None).start()",
            "print(node.folder, node.cgroup_root, flush=True)",
            "time.sleep(600)",
        ]
    )
    owner = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdout=asyncio.subprocess.PIPE)
    try:
        assert owner.stdout is not None
        line = (await asyncio.wait_for(owner.stdout.readline(), 120)).decode().split()
        folder, cgroup_root = Path(line[0]), line[1]
        body = r.pod("stranded", [r.container("main", node_of(stack).workload_image)])
        body["spec"]["nodeName"] = "orphaned"
        await h.create_pod(api, namespace, body)
        await r.wait_running(api, namespace, "stranded")
    finally:
        owner.kill()  # as a killed test run: no teardown
        await owner.wait()
    assert node_cleanup.pids_naming(folder), "kubelet, containerd and the shim outlive their owner"
    assert node_cleanup.cgroup_pids(cgroup_root), "the container runs on"
    assert folder in node_cleanup.sweep_stale()
    left = await asyncio.to_thread(_left_of, folder, cgroup_root)
    assert left == [], left
    await client.CoreV1Api(api).delete_node("orphaned")


def _left_of(folder: Path, cgroup_root: str) -> list[str]:
    """What is left of a node: processes naming its folder or in its cgroups, mounts, cgroups, the folder."""
    left = [f"process {p}" for p in node_cleanup.pids_naming(folder) | node_cleanup.cgroup_pids(cgroup_root)]
    left += [f"mount {m}" for m in node_cleanup.mounts_under(folder)]
    left += [
        str(m / cgroup_root.strip("/")) for m in node_cleanup.cgroup_mounts() if (m / cgroup_root.strip("/")).exists()
    ]
    return left + ([str(folder)] if folder.exists() else [])
