"""Usage samples: processes mapped to pods through /proc/<pid>/cgroup, published on the bus; metrics."""

from __future__ import annotations

import asyncio
import json
import time

from services.node_agent.discovery import ProcessUsage
from shared.events.catalogue import UsageEvent, decode_event, encode_event
from tests.node_agent.conftest import Harness
from tests.waiting import eventually


async def sampled(harness: Harness) -> UsageEvent:
    """One round of the agent's usage sampling, as the bus carried it."""
    received: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        await received.put(decode_event(msg.data))

    sub = await harness.bus.nc.subscribe(f"{harness.bus.names.prefix}.usage.>", cb=on_msg)
    try:
        await harness.agent.sample_usage()
        return await asyncio.wait_for(received.get(), 5)
    finally:
        await sub.unsubscribe()


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
    event = await sampled(harness)
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


async def test_a_pod_using_a_gpu_it_holds_no_share_on_is_flagged(harness: Harness) -> None:
    """Before, such use was skipped: no metric, no event. Now it is flagged (grace 0 in the harness)."""
    pod, _alloc = await harness.reserve("sneaky", [("main", [(0, 2)])])
    uid = pod["metadata"]["uid"]
    outsider = "0b5c4a1e-1111-2222-3333-444455556666"  # a pod holding no share on this node at all
    proc = harness.root / "proc"
    for pid, pod_uid in ((5151, uid), (6161, outsider)):
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod_uid}/cri-x\n")
    g0, g1 = harness.gpu(0), harness.gpu(1)
    harness.backend.set_processes([ProcessUsage(5151, g1, 700), ProcessUsage(6161, g0, 90)])
    received: asyncio.Queue = asyncio.Queue()

    async def on_msg(msg) -> None:  # type: ignore[no-untyped-def]
        await received.put(decode_event(msg.data))

    sub = await harness.bus.nc.subscribe(f"{harness.bus.names.prefix}.unallocated.>", cb=on_msg)
    try:
        await harness.agent.sample_usage()
        events = [await asyncio.wait_for(received.get(), 5) for _ in range(2)]
    finally:
        await sub.unsubscribe()
    by_pod = {e.pod_uid: e for e in events}
    assert by_pod[uid].gpu_uuid == g1 and by_pod[uid].pod_name == "sneaky" and by_pod[uid].used_memory_mib == 700
    assert by_pod[outsider].gpu_uuid == g0 and by_pod[outsider].pod_name == ""
    reg = harness.agent.metrics.registry
    node = harness.agent.config.node
    gpu = {"node": node, "Hostname": node, "modelName": "Tesla-T4"}  # dcgm-exporter's GPU labels, and the pod
    mine = {**gpu, "gpu": "1", "UUID": g1, "namespace": "default", "pod": "sneaky"}
    theirs = {**gpu, "gpu": "0", "UUID": g0, "namespace": "", "pod": outsider}
    for labels in (mine, theirs):
        assert reg.get_sample_value("gpushare_node_agent_pod_unallocated_gpu_use", labels) == 1
        assert reg.get_sample_value("gpushare_node_agent_pod_unallocated_gpu_use_episodes_total", labels) == 1
    pod_labels = {"node": node, "namespace": "default", "pod": "sneaky"}
    overuse = "gpushare_node_agent_pod_gpu_memory_overuse"
    assert reg.get_sample_value(overuse, pod_labels) == 0  # not an over-use of its share
    harness.backend.set_processes([])
    await harness.agent.sample_usage()
    assert reg.get_sample_value("gpushare_node_agent_pod_unallocated_gpu_use", mine) == 0  # the episode ended


async def test_a_burst_of_ledger_events_refreshes_the_gpu_gauges_a_few_times_not_once_per_event(
    harness: Harness,
) -> None:
    """Each refresh walks every allocation on the node: one per event made a burst of N pods cost N x N steps
    (the node agents' CPU per GPU pod grew with the pods on the node). The gauges still end up exact."""
    refreshes = 0
    refresh = harness.agent._update_gpu_metrics

    def counted() -> None:
        nonlocal refreshes
        refreshes += 1
        refresh()

    harness.agent._update_gpu_metrics = counted  # type: ignore[method-assign]
    pods = 20
    began = time.monotonic()
    for i in range(pods):
        await harness.reserve(f"burst-{i}", [("main", [(2, 1)])], wait_for_view=False)  # 1 GiB each on the A100
    reg = harness.agent.metrics.registry
    node = harness.agent.config.node
    a100 = {"node": node, "Hostname": node, "gpu": "2", "UUID": harness.gpu(2), "modelName": "A100"}
    await eventually(
        lambda: reg.get_sample_value("gpushare_node_agent_gpu_memory_allocated_bytes", a100) == pods * 1024**3,
        what="the A100's allocated gauge after the burst",
    )
    burst_s = time.monotonic() - began
    events = 2 * pods  # reserved and bound per pod
    # at most one refresh per debounce window the burst spanned (plus the window it ended in and the last one): on a
    # busy machine the burst may be slow, and one refresh per event would be 40 either way
    windows = int(burst_s / harness.agent.config.metrics_debounce_s) + 2
    assert refreshes <= min(windows, events - 1), f"{refreshes} refreshes for {events} events in {burst_s:.2f}s"


