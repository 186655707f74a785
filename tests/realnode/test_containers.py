"""Real containers get exactly what the ledger holds: a device-plugin node and a DRA node, each a real kubelet v1.37.2
with its own containerd and runc, the node agents registered with them on fake GPUs (two of 16 GiB per node).

What each container received is read from its own output (it prints its environment), through kube-apiserver and the
node's kubelet as `kubectl logs` reads it, and compared with the ledger's record and the pod's annotations.
"""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client

from shared.annotations import GPU_MEM_IDX
from tests.e2e import helpers as h
from tests.realnode import helpers as r

pytestmark = pytest.mark.e2e

STACK_NODES = 2
STACK_DRA_NODES = 1
STACK_GPUS = "2x16GiB:Tesla-T4"
STACK_NODES_KIND = "real"


def image(stack: Any) -> str:
    return next(iter(stack.real_nodes.values())).workload_image


def assert_received(env: dict[str, str], parts: list[dict[str, Any]], gib: int) -> None:
    """A container's environment names exactly the GPUs (and memory) of its ledger parts."""
    parts = sorted(parts, key=lambda p: p["gpu_index"])
    assert env["NVIDIA_VISIBLE_DEVICES"] == ",".join(p["gpu_uuid"] for p in parts), (env, parts)
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == ",".join(str(p["gpu_index"]) for p in parts), (env, parts)
    assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(gib), env
    assert env["GPUSHARE_GPU_MEMORY_MIB"] == ",".join(str(p["memory_mib"]) for p in parts), (env, parts)


async def ledger_parts(stack: Any, namespace: str, pod: str) -> dict[str, list[dict[str, Any]]]:
    """The pod's live ledger parts by container, once the ledger holds it assigned."""

    async def assigned() -> dict[str, Any] | None:
        now = (await h.ledger_allocations(stack.database_url, namespace)).get(pod)
        return now if now and now["state"] == "assigned" else None

    alloc = await h.poll(assigned, 60, what=f"{namespace}/{pod} assigned in the ledger")
    out: dict[str, list[dict[str, Any]]] = {}
    for part in alloc["parts"]:
        out.setdefault(part["container"], []).append(part)
    return out


async def annotation_idx(api: Any, namespace: str, pod: str) -> str:
    p = await client.CoreV1Api(api).read_namespaced_pod(pod, namespace)
    return p.metadata.annotations[GPU_MEM_IDX]


async def test_one_container_receives_the_gpu_of_its_ledger_share(stack, api, namespace) -> None:
    await h.create_pod(api, namespace, r.pod("one", [r.container("main", image(stack), mem=4)]))
    running = await r.wait_running(api, namespace, "one")
    assert running.spec.node_name == stack.node_names[0]  # the device-plugin node
    assert running.status.pod_ip == "127.0.0.1"  # the project's CNI plugin: loopback only
    env = await r.printed_env(api, namespace, "one", "main")
    parts = await ledger_parts(stack, namespace, "one")
    assert_received(env, parts["main"], 4)
    assert env["ALIYUN_COM_GPU_MEM_POD"] == "4"
    assert await annotation_idx(api, namespace, "one") == env["ALIYUN_COM_GPU_MEM_IDX"]


async def test_two_containers_split_over_two_gpus(stack, api, namespace) -> None:
    containers = [r.container("a", image(stack), mem=12), r.container("b", image(stack), mem=12)]
    await h.create_pod(api, namespace, r.pod("split", containers))
    await r.wait_running(api, namespace, "split")
    parts = await ledger_parts(stack, namespace, "split")
    envs = {c: await r.printed_env(api, namespace, "split", c) for c in ("a", "b")}
    for c in ("a", "b"):
        assert_received(envs[c], parts[c], 12)
        assert envs[c]["ALIYUN_COM_GPU_MEM_POD"] == "24"
    assert envs["a"]["NVIDIA_VISIBLE_DEVICES"] != envs["b"]["NVIDIA_VISIBLE_DEVICES"]  # 24 GiB: one GPU each
    assert sorted((await annotation_idx(api, namespace, "split")).split(",")) == ["0", "1"]


