"""Usage samples: processes mapped to pods through /proc/<pid>/cgroup, published on the bus; metrics."""

from __future__ import annotations

import asyncio

from services.node_agent.discovery import ProcessUsage
from shared.events.catalogue import decode_event
from tests.node_agent.conftest import Harness


async def test_usage_sample_publication_and_overuse(harness: Harness) -> None:
    pod, _alloc = await harness.reserve("busy", [("main", [(0, 2)])])
    uid = pod["metadata"]["uid"]
    proc = harness.root / "proc"
    (proc / "4242").mkdir(parents=True)
    (proc / "4242" / "cgroup").write_text(f"0::/kubepods.slice/kubepods-pod{uid.replace('-', '_')}.slice/cri-x\n")
    (proc / "777").mkdir()
    (proc / "777" / "cgroup").write_text("0::/system.slice/sshd.service\n")
    g0 = harness.gpu(0)
    harness.backend.set_processes([ProcessUsage(4242, g0, 3000), ProcessUsage(777, g0, 100)], utilization={g0: 42.0})
    received: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        await received.put(decode_event(msg.data))

    sub = await harness.bus.nc.subscribe(f"{harness.bus.names.prefix}.usage.>", cb=on_msg)
    try:
        await harness.agent.sample_usage()
        event = await asyncio.wait_for(received.get(), 5)
    finally:
        await sub.unsubscribe()
    assert event.kind == "usage" and event.node == harness.agent.config.node
    by_pod = {s.pod_uid: s for s in event.samples}
    assert by_pod[uid].used_memory_mib == 3000 and by_pod[uid].pod_name == "busy"
    assert by_pod[uid].container == "main" and by_pod[uid].utilization_pct == 42.0
    assert by_pod[""].used_memory_mib == 100
    # 3000 MiB used > 2048 allocated; grace is 0 in the harness -> an over-use episode is reported
    reg = harness.agent.metrics.registry
    labels = {"node": harness.agent.config.node, "namespace": "default", "pod": "busy"}
    mib = 1024 * 1024
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_overuse_episodes_total", labels) == 1
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_used_bytes", labels) == 3000 * mib
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_allocated_bytes", labels) == 2048 * mib
    node = harness.agent.config.node  # dcgm-exporter's labels: gpu = index, UUID, modelName, Hostname
    gpu_labels = {"node": node, "Hostname": node, "gpu": "0", "UUID": g0, "modelName": "Tesla-T4"}
    assert reg.get_sample_value("gpushare_node_agent_gpu_memory_used_bytes", gpu_labels) == 3100 * mib
    assert reg.get_sample_value("gpushare_node_agent_gpu_memory_allocated_bytes", gpu_labels) == 2048 * mib
    assert reg.get_sample_value("gpushare_node_agent_gpu_memory_bytes", gpu_labels) == 16384 * mib
    assert reg.get_sample_value("gpushare_node_agent_gpu_utilization_ratio", gpu_labels) == 0.42
