"""Running the demo on a started stack: submit, wait for placement, show the inspect table."""

from __future__ import annotations

import asyncio
import logging
import sys
import time
from typing import Any

from devstack.stack.demo import DEMO_NAMESPACE, demo_deployments, demo_pod_count, submit_demo
from devstack.stack.demo_containers import DEMO_SELECTOR, DRA_DEMO_NAMESPACE, pod_label, submit_dra_demo
from devstack.stack.simulator import SchedulerSimulator, pods_of_deployments
from devstack.stack.stack import MODE_SIMULATOR, Stack

log = logging.getLogger(__name__)


def unit_mib(stack: Stack) -> int:
    """MiB per `aliyun.com/gpu-mem` unit of the stack (GiB: 1024, MiB: 1)."""
    return 1 if stack.config.memory_unit == "MiB" else 1024


async def run_demo(stack: Stack, timeout_s: float = 120.0, *, dev_pods: int = 0) -> list[tuple[str, str]]:
    """Place the demo workload (with `dev_pods` development notebooks of 512 MiB); returns `(pod, node)` pairs
    (node "" when still pending)."""
    if stack.mode == MODE_SIMULATOR:
        return await _simulated_demo(stack, dev_pods)
    from kubernetes_asyncio import client

    api = await stack.api_client()
    dra = bool(stack.dra_node_names) and len(stack.dra_node_names) == len(stack.node_names)
    image = next(iter(stack.real_nodes.values())).workload_image if stack.real_nodes else None
    deployments = await submit_demo(api, unit_mib=unit_mib(stack), dev_pods=dev_pods, dra=dra, image=image)
    want = demo_pod_count(deployments)
    stack.progress(f"submitted the demo: {', '.join(d['metadata']['name'] for d in deployments)} ({want} pods)")
    if image is not None and stack.dra_node_names and not dra:  # real nodes, a mixed cluster: the DRA node's part
        want += await submit_dra_demo(api, deployments, image)
        stack.progress(f"submitted resnet-inference in {DRA_DEMO_NAMESPACE}, opted in to DRA (the DRA node's share)")
    core = client.CoreV1Api(api)
    deadline = time.monotonic() + timeout_s
    pairs: list[tuple[str, str]] = []
    while True:
        pods = (await core.list_pod_for_all_namespaces(label_selector=DEMO_SELECTOR)).items
        live = [p for p in pods if p.metadata.deletion_timestamp is None]
        shown = [(pod_label(p.metadata.namespace, p.metadata.name, DEMO_NAMESPACE), p.spec.node_name) for p in live]
        pairs = sorted((name, node or "") for name, node in shown)
        bound = sum(1 for _, n in pairs if n)
        if bound >= want:
            stack.progress(f"all {want} demo pods placed")
            return pairs
        if time.monotonic() > deadline:
            stack.progress(f"only {bound}/{want} demo pods placed after {timeout_s:.0f}s (see the logs)")
            return pairs
        await asyncio.sleep(0.5)


async def demo_container_lines(stack: Stack, pods: int, timeout_s: float = 60.0) -> list[str]:
    """On real nodes: each demo pod's ledger record beside the GPU environment its containers printed."""
    from devstack.stack.demo_containers import collect, container_lines, running_pods

    api = await stack.api_client()
    running = await running_pods(api, pods, timeout_s)
    return container_lines(await collect(api, stack.accounting_url, running, DEMO_NAMESPACE))


