"""The device plugins over real gRPC: registration, ListAndWatch with health, kubelet restart, MPS clients."""

from __future__ import annotations

import os
from collections.abc import Awaitable
from pathlib import Path

from services.node_agent.agent import RESOURCES
from services.node_agent.mps import MpsRoot
from services.node_agent.plugin import socket_name
from shared.annotations import RESOURCE_CORE, RESOURCE_COUNT, RESOURCE_MEM
from tests.node_agent.conftest import Harness
from tests.waiting import eventually


async def test_registration_and_device_lists(harness: Harness) -> None:
    k = harness.kubelet
    assert set(k.plugins) == set(RESOURCES)
    mem = k.devices(RESOURCE_MEM)
    assert len(mem) == 16 + 16 + 80
    assert all(h == "Healthy" for h in mem.values())
    assert f"{harness.gpu(2)}-_-79" in mem and f"{harness.gpu(2)}-_-80" not in mem
    assert len(k.devices(RESOURCE_CORE)) == 300
    assert sorted(k.devices(RESOURCE_COUNT)) == sorted(harness.gpu(i) for i in range(3))
    assert k.plugins[RESOURCE_MEM].options.pre_start_required
    assert k.plugins[RESOURCE_MEM].options.get_preferred_allocation_available
    assert not k.plugins[RESOURCE_CORE].options.pre_start_required
    assert (harness.root / "dp" / socket_name(RESOURCE_MEM)).exists()


async def test_list_and_watch_reports_health_change_and_recovery(harness: Harness) -> None:
    k, gpu1 = harness.kubelet, harness.gpu(1)

    def health_of(resource: str, device: str) -> str:
        return k.devices(resource).get(device, "")

    harness.backend.set_health(gpu1, False, "XID 79 fallen off the bus")
    # each resource's ListAndWatch stream carries the change on its own: wait for all of them
    await k.wait_for(
        lambda: (
            health_of(RESOURCE_MEM, f"{gpu1}-_-0") == "Unhealthy" and health_of(RESOURCE_COUNT, gpu1) == "Unhealthy"
        ),
        15,
    )
    assert health_of(RESOURCE_MEM, f"{harness.gpu(0)}-_-0") == "Healthy"
    from sqlalchemy import select

    from shared.ledger.models import gpus

    async def ledger_health() -> tuple[bool, str]:
        async with harness.ledger.engine.connect() as conn:
            row = (await conn.execute(select(gpus.c.healthy, gpus.c.health_reason).where(gpus.c.uuid == gpu1))).one()
        return row.healthy, row.health_reason

    # kubelet hears first; the ledger follows through the binder's gateway
    await eventually(lambda: _is(ledger_health(), False), what="the ledger to record the GPU unhealthy")
    assert "XID 79" in (await ledger_health())[1]

    harness.backend.set_health(gpu1, True)
    await k.wait_for(lambda: health_of(RESOURCE_MEM, f"{gpu1}-_-0") == "Healthy", 15)
    await eventually(lambda: _is(ledger_health(), True), what="the ledger to record the GPU healthy again")


async def _is(health: Awaitable[tuple[bool, str]], healthy: bool) -> bool:
    return (await health)[0] is healthy


async def test_kubelet_restart_leads_to_reregistration(harness: Harness) -> None:
    k = harness.kubelet
    before = dict(k.registrations)
    assert all(before[r] == 1 for r in RESOURCES)
    await k.restart()
    await k.wait_registered(RESOURCES, timeout_s=30, min_count=2)
    assert all(k.registrations[r] == 2 for r in RESOURCES)
    assert (harness.root / "dp" / socket_name(RESOURCE_MEM)).exists()
    assert len(k.devices(RESOURCE_MEM)) == 112
    # the re-registered plugin still allocates
    pod, _alloc = await harness.reserve("after-restart", [("main", [(0, 2)])])
    envs = await k.admit(pod)
    assert envs["main"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)


async def test_agent_restart_registers_again_with_same_identity(harness: Harness) -> None:
    from services.node_agent.agent import NodeAgent

    k = harness.kubelet
    uuids = [g.uuid for g in harness.agent.gpus]
    await harness.agent.close()
    second = NodeAgent(
        harness.agent.config,
        type(harness.backend)(harness.agent.config.node, harness.backend.spec),
        bus=harness.bus,
    )
    await second.start()
    try:
        await k.wait_registered(RESOURCES, timeout_s=30, min_count=2)
        assert [g.uuid for g in second.gpus] == uuids
    finally:
        await second.close()


async def test_containers_become_mps_clients_while_the_control_daemon_runs(harness: Harness, tmp_path: Path) -> None:
    """`--mps-root`: MPS limits, the pipe directory and the daemon's /dev/shm only while its control pipe exists."""
    root = MpsRoot(tmp_path / "mps")
    root.pipe_dir.mkdir(parents=True)
    harness.agent.assigner.mps_root = root
    k = harness.kubelet

    pod, _ = await harness.reserve("no-daemon", [("main", [(0, 2)])])
    env = (await k.admit(pod))["main"]
    assert not {v for v in env if v.startswith("CUDA_MPS_")}, env
    assert k.mounts[(pod["metadata"]["uid"], "main")] == []

    os.mkfifo(root.pipe_dir / "control")  # what nvidia-cuda-mps-control creates when it starts
    pod, _ = await harness.reserve("client", [("main", [(0, 4)])])
    env = (await k.admit(pod))["main"]
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root.pipe_dir)
    assert env["CUDA_MPS_PINNED_DEVICE_MEM_LIMIT"] == f"0={4 * 1024}M"
    assert env["CUDA_MPS_ACTIVE_THREAD_PERCENTAGE"] == "25"  # 4 of the T4's 16 GiB, no compute asked
    assert k.mounts[(pod["metadata"]["uid"], "main")] == [  # (container path, host path)
        (str(root.pipe_dir), str(root.pipe_dir)),
        ("/dev/shm", str(root.shm_dir)),
    ]


async def test_volume_mount_device_lists(harness: Harness) -> None:
    """--device-list-strategy volume-mounts: the GPU list travels as mounts the NVIDIA toolkit reads (so that with
    accept-nvidia-visible-devices-envvar-when-unprivileged = false a pod's own NVIDIA_VISIBLE_DEVICES is ignored)."""
    from services.node_agent.assignment import DEVICE_LIST_ROOT

    for plugin in harness.agent.plugins:
        plugin.servicer.device_list = "volume-mounts"
    pod, _ = await harness.reserve("mounted", [("main", [(0, 2), (1, 2)])])
    env = (await harness.kubelet.admit(pod))["main"]
    assert env["NVIDIA_VISIBLE_DEVICES"] == DEVICE_LIST_ROOT
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"  # the rest of the environment is unchanged
    mounts = harness.kubelet.mounts[(pod["metadata"]["uid"], "main")]
    assert mounts == [
        (f"{DEVICE_LIST_ROOT}/{harness.gpu(0)}", "/dev/null"),
        (f"{DEVICE_LIST_ROOT}/{harness.gpu(1)}", "/dev/null"),
    ]
    for plugin in harness.agent.plugins:
        plugin.servicer.device_list = "envvar"
    plain, _ = await harness.reserve("plain", [("main", [(0, 1)])])
    assert (await harness.kubelet.admit(plain))["main"]["NVIDIA_VISIBLE_DEVICES"] == harness.gpu(0)
    assert harness.kubelet.mounts[(plain["metadata"]["uid"], "main")] == []
