"""3. Bind pipeline vs the apiserver's raw Binding rate, same run.

Pods are created for a scheduler nobody runs, so only the benchmark binds them. Raw: POST each pod's
Binding straight to the apiserver. Pipeline: POST kube-scheduler's bind call to the extender (after a filter
call for the pod, as kube-scheduler makes before every bind; made before the phase, outside its clock and its
CPU window), which reserves in the ledger, publishes through JetStream to the binder, which creates the
Binding and reports back; the call returns when the outcome is known. Both with `concurrency` calls in
flight; sustained pods/s and p50 / p99 per call. Each phase starts warm: `warmup` pods of its own are bound
the same way first, untimed, so the connections a steady state keeps open (the binder's to the API server,
the benchmark's to the extender) are open, as in a running cluster. An idle window before both phases
measures the system's background CPU, and `*_background_cpu_ms_per_pod_*` say how much of each phase's CPU
per pod that is. A third phase, `paced_raw_*`, binds raw again, started at the pipeline's measured rate: it
tells how much of the control plane's CPU per pod in the pipeline phase comes with the slower pace alone.
`*_api_requests_per_pod` and `*_watch_events_per_pod` are kube-apiserver's own counts,
`*_db_transactions_per_pod` and `*_db_rows_written_per_pod` PostgreSQL's for the ledger's database.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections import Counter
from typing import Any

from kubernetes_asyncio import client

from bench import api_requests, db_counts
from bench.common import BenchResult, Context, Target, gather_limited, latency_summary
from bench.cpu import CENTRAL_GROUPS, CpuWindow, background_ms_per_item, product_ms_per_pod
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


async def raw_bindings(
    api: Any, ns: str, pods: list[Any], nodes: list[str], concurrency: int, *, paced_per_s: float | None = None
) -> tuple[float, list]:
    """POST Bindings directly; (pods/s, latencies). `paced_per_s`: start them at that rate, no faster."""
    core = client.CoreV1Api(api)
    lat: list[float] = []
    start = time.perf_counter()

    async def at(i: int, coro: Any) -> Any:
        if paced_per_s:
            await asyncio.sleep(max(0.0, start + i / paced_per_s - time.perf_counter()))
        return await coro

    def binding(i: int, p: Any) -> Any:
        body = {
            "apiVersion": "v1",
            "kind": "Binding",
            "metadata": {"name": p.metadata.name, "uid": p.metadata.uid},
            "target": {"apiVersion": "v1", "kind": "Node", "name": nodes[i % len(nodes)]},
        }
        return core.create_namespaced_binding(ns, body, _preload_content=False)

    await gather_limited(concurrency, [at(i, _timed(binding(i, p), lat)) for i, p in enumerate(pods)])
    return len(pods) / (time.perf_counter() - start), lat


async def announce(api: Any, http: LeanClient, pods: list[Any], nodes: list[str]) -> None:
    """kube-scheduler's filter call for each pod, as it makes before every bind (not part of the bind pipeline)."""
    for i, p in enumerate(pods):
        pod = api.sanitize_for_serialization(p)
        status, answer = await http.post_json("/filter", {"Pod": pod, "NodeNames": [nodes[i % len(nodes)]]})
        if status != 200:
            raise RuntimeError(f"filter answered {status}: {str(answer)[:300]}")


async def pipeline_bindings(http: LeanClient, ns: str, pods: list[Any], nodes: list[str], concurrency: int) -> tuple:
    """Call the extender's bind verb; (pods/s, latencies, errors)."""
    lat: list[float] = []
    errors: list[str] = []

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


async def server_counts(api: Any, database_url: str) -> tuple[Counter[str], dict[str, int]]:
    """kube-apiserver's counters, then PostgreSQL's for the ledger's database. The database's reading starts
    with `db_counts`' pause, which also lets the API server's garbage collection after rendering its
    multi-megabyte `/metrics` page end before the next phase (it landed in the raw window in some runs: raw
    Bindings then cost the API server 2.2 ms instead of 1.0)."""
    return await api_requests.read_counts(api), await db_counts.read_counts(database_url)


