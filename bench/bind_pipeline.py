"""3. Bind pipeline vs the apiserver's raw Binding rate, same run.

Pods are created for a scheduler nobody runs, so only the benchmark binds them. Raw: POST each pod's
Binding straight to the apiserver. Pipeline: POST kube-scheduler's bind call to the extender (after an
untimed filter call for the pod, as kube-scheduler makes before every bind), which
reserves in the ledger, publishes through JetStream to the binder, which creates the Binding and reports
back; the call returns when the outcome is known. Both with `concurrency` calls in flight; sustained
pods/s and p50 / p99 per call. An idle window before both phases measures the system's background CPU, and
`*_background_cpu_ms_per_pod_*` say how much of each phase's CPU per pod that is (it grows with the phase).
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from kubernetes_asyncio import client

from bench.common import BenchResult, Context, Target, gather_limited, latency_summary
from bench.cpu import CpuWindow, background_ms_per_item, product_ms_per_pod
from bench.http_client import LeanClient
from bench.kube_stack import create_namespace, create_pods, pause_kubelets, pod_body, whole_stack
from bench.pyspy import phase_profiles

NAME = "bind"
TITLE = "3. Bind pipeline (extender -> ledger -> JetStream -> binder -> Binding) vs raw Binding"
NOBODY = "bench-nobody"


async def _timed(coro: Any, lat: list[float]) -> Any:
    t0 = time.perf_counter()
    out = await coro
    lat.append(time.perf_counter() - t0)
    return out


async def raw_bindings(api: Any, ns: str, pods: list[Any], nodes: list[str], concurrency: int) -> tuple[float, list]:
    """POST Bindings directly; (pods/s, latencies)."""
    core = client.CoreV1Api(api)
    lat: list[float] = []

    def binding(i: int, p: Any) -> Any:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": p.metadata.name, "uid": p.metadata.uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": nodes[i % len(nodes)]},
        }
        return core.create_namespaced_binding(ns, body, _preload_content=False)

    t0 = time.perf_counter()
    await gather_limited(concurrency, [_timed(binding(i, p), lat) for i, p in enumerate(pods)])
    return len(pods) / (time.perf_counter() - t0), lat


async def pipeline_bindings(api: Any, url: str, ns: str, pods: list[Any], nodes: list[str], concurrency: int) -> tuple:
    """Call the extender's bind verb; (pods/s, latencies, errors)."""
    lat: list[float] = []
    errors: list[str] = []
    async with LeanClient(url, connections=concurrency) as http:
        # kube-scheduler always filters before it binds; the extender learns the pod from that call
        for i, p in enumerate(pods):
            pod = api.sanitize_for_serialization(p)
            status, answer = await http.post_json("/filter", {"Pod": pod, "NodeNames": [nodes[i % len(nodes)]]})
            if status != 200:
                raise RuntimeError(f"filter answered {status}: {str(answer)[:300]}")

        async def bind(i: int, p: Any) -> None:
            body = {
                "PodName": p.metadata.name,
                "PodNamespace": ns,
                "PodUID": p.metadata.uid,
                "Node": nodes[i % len(nodes)],
            }
            status, answer = await http.post_json("/bind", body)
            err = answer.get("Error") if status == 200 and isinstance(answer, dict) else f"HTTP {status}: {answer}"
            if err:
                errors.append(str(err)[:200])

        t0 = time.perf_counter()
        await gather_limited(concurrency, [_timed(bind(i, p), lat) for i, p in enumerate(pods)])
        return len(pods) / (time.perf_counter() - t0), lat, errors


async def run(ctx: Context) -> BenchResult:
    """Raw phase, then pipeline phase, on one stack."""
    pods = ctx.pick(20, 200, 1000)
    nodes = ctx.pick(1, 4, 10)
    concurrency = 16
    result = BenchResult(NAME, TITLE, ctx.profile, params={"pods": pods, "nodes": nodes, "concurrency": concurrency})
    result.targets += [
        Target("ratio_pipeline_vs_raw", ">=", 0.3),
        Target("pipeline_p99_ms", "<=", 100.0),
        Target("pipeline_product_cpu_ms_per_pod", "<=", 6.0),
    ]
    async with whole_stack(ctx, nodes) as stack:
        api = await stack.api_client()
        await pause_kubelets(stack)
        node_names = list(stack.node_names)
        raw_ns, gpu_ns = f"bench-raw-{uuid.uuid4().hex[:5]}", f"bench-bind-{uuid.uuid4().hex[:5]}"
        for ns in (raw_ns, gpu_ns):
            await create_namespace(api, ns)
        raw_pods = await create_pods(api, raw_ns, [pod_body(f"r-{i}", scheduler=NOBODY) for i in range(pods)], 20)
        gpu_pods = await create_pods(
            api, gpu_ns, [pod_body(f"g-{i}", gpu_gib=1, scheduler=NOBODY) for i in range(pods)], 20
        )
        # the system's background CPU, to tell the phases' per-pod figures apart from it (see docs/benchmarks.md)
        with CpuWindow(ctx.server_ports()) as idle_cpu:
            await asyncio.sleep(ctx.pick(0.5, 3.0, 5.0))
        with CpuWindow(ctx.server_ports()) as raw_cpu:
            raw_rate, raw_lat = await raw_bindings(api, raw_ns, raw_pods, node_names, concurrency)
        with CpuWindow(ctx.server_ports()) as pipeline_cpu, phase_profiles("bind-pipeline"):
            rate, lat, errors = await pipeline_bindings(
                api, stack.extender_url, gpu_ns, gpu_pods, node_names, concurrency
            )
    m = result.metrics
    m.update(raw_cpu.per_item_ms(pods, "raw"))
    m.update(pipeline_cpu.per_item_ms(pods, "pipeline"))
    m["pipeline_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "pipeline")  # gpushare's own share of the total
    for prefix, phase in (("raw", raw_cpu), ("pipeline", pipeline_cpu)):
        m.update(background_ms_per_item(idle_cpu.spent(), idle_cpu.seconds, phase.seconds, pods, prefix))
    m["raw_bindings_per_s"] = round(raw_rate, 2)
    m["pipeline_pods_per_s"] = round(rate, 2)
    m["ratio_pipeline_vs_raw"] = round(rate / raw_rate, 3)
    m.update(latency_summary("raw", raw_lat))
    m.update(latency_summary("pipeline", lat))
    m["pipeline_errors"] = len(errors)
    if errors:
        result.status = "error"
        result.notes.append(f"{len(errors)} bind calls failed, e.g. {errors[0]}")
    return result