async def test_an_ended_pods_gauges_are_removed_not_left_at_their_last_value(harness: Harness) -> None:
    """Before, every pod ever placed on the node kept its per-pod series: a released pod still reported its
    allocated bytes (a dashboard summing them per node overcounted) and the series grew without bound."""
    pod, alloc = await harness.reserve("short-lived", [("main", [(0, 2)])])
    uid = pod["metadata"]["uid"]
    await harness.reserve("long-lived", [("main", [(1, 1)])])
    proc = harness.root / "proc"
    (proc / "4343").mkdir(parents=True)
    (proc / "4343" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{uid}/cri-x\n")
    harness.backend.set_processes([ProcessUsage(4343, harness.gpu(0), 3000)])  # over its 2 GiB
    await harness.agent.sample_usage()
    reg = harness.agent.metrics.registry
    node = harness.agent.config.node
    gone = {"node": node, "namespace": "default", "pod": "short-lived"}
    kept = {"node": node, "namespace": "default", "pod": "long-lived"}
    per_pod = ("allocated_bytes", "used_bytes", "overuse")
    for suffix in per_pod:
        assert reg.get_sample_value(f"gpushare_node_agent_pod_gpu_memory_{suffix}", gone) is not None, suffix

    await harness.ledger.release(alloc, uid, "gpu-node-1", "deleted")
    view = harness.agent.view
    await eventually(lambda: view.version(alloc) is None, what="the release in the agent's view")
    harness.backend.set_processes([])  # its processes are gone with it
    await harness.agent.sample_usage()
    for suffix in per_pod:
        assert reg.get_sample_value(f"gpushare_node_agent_pod_gpu_memory_{suffix}", gone) is None, suffix
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_allocated_bytes", kept) == 1024**3
    assert reg.get_sample_value("gpushare_node_agent_pod_gpu_memory_overuse", kept) == 0


async def test_sm_utilization_is_attributed_to_pods_like_memory_and_labelled_like_dcgm_exporter(
    harness: Harness,
) -> None:
    """NVML's per-process SM figures follow each PID's cgroup to its pod (summed over the pod's processes), travel
    in the usage samples and make a gauge per pod and container with dcgm-exporter's GPU labels; a GPU whose
    per-process figures are unknown gets none (not a made-up 0), and a pod that ends loses its series."""
    train, _ = await harness.reserve("train", [("main", [(0, 4)])])
    infer, infer_alloc = await harness.reserve("infer", [("main", [(0, 2)])])
    proc = harness.root / "proc"
    pids = {4001: train, 4002: train, 4003: infer}
    for pid, pod in pids.items():
        (proc / str(pid)).mkdir(parents=True)
        (proc / str(pid) / "cgroup").write_text(f"0::/kubepods/besteffort/pod{pod['metadata']['uid']}/cri-x\n")
    g0, g1 = harness.gpu(0), harness.gpu(1)
    harness.backend.set_processes(
        [ProcessUsage(4001, g0, 1000), ProcessUsage(4002, g0, 500), ProcessUsage(4003, g0, 800)],
        utilization={g0: 70.0},
        process_sm={g0: {4001: 30.0, 4002: 25.5}},  # infer's process is on the list but was idle: 0
    )
    event = await sampled(harness)
    by_pod = {s.pod_uid: s for s in event.samples}
    assert by_pod[train["metadata"]["uid"]].sm_utilization_pct == 55.5
    assert by_pod[train["metadata"]["uid"]].used_memory_mib == 1500
    assert by_pod[infer["metadata"]["uid"]].sm_utilization_pct == 0.0
    reg = harness.agent.metrics.registry
    node = harness.agent.config.node
    gpu = {"node": node, "Hostname": node, "gpu": "0", "UUID": g0, "modelName": "Tesla-T4"}
    name = "gpushare_node_agent_pod_sm_utilization_ratio"
    train_labels = {**gpu, "namespace": "default", "pod": "train", "container": "main"}
    infer_labels = {**gpu, "namespace": "default", "pod": "infer", "container": "main"}
    assert reg.get_sample_value(name, train_labels) == 0.555
    assert reg.get_sample_value(name, infer_labels) == 0.0

    # a GPU that cannot say (MIG, an old GPU): its pods' samples carry no SM figure, and no series is made up
    (proc / "4004").mkdir()
    (proc / "4004" / "cgroup").write_text(f"0::/kubepods/besteffort/pod{infer['metadata']['uid']}/cri-x\n")
    harness.backend.set_processes([ProcessUsage(4001, g0, 1000), ProcessUsage(4004, g1, 100)], process_sm={g0: {}})
    event = await sampled(harness)
    by_gpu = {(s.pod_uid, s.gpu_uuid): s for s in event.samples}
    assert by_gpu[(train["metadata"]["uid"], g0)].sm_utilization_pct == 0.0
    assert by_gpu[(infer["metadata"]["uid"], g1)].sm_utilization_pct is None
    (unknown,) = [s for s in json.loads(encode_event(event))["samples"] if s["gpu_uuid"] == g1]
    assert "sm_utilization_pct" not in unknown  # as before the field existed: the previous release reads it
    assert reg.get_sample_value(name, train_labels) == 0.0
    assert reg.get_sample_value(name, {**gpu, "gpu": "1", "UUID": g1, "namespace": "default", "pod": "infer"}) is None
    assert reg.get_sample_value(name, infer_labels) is None  # no sample of infer on g0 any more: its series went

    await harness.ledger.release(infer_alloc, infer["metadata"]["uid"], "gpu-node-1", "deleted")
    await eventually(lambda: harness.agent.view.version(infer_alloc) is None, what="the release in the view")
    harness.backend.set_processes([ProcessUsage(4001, g0, 1000)], process_sm={g0: {4001: 10.0}})
    await harness.agent.sample_usage()
    assert reg.get_sample_value(name, train_labels) == 0.1
    (family,) = [f for f in reg.collect() if f.name == name]
    assert [s.labels["pod"] for s in family.samples] == ["train"]  # the ended pod's series is gone