async def test_gpu_count_two_gives_one_container_two_gpus(stack, api, namespace) -> None:
    await h.create_pod(api, namespace, r.pod("ddp", [r.container("main", image(stack), mem=8, count=2)]))
    await r.wait_running(api, namespace, "ddp")
    env = await r.printed_env(api, namespace, "ddp", "main")
    parts = await ledger_parts(stack, namespace, "ddp")
    assert len({p["gpu_uuid"] for p in parts["main"]}) == 2 and all(p["memory_mib"] == 4096 for p in parts["main"])
    assert_received(env, parts["main"], 8)


async def test_a_gpu_init_container_then_the_app_container(stack, api, namespace) -> None:
    img = image(stack)
    init = [r.container("setup", img, mem=8, then="exit 0")]
    await h.create_pod(api, namespace, r.pod("warm", [r.container("main", img, mem=4)], init=init))
    running = await r.wait_running(api, namespace, "warm")
    (setup,) = running.status.init_container_statuses
    assert setup.state.terminated is not None and setup.state.terminated.exit_code == 0
    parts = await ledger_parts(stack, namespace, "warm")
    envs = {c: await r.printed_env(api, namespace, "warm", c) for c in ("setup", "main")}
    assert_received(envs["setup"], parts["setup"], 8)
    assert_received(envs["main"], parts["main"], 4)
    # kubelet hands the init container's devices on to the app container: both on one GPU
    assert envs["setup"]["NVIDIA_VISIBLE_DEVICES"] == envs["main"]["NVIDIA_VISIBLE_DEVICES"]


async def test_a_sidecar_holds_its_own_share_beside_the_app_container(stack, api, namespace) -> None:
    img = image(stack)
    sidecar = [r.container("proxy", img, mem=4, restartPolicy="Always")]
    await h.create_pod(api, namespace, r.pod("side", [r.container("main", img, mem=8)], init=sidecar))
    await r.wait_running(api, namespace, "side")
    parts = await ledger_parts(stack, namespace, "side")
    assert parts["proxy"][0]["sidecar"] and not parts["main"][0]["sidecar"]
    envs = {c: await r.printed_env(api, namespace, "side", c) for c in ("proxy", "main")}
    assert_received(envs["proxy"], parts["proxy"], 4)
    assert_received(envs["main"], parts["main"], 8)
    for c in ("proxy", "main"):
        assert envs[c]["ALIYUN_COM_GPU_MEM_POD"] == "12", envs[c]  # the sidecar counts for the pod's whole life
    gpus = await h.gpu_rows(stack.database_url, stack.node_names[0])
    assert sum(g["allocated_memory_mib"] for g in gpus) == 12 * 1024


async def test_a_crashing_container_is_prestarted_again_on_the_same_gpu(stack, api, namespace) -> None:
    crash_once = "if [ -f /scratch/ran ]; then exec sleep 3600; fi; touch /scratch/ran; exit 3"
    main = r.container("main", image(stack), mem=4, then=crash_once)
    main["volumeMounts"] = [{"name": "scratch", "mountPath": "/scratch"}]
    body = r.pod("crashy", [main], volumes=[{"name": "scratch", "emptyDir": {}}])
    calls_before = await prestart_calls(stack)
    await h.create_pod(api, namespace, body)
    restarted = await r.wait_pod(
        api,
        namespace,
        "crashy",
        lambda p: any(c.restart_count >= 1 and c.ready for c in p.status.container_statuses or []),
        "restarted once and running",
        timeout_s=90,
    )
    (status,) = restarted.status.container_statuses
    assert status.last_state.terminated.exit_code == 3
    first = await r.printed_env(api, namespace, "crashy", "main", previous=True)
    second = await r.printed_env(api, namespace, "crashy", "main")
    parts = await ledger_parts(stack, namespace, "crashy")
    assert_received(first, parts["main"], 4)
    assert r.gpu_view(second) == r.gpu_view(first)  # the same GPU and share after the restart
    # kubelet asked the node agent to confirm the container before each of its two starts
    assert await prestart_calls(stack) - calls_before >= 2


async def prestart_calls(stack: Any) -> float:
    """PreStartContainer calls of the device-plugin node's agent (its metrics)."""
    proc = stack.processes[f"node-agent-{stack.node_names[0]}"]
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"http://{proc.command.metrics_target}/metrics")).text
    total = 0.0
    for line in text.splitlines():
        if line.startswith("gpushare_node_agent_device_plugin_calls_total{") and 'call="PreStartContainer"' in line:
            if 'resource="aliyun.com/gpu-mem"' in line:
                total += float(line.rsplit(" ", 1)[1])
    return total


