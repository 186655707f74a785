"""The demo on real nodes: containers that print the environment they received, shown beside the ledger's record.

On real nodes the demo's pods run for real (busybox, made here: no registry is reachable, so `imagePullPolicy:
Never`). Each container prints the GPU environment the node agent handed it through kubelet
(NVIDIA_VISIBLE_DEVICES, ALIYUN_COM_GPU_MEM_*, GPUSHARE_*, and with DRA the CDI spec's) and sleeps; `gpushare up`
reads that output the way `kubectl logs` does (through kube-apiserver, which asks the node's kubelet) and prints it
beside what accounting says the ledger holds for the pod.
"""

from __future__ import annotations

import asyncio
import copy
import time
from collections.abc import Mapping
from typing import Any

GPU_ENV_PREFIXES = ("NVIDIA_", "ALIYUN_COM_GPU_", "GPUSHARE_", "CUDA_", "XLA_")
DEMO_SELECTOR = "gpushare.io/demo=true"
DRA_DEMO_NAMESPACE = "gpushare-demo-dra"  # opted in to DRA: its unchanged pods go to the DRA node
DRA_DEMO_REPLICAS = 2
BANNER = "gpushare demo: the GPU environment this container received"
PRINT_ENV = (
    f"echo '{BANNER}:'; env | grep -E '^({'|'.join(GPU_ENV_PREFIXES)})' | sort; "
    "echo '(busybox: no GPU here; a real workload would start now)'; exec sleep 2147483647"
)


def printing_environment(deployments: list[dict[str, Any]], image: str) -> list[dict[str, Any]]:
    """The demo Deployments with every container running `image` (a local one, never pulled) and printing its GPU
    environment instead of the workload's own image and command; names and resources unchanged (pure)."""
    out = copy.deepcopy(deployments)
    for dep in out:
        spec = dep["spec"]["template"]["spec"]
        spec["terminationGracePeriodSeconds"] = 1
        for container in spec.get("initContainers", []) + spec["containers"]:
            container.update(image=image, imagePullPolicy="Never", command=["sh", "-c", PRINT_ENV])
            container.pop("args", None)
    return out


def dra_demo_deployment(deployments: list[dict[str, Any]], image: str) -> dict[str, Any]:
    """The DRA node's share of the demo on a mixed cluster: the inference Deployment, unchanged but for its replicas
    and the printing container (gpushare admission turns its `aliyun.com/gpu-mem` into a ResourceClaim) (pure)."""
    dep = next(d for d in printing_environment(deployments, image) if d["metadata"]["name"] == "resnet-inference")
    dep["spec"]["replicas"] = DRA_DEMO_REPLICAS
    return dep


async def submit_dra_demo(api: Any, deployments: list[dict[str, Any]], image: str) -> int:
    """Create (or replace) the DRA part of the demo in its opted-in namespace; returns its pod count."""
    from kubernetes_asyncio import client

    from devstack.stack.demo import apply_deployment
    from devstack.stack.webhook import opt_in

    await opt_in(api, DRA_DEMO_NAMESPACE)
    await apply_deployment(client.AppsV1Api(api), DRA_DEMO_NAMESPACE, dra_demo_deployment(deployments, image))
    return DRA_DEMO_REPLICAS


def pod_label(namespace: str, name: str, main_namespace: str) -> str:
    """A demo pod's name as shown: with its namespace when it is not the demo's own (pure)."""
    return name if namespace == main_namespace else f"{namespace}/{name}"


def gpu_environment(log: str) -> dict[str, str]:
    """The GPU variables a demo container printed (pure)."""
    env = {}
    for line in log.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.startswith(GPU_ENV_PREFIXES):
            env[key] = value
    return env


def ledger_record(view: Mapping[str, Any] | None) -> str:
    """What accounting's ledger holds for a pod, in one phrase (pure)."""
    allocation = (view or {}).get("allocation")
    if not allocation:
        return "no allocation in the ledger"
    parts = ", ".join(
        f"{p['container']}: GPU {p['gpu_index']} {p['memory_mib']} MiB ({p['gpu_uuid']})" for p in allocation["parts"]
    )
    return f"{allocation['state']} on {allocation['node']}: {parts}"


