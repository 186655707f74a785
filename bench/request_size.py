"""9. Extender request size: the largest body a real kube-scheduler sends to filter / prioritize.

A real control plane with `nodes` Nodes (cloud-style names, ~44 characters) and an extender entry with
`nodeCacheCapable: true` and `percentageOfNodesToScore: 100` (kube-scheduler then sends every feasible node:
the worst case; its default sends about 10 % at 5,000 nodes). The extender here is a recorder that passes
every node and records each body's size; kube-scheduler binds the pod itself. The pod is a large ordinary one
(three containers with 40 environment variables each, labels and annotations: ~12 KB).

The extender's default body limit (`services.extender.wire.DEFAULT_MAX_BODY_BYTES`) must stay above the
largest body, also with names of the maximum length (253 characters): `worst_case_253_char_names_bytes`
adds (253 - name length) bytes per node to what was measured.
"""

from __future__ import annotations

import asyncio
import threading
import time
import uuid
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse
from kubernetes_asyncio import client

from bench.common import BenchResult, Context, gather_limited
from devstack.cluster import ControlPlane, ExtenderConfig
from devstack.cluster.nodes import set_node_status
from devstack.embedded import free_port
from services.extender.wire import DEFAULT_MAX_BODY_BYTES

NAME = "request_size"
TITLE = "8. Largest filter / prioritize body from a real kube-scheduler (nodeCacheCapable)"
MAX_NAME = 253  # a node name is a DNS subdomain


def node_name(i: int) -> str:
    """A cloud-style node name (~44 characters)."""
    return f"ip-10-{i // 65536 % 256}-{i // 256 % 256}-{i % 256}.eu-central-1.compute.internal"


class Recorder:
    """An extender that passes every node and records body sizes per verb."""

    def __init__(self) -> None:
        self.sizes: dict[str, list[int]] = {"filter": [], "prioritize": []}
        self.app = FastAPI()

        @self.app.post("/rec/filter")
        async def filter_(request: Request) -> Any:
            body = await request.body()
            self.sizes["filter"].append(len(body))
            names = (await request.json()).get("NodeNames") or []
            return JSONResponse({"NodeNames": names, "FailedNodes": {}, "Error": ""})

        @self.app.post("/rec/prioritize")
        async def prioritize(request: Request) -> Any:
            body = await request.body()
            self.sizes["prioritize"].append(len(body))
            return JSONResponse([{"Host": n, "Score": 0} for n in (await request.json()).get("NodeNames") or []])

    def serve(self, port: int) -> uvicorn.Server:
        server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=port, log_config=None))
        threading.Thread(target=server.run, daemon=True).start()
        while not server.started:
            time.sleep(0.05)
        return server


def big_pod(name: str) -> dict[str, Any]:
    """A large ordinary GPU pod."""
    containers = [
        {
            "name": f"c{c}",
            "image": "registry.example.com/team/inference-server:2026.12.01-cuda12.4",
            "command": ["python", "-m", "server", "--port", "8080"],
            "env": [{"name": f"SETTING_{c}_{i}", "value": f"value-{i}-" + "x" * 40} for i in range(40)],
            "resources": {"limits": {"aliyun.com/gpu-mem": "2", "cpu": "100m", "memory": "64Mi"}},
        }
        for c in range(3)
    ]
    return {
        "metadata": {
            "name": name,
            "labels": {f"label-{i}": f"value-{i}" for i in range(20)},
            "annotations": {f"example.com/annotation-{i}": "y" * 80 for i in range(20)},
        },
        "spec": {"containers": containers, "tolerations": [{"operator": "Exists"}]},
    }


async def create_nodes(api: Any, count: int, concurrency: int = 32) -> None:
    core = client.CoreV1Api(api)

    async def one(i: int) -> None:
        name = node_name(i)
        labels = {"kubernetes.io/hostname": name, "kubernetes.io/os": "linux"}
        await core.create_node({"metadata": {"name": name, "labels": labels}})
        await set_node_status(api, name, [(16, "Tesla-T4")])

    await gather_limited(concurrency, [one(i) for i in range(count)])


async def run(ctx: Context) -> BenchResult:
    """Start the recorder and a control plane, create the nodes and one pod, wait for it to be bound."""
    nodes = ctx.pick(50, 1000, 5000)
    result = BenchResult(NAME, TITLE, ctx.profile, params={"nodes": nodes, "name_length": len(node_name(0))})
    recorder = Recorder()
    port = free_port()
    server = await asyncio.to_thread(recorder.serve, port)
    extender = ExtenderConfig(
        url_prefix=f"http://127.0.0.1:{port}/rec", bind_verb=None, preempt_verb=None, http_timeout="60s"
    )
    cp = ControlPlane(
        extender, scheduler_extra={"percentageOfNodesToScore": 100}, work_dir=ctx.work_dir / "request-size"
    )
    try:
        await asyncio.to_thread(cp.start)
        api = cp.api_client()
        try:
            t0 = time.monotonic()
            await create_nodes(api, nodes)
            result.metrics["create_nodes_s"] = round(time.monotonic() - t0, 1)
            core = client.CoreV1Api(api)
            name = f"big-{uuid.uuid4().hex[:6]}"
            await core.create_namespaced_pod("default", big_pod(name))
            deadline = time.monotonic() + 300
            while not (await core.read_namespaced_pod(name, "default")).spec.node_name:
                if time.monotonic() > deadline:
                    raise TimeoutError("kube-scheduler did not bind the pod within 300 s")
                await asyncio.sleep(0.5)
        finally:
            await api.close()
    finally:
        await asyncio.to_thread(cp.stop)
        server.should_exit = True
    largest = max(recorder.sizes["filter"] + recorder.sizes["prioritize"])
    m = result.metrics
    m["filter_calls"] = len(recorder.sizes["filter"])
    m["largest_filter_bytes"] = max(recorder.sizes["filter"])
    m["largest_prioritize_bytes"] = max(recorder.sizes["prioritize"] or [0])
    m["worst_case_253_char_names_bytes"] = largest + nodes * (MAX_NAME - len(node_name(0)))
    m["extender_body_limit_bytes"] = DEFAULT_MAX_BODY_BYTES
    m["limit_over_worst_case"] = round(DEFAULT_MAX_BODY_BYTES / m["worst_case_253_char_names_bytes"], 2)
    if m["limit_over_worst_case"] < 1:
        result.notes.append("the extender's default body limit is BELOW the worst case: raise it")
    return result