async def test_a_deleted_pod_keeps_its_share_until_its_containers_are_gone(stack, api, namespace) -> None:
    slow_stop = "trap 'sleep 4; exit 0' TERM; while :; do sleep 1; done"
    body = r.pod("leaving", [r.container("main", image(stack), mem=6, then=slow_stop)], grace_s=30)
    await h.create_pod(api, namespace, body)
    await r.wait_running(api, namespace, "leaving")
    await r.printed_env(api, namespace, "leaving", "main")  # its shell runs (and has set its trap)
    await ledger_parts(stack, namespace, "leaving")
    await client.CoreV1Api(api).delete_namespaced_pod("leaving", namespace)  # graceful: kubelet stops it
    terminating = await r.wait_pod(
        api, namespace, "leaving", lambda p: p.metadata.deletion_timestamp is not None, "terminating"
    )
    assert terminating.status.container_statuses[0].state.running is not None  # still stopping (its trap sleeps)
    held = await h.ledger_allocations(stack.database_url, namespace)
    assert "leaving" in held, "released while its container still ran"
    gpus = await h.gpu_rows(stack.database_url, stack.node_names[0])
    assert sum(g["allocated_memory_mib"] for g in gpus) == 6 * 1024
    await r.gone(api, namespace, "leaving")  # kubelet saw the container stop and removed the pod
    await h.wait_released(stack.database_url, namespace, "leaving")
    assert await h.ledger_disagreements(stack.database_url) == []


async def test_an_unchanged_pod_of_an_opted_in_namespace_runs_on_the_dra_node_with_its_cdi_environment(
    stack, api, namespace
) -> None:
    from devstack.stack.webhook import opt_in

    dra_node = stack.dra_node_names[0]
    await opt_in(api, namespace)
    await h.create_pod(api, namespace, r.pod("claimed", [r.container("main", image(stack), mem=4)]))
    running = await r.wait_running(api, namespace, "claimed", timeout_s=90)
    assert running.spec.node_name == dra_node
    assert running.spec.resource_claims, "gpushare admission rewrote the pod into a ResourceClaim"
    env = await r.printed_env(api, namespace, "claimed", "main")
    parts = await ledger_parts(stack, namespace, "claimed")
    assert_received(env, parts["main"], 4)  # the CDI spec's environment, applied by containerd
    node = stack.real_nodes[dra_node]
    specs = list(node.cdi_dir.glob("*.json")) + list(node.cdi_dir.glob("*.yaml"))
    assert specs, f"no CDI spec in {node.cdi_dir}"


async def test_a_pod_asking_more_than_any_gpu_has_stays_pending_with_the_reason(stack, api, namespace) -> None:
    await h.create_pod(api, namespace, r.pod("huge", [r.container("main", image(stack), mem=64)]))
    view = await h.wait_pending_reason(stack, namespace, "huge")
    assert "aliyun.com/gpu-mem" in view["pending"]["summary"], view["pending"]
    assert "huge" not in await h.ledger_allocations(stack.database_url, namespace)
    p = await client.CoreV1Api(api).read_namespaced_pod("huge", namespace)
    assert not p.spec.node_name and p.status.phase == "Pending"


async def test_a_missing_image_is_named_and_charges_nothing_once_the_pod_is_gone(stack, api, namespace) -> None:
    absent = "gpushare.local/not-there:1"
    body = r.pod("typo", [{**r.container("main", image(stack), mem=4), "image": absent}])
    await h.create_pod(api, namespace, body)
    waiting = await r.wait_pod(
        api,
        namespace,
        "typo",
        lambda p: any(
            c.state.waiting is not None and c.state.waiting.reason == "ErrImageNeverPull"
            for c in p.status.container_statuses or []
        ),
        "ErrImageNeverPull",
    )
    (status,) = waiting.status.container_statuses
    assert absent in status.state.waiting.message, status.state.waiting.message
    assert any(absent in e for e in await r.events_of(api, namespace, "typo"))
    # the pod holds its share while it waits (it may yet start: the image can be imported), and nothing after
    await h.delete_pod(api, namespace, "typo")
    await h.wait_released(stack.database_url, namespace, "typo")
    assert await h.ledger_disagreements(stack.database_url) == []