async def run(ctx: Context) -> BenchResult:
    """Raw phase, then pipeline phase, on one stack."""
    # longer phases than the 200 pods of before (200 raw Bindings took 0.3 s, too short to hold one of the API
    # server's garbage collections); every GPU pod takes 1 GiB of the nodes' 8 x 16 GiB
    pods = ctx.pick(20, 500, 1000)
    nodes = ctx.pick(1, 5, 10)
    concurrency = 16
    warmup = ctx.pick(4, 2 * concurrency, 2 * concurrency)
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={"pods": pods, "nodes": nodes, "concurrency": concurrency, "warmup_pods": warmup},
    )
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
        paced_ns = f"bench-paced-{uuid.uuid4().hex[:5]}"
        for ns in (raw_ns, gpu_ns, paced_ns):
            await create_namespace(api, ns)
        total = warmup + pods
        raw_pods = await create_pods(api, raw_ns, [pod_body(f"r-{i}", scheduler=NOBODY) for i in range(total)], 20)
        paced_pods = await create_pods(api, paced_ns, [pod_body(f"s-{i}", scheduler=NOBODY) for i in range(pods)], 20)
        gpu_pods = await create_pods(
            api, gpu_ns, [pod_body(f"g-{i}", gpu_gib=1, scheduler=NOBODY) for i in range(total)], 20
        )
        async with LeanClient(stack.extender_url, connections=concurrency) as http:
            await announce(api, http, gpu_pods, node_names)
            # the system's background CPU, to tell the phases' per-pod figures apart from it (docs/benchmarks.md)
            with CpuWindow(ctx.server_ports()) as idle_cpu:
                await asyncio.sleep(ctx.pick(0.5, 3.0, 5.0))
            await raw_bindings(api, raw_ns, raw_pods[:warmup], node_names, concurrency)
            raw_before, raw_db_before = await server_counts(api, stack.database_url)
            with CpuWindow(ctx.server_ports()) as raw_cpu:
                raw_rate, raw_lat = await raw_bindings(api, raw_ns, raw_pods[warmup:], node_names, concurrency)
            raw_after, raw_db_after = await server_counts(api, stack.database_url)
            _, _, warm_errors = await pipeline_bindings(http, gpu_ns, gpu_pods[:warmup], node_names, concurrency)
            pipeline_before, pipeline_db_before = await server_counts(api, stack.database_url)
            with CpuWindow(ctx.server_ports()) as pipeline_cpu, phase_profiles("bind-pipeline"):
                rate, lat, errors = await pipeline_bindings(http, gpu_ns, gpu_pods[warmup:], node_names, concurrency)
            pipeline_after, pipeline_db_after = await server_counts(api, stack.database_url)
            # raw Bindings again, started at the pipeline's rate: what the API server's CPU per pod is at that rate
            with CpuWindow(ctx.server_ports()) as paced_cpu:
                await raw_bindings(api, paced_ns, paced_pods, node_names, concurrency, paced_per_s=rate)
    m = result.metrics
    m.update(raw_cpu.per_item_ms(pods, "raw"))
    m.update(pipeline_cpu.per_item_ms(pods, "pipeline"))
    m.update(paced_cpu.per_item_ms(pods, "paced_raw"))
    m["pipeline_product_cpu_ms_per_pod"] = product_ms_per_pod(m, "pipeline")  # gpushare's own share of the total
    m["pipeline_product_cpu_ms_per_pod_without_node_agents"] = product_ms_per_pod(m, "pipeline", CENTRAL_GROUPS)
    for prefix, phase in (("raw", raw_cpu), ("pipeline", pipeline_cpu)):
        m.update(background_ms_per_item(idle_cpu.spent(), idle_cpu.seconds, phase.seconds, pods, prefix))
    m.update(api_requests.per_pod(raw_before, raw_after, pods, "raw"))
    m.update(api_requests.per_pod(pipeline_before, pipeline_after, pods, "pipeline"))
    m.update(db_counts.per_pod(raw_db_before, raw_db_after, pods, "raw"))
    m.update(db_counts.per_pod(pipeline_db_before, pipeline_db_after, pods, "pipeline"))
    result.notes.append("raw phase, kube-apiserver per pod: " + api_requests.breakdown(raw_before, raw_after, pods))
    result.notes.append(
        "pipeline phase, kube-apiserver per pod: " + api_requests.breakdown(pipeline_before, pipeline_after, pods)
    )
    result.notes.append(
        "pipeline phase, rows written per pod by table: "
        + db_counts.tables_breakdown(pipeline_db_before, pipeline_db_after, pods)
    )
    m["raw_bindings_per_s"] = round(raw_rate, 2)
    m["pipeline_pods_per_s"] = round(rate, 2)
    m["ratio_pipeline_vs_raw"] = round(rate / raw_rate, 3)
    m.update(latency_summary("raw", raw_lat))
    m.update(latency_summary("pipeline", lat))
    errors = warm_errors + errors
    m["pipeline_errors"] = len(errors)
    if errors:
        result.status = "error"
        result.notes.append(f"{len(errors)} bind calls failed, e.g. {errors[0]}")
    return result