async def _simulated_demo(stack: Stack, dev_pods: int) -> list[tuple[str, str]]:
    from shared.events.bus import BusNames, EventBus
    from shared.ledger.db import make_engine
    from shared.ledger.ledger import Ledger
    from shared.ledger.outbox import OutboxRelay

    c = stack.config
    bus = await EventBus.connect(stack.nats_url, BusNames(c.stream_name, c.subject_prefix), name="gpushare-simulator")
    engine = make_engine(stack.database_url, pool_size=2)
    relay = OutboxRelay(engine, bus)
    stop = asyncio.Event()
    relay_task = asyncio.create_task(relay.run(stop))
    ledger = Ledger(engine, prefix=c.subject_prefix, source="simulator", on_commit=relay.kick)
    sim = SchedulerSimulator(stack.extender_url, stack.node_names, ledger=ledger)
    try:
        pods = pods_of_deployments(demo_deployments(unit_mib=unit_mib(stack), dev_pods=dev_pods), DEMO_NAMESPACE)
        stack.progress(f"scheduling {len(pods)} demo pods through the extender (simulated kube-scheduler)")
        placements = await sim.run(pods)
        await asyncio.wait_for(relay.flush(), 10)
    finally:
        await sim.close()
        stop.set()
        relay_task.cancel()
        await asyncio.gather(relay_task, return_exceptions=True)
        await bus.close()
        await engine.dispose()
    return sorted((p.name, p.node or "") for p in placements)


async def rightsizing(accounting_url: str, namespace: str = DEMO_NAMESPACE) -> list[dict[str, Any]]:
    """Accounting's right-sizing suggestions for a namespace ([] while accounting cannot answer)."""
    import httpx

    try:
        async with httpx.AsyncClient(base_url=accounting_url, timeout=10) as http:
            resp = await http.get("/v1/rightsizing", params={"namespace": namespace})
    except httpx.HTTPError:
        return []
    return list(resp.json().get("items", [])) if resp.status_code == 200 else []


async def wait_for_usage(stack: Stack, pods: int, timeout_s: float = 60.0) -> list[dict[str, Any]]:
    """Right-sizing suggestions once `pods` demo pods have usage samples (or whatever there is at `timeout_s`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        items = await rightsizing(stack.accounting_url)
        if sum(i["pods_sampled"] for i in items) >= pods or time.monotonic() > deadline:
            return items
        await asyncio.sleep(1.0)


def rightsizing_lines(items: list[dict[str, Any]]) -> list[str]:
    """The suggestions, and what repacking every workload at its recommended size would free (pure)."""
    if not items:
        return ["  (no usage samples yet: see the dashboard in a minute)"]
    width = max(len(i["owner_name"]) for i in items)
    lines = [f"  {i['owner_name'].ljust(width)}  {i['pods_sampled']} pod(s): {i['summary']}" for i in items]
    allocated = sum(i["allocated_mib"] * i["pods_sampled"] for i in items)
    recommended = sum(i["recommended_mib"] * i["pods_sampled"] for i in items)
    if allocated and recommended:
        freed = allocated - recommended
        verb = "frees" if freed >= 0 else "needs"
        lines.append(
            f"  repacked at the recommended sizes these pods need {recommended / 1024:g} GiB instead of "
            f"{allocated / 1024:g} GiB: {verb} {abs(freed) / 1024:g} GiB, "
            f"{allocated / recommended - 1:+.0%} pods per GPU"
        )
    return lines


async def run_inspect(accounting_url: str, *args: str) -> tuple[int, str, str]:
    """Run `gpushare inspect ARGS` against an accounting service: (exit status, stdout, stderr)."""
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "services.cli",
        "inspect",
        *args,
        "--accounting-url",
        accounting_url,
        "--log-format",
        "text",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await proc.communicate()
    return proc.returncode or 0, out.decode(errors="replace"), err.decode(errors="replace")


async def inspect_output(stack: Stack, *extra: str) -> str:
    """`gpushare inspect` against the stack's accounting (its stdout, or why it failed)."""
    status, out, err = await run_inspect(stack.accounting_url, *extra)
    if status != 0:
        return f"(gpushare inspect failed with {status}: {err.strip()[-500:]})"
    return out


def placement_lines(pairs: list[tuple[str, str]]) -> list[str]:
    """`pod -> node` lines."""
    width = max((len(p) for p, _ in pairs), default=0)
    return [f"  {p.ljust(width)}  -> {n or 'Pending'}" for p, n in pairs]


def describe(stack: Stack) -> dict[str, Any]:
    """Machine-readable summary of where everything is."""
    return {
        "mode": stack.mode,
        "kubeconfig": stack.kubeconfig,
        "dashboard": f"{stack.accounting_url}/ui",
        "listens": dict(stack.listens()),
    }
