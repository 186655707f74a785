"""2. Filter + prioritize latency over HTTP (NodeNames mode) at 1,000 and 5,000 nodes x 8 GPUs, half full.

A real `gpushare extender` subprocess runs against a private database seeded with the nodes (every 16 GiB
GPU holds one 8 GiB allocation) and private streams. One client sends what kube-scheduler sends for one
pod asking 4 GiB (it fits on every node, so prioritize scores them all): filter, then prioritize, one
after the other, `requests` times; p50 / p99 per verb and for the pair. The in-process decision time of
the extender's own `filter` + `prioritize` (its view of the same ledger, no HTTP) is measured separately.
"""

from __future__ import annotations

import json
import time

from bench.common import BenchResult, Context, Target, latency_summary, private_bus
from bench.http_client import LeanClient
from bench.stack import node_name, service
from services.extender.service import ExtenderService
from services.extender.wire import DEFAULT_PREFIX as PREFIX
from services.extender.wire import parse_extender_args
from shared.ledger.db import make_engine
from shared.ledger.ledger import Ledger

NAME = "latency"
TITLE = "2. Extender filter + prioritize latency over HTTP (NodeNames), half-full cluster"


def pod(gib: int = 4) -> dict:
    """The pod kube-scheduler asks about."""
    return {
        "metadata": {"name": "bench-pod", "namespace": "bench", "uid": "bench-pod-uid", "annotations": {}},
        "spec": {
            "containers": [{"name": "main", "image": "cuda", "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}}}]
        },
    }


async def in_process(db_url: str, nodes: int, rounds: int) -> list[float]:
    """Decision time of the extender's own filter + prioritize (no HTTP) over its view of the seeded ledger."""
    engine = make_engine(db_url, pool_size=2)
    try:
        service = ExtenderService(engine=engine, ledger=Ledger(engine, prefix="unused"), bus=None, kube_enabled=False)
        await service.resync("bench")
        args = parse_extender_args({"Pod": pod(), "NodeNames": [node_name(n) for n in range(nodes)], "Nodes": None})
        out = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            await service.filter(args)
            service.prioritize(args)
            out.append(time.perf_counter() - t0)
        return out
    finally:
        await engine.dispose()


async def measure(ctx: Context, nodes: int, requests: int) -> dict[str, float]:
    """Seed, start the extender, time the verbs; the metrics for one cluster size."""
    out: dict[str, float] = {}
    t0 = time.perf_counter()
    db_url, _ = await ctx.seeded_database(nodes)
    out[f"n{nodes}_seed_s"] = round(time.perf_counter() - t0, 1)
    async with private_bus(ctx.nats_url, "lat") as bus:
        body = json.dumps({"Pod": pod(), "NodeNames": [node_name(n) for n in range(nodes)], "Nodes": None}).encode()
        async with service(
            "extender", db_url=db_url, nats_url=ctx.nats_url, names=bus.names, work_dir=ctx.work_dir
        ) as ext:
            filt, prio, pair = [], [], []
            async with LeanClient(ext.url) as client:
                for i in range(requests + 5):
                    t0 = time.perf_counter()
                    status_f, answer_f = await client.request("POST", f"{PREFIX}/filter", body)
                    t1 = time.perf_counter()
                    status_p, answer_p = await client.request("POST", f"{PREFIX}/prioritize", body)
                    t2 = time.perf_counter()
                    if status_f != 200 or status_p != 200:
                        raise RuntimeError(f"extender answered {status_f}/{status_p}: {answer_f[:300]!r}")
                    if i == 0:
                        passed = json.loads(answer_f).get("NodeNames") or []
                        if len(passed) != nodes or len(json.loads(answer_p)) != nodes:
                            raise RuntimeError(f"expected all {nodes} nodes to fit, filter passed {len(passed)}")
                    if i >= 5:  # warm-up
                        filt.append(t1 - t0)
                        prio.append(t2 - t1)
                        pair.append(t2 - t0)
        out.update(latency_summary(f"n{nodes}_filter", filt))
        out.update(latency_summary(f"n{nodes}_prioritize", prio))
        out.update(latency_summary(f"n{nodes}_filter_plus_prioritize", pair))
        out.update(
            latency_summary(f"n{nodes}_in_process_decision", await in_process(db_url, nodes, max(20, requests // 2)))
        )
    return out


async def run(ctx: Context) -> BenchResult:
    """Both cluster sizes (tiny: small ones)."""
    sizes = ctx.pick([20], [1000, 5000], [1000, 5000])
    requests = ctx.pick(10, 50, 300)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"nodes": sizes, "gpus_per_node": 8, "requests": requests})
    for nodes in sizes:
        result.metrics.update(await measure(ctx, nodes, requests))
    big = max(sizes)
    result.targets.append(Target(f"n{big}_filter_p99_ms", "<=", 10.0))
    result.targets.append(Target(f"n{big}_prioritize_p99_ms", "<=", 10.0))
    result.notes.append(
        "one keep-alive client (bench/http_client.py, as lean as a Go client), sequential requests; each verb's "
        "body names every node (NodeNames mode)"
    )
    return result