def container_lines(pods: list[dict[str, Any]]) -> list[str]:
    """One block per pod: its node, the ledger's record, then each container's environment (pure). Each item:
    {"pod", "node", "ledger", "containers": {name: env or an error string}}."""
    lines = []
    for item in pods:
        lines.append(f"  {item['pod']} on {item['node'] or 'no node'}")
        lines.append(f"    ledger:    {item['ledger']}")
        for name, env in item["containers"].items():
            if isinstance(env, str):
                lines.append(f"    {name}: {env}")
                continue
            shown = " ".join(f"{k}={v}" for k, v in sorted(env.items())) or "(no GPU variables)"
            lines.append(f"    {name} got: {shown}")
    return lines


def not_started(container: str, status: Any, warnings: list[tuple[str, str]]) -> str:
    """What to show for a container that has not started (pure): its waiting reason and the pod's newest warning
    event (`warnings` newest last, as (reason, message)), instead of the log API's refusal."""
    waiting = status.state.waiting if status is not None and status.state is not None else None
    why = (waiting.reason if waiting is not None else "") or "no container yet"
    if warnings:
        reason, message = warnings[-1]
        why += f"; {reason}: {message}"
    return f"(not started yet: {why})"


async def running_pods(api: Any, want: int, timeout_s: float) -> list[Any]:
    """The live demo pods (any namespace), once `want` of them run (or what there is at `timeout_s`)."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout_s
    while True:
        pods = [p for p in (await core.list_pod_for_all_namespaces(label_selector=DEMO_SELECTOR)).items
                if p.metadata.deletion_timestamp is None]  # fmt: skip
        if sum(1 for p in pods if p.status.phase == "Running") >= want or time.monotonic() > deadline:
            return sorted(pods, key=lambda p: (p.metadata.namespace, p.metadata.name))
        await asyncio.sleep(0.5)


async def collect(api: Any, accounting_url: str, pods: list[Any], main_namespace: str) -> list[dict[str, Any]]:
    """Each pod's ledger record (accounting) and its containers' printed GPU environment (their logs, through
    kube-apiserver and the node's kubelet, as `kubectl logs` reads them)."""
    import httpx
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    out = []
    async with httpx.AsyncClient(base_url=accounting_url, timeout=10) as http:
        for pod in pods:
            ns, name = pod.metadata.namespace, pod.metadata.name
            resp = await http.get(f"/v1/pods/{ns}/{name}")
            view = resp.json() if resp.status_code == 200 else None
            containers: dict[str, dict[str, str] | str] = {}
            statuses = {st.name: st for st in pod.status.container_statuses or []}
            for c in pod.spec.containers:
                started = statuses.get(c.name)
                if started is None or started.state is None or started.state.waiting is not None:
                    containers[c.name] = not_started(c.name, started, await _warnings(core, ns, name))
                    continue
                try:
                    log = await _printed(core, ns, name, c.name)
                    containers[c.name] = gpu_environment(log)
                except ApiException as exc:
                    containers[c.name] = f"(no output: {exc.status} {exc.reason})"
            record = ledger_record(view)
            shown = pod_label(ns, name, main_namespace)
            out.append({"pod": shown, "node": pod.spec.node_name, "ledger": record, "containers": containers})
    return out


async def _warnings(core: Any, namespace: str, pod: str) -> list[tuple[str, str]]:
    """The pod's warning events as (reason, message), oldest first."""
    found = await core.list_namespaced_event(namespace, field_selector=f"involvedObject.name={pod},type=Warning")
    items = sorted(found.items, key=lambda e: str(e.last_timestamp or e.event_time or e.metadata.creation_timestamp))
    return [(e.reason or "", e.message or "") for e in items]


async def _printed(core: Any, namespace: str, pod: str, container: str, timeout_s: float = 10.0) -> str:
    """A container's output once its banner's list is complete (it prints, then sleeps)."""
    deadline = time.monotonic() + timeout_s
    while True:
        log = str(await core.read_namespaced_pod_log(pod, namespace, container=container))
        if "(busybox: no GPU here" in log or time.monotonic() > deadline:
            return log
        await asyncio.sleep(0.3)
