"""`gpushare node-agent`: the per-node DaemonSet (discovery, device plugins, exact assignment, usage)."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
from pathlib import Path
from typing import Any

from shared.kubelet_api import DEVICE_PLUGIN_DIR, POD_RESOURCES_SOCKET
from shared.settings import Settings

log = logging.getLogger(__name__)


def register(subparsers: Any, common: argparse.ArgumentParser) -> None:
    """Add the `node-agent` subcommand."""
    p = subparsers.add_parser(
        "node-agent",
        parents=[common],
        help="run the node agent (GPU discovery, kubelet device plugins, exact assignment, usage)",
        description="Discover the node's GPUs (NVML, or --fake-gpus), record them in the ledger, serve the "
        "aliyun.com/gpu-mem, gpu-core and gpu-count device plugins to kubelet, hand each container exactly "
        "the GPU the ledger reserved for it, and publish usage and health. The agent talks to the ledger over "
        "NATS only (the binder answers for it): it needs no database URL.",
    )
    p.add_argument("--node", default=os.environ.get("NODE_NAME"), help="this node's name (default $NODE_NAME)")
    p.add_argument(
        "--node-address",
        default=os.environ.get("NODE_IP", ""),
        help="this node's IP, shown by inspect (default $NODE_IP, the downward API's status.hostIP)",
    )
    p.add_argument(
        "--fake-gpus", metavar="SPEC", help='fake GPUs instead of NVML, e.g. "2x16GiB:Tesla-T4,1x80GiB:A100"'
    )
    p.add_argument("--device-plugin-dir", default=str(DEVICE_PLUGIN_DIR), help="kubelet's plugin directory")
    p.add_argument("--pod-resources-socket", default=POD_RESOURCES_SOCKET, help="kubelet's pod-resources API socket")
    p.add_argument("--metrics-port", type=int, default=9119, help="port of /metrics, /healthz, /readyz (default 9119)")
    p.add_argument("--mps", action="store_true", help="the node runs the MPS control daemon: hand out MPS limits")
    p.add_argument(
        "--device-list-strategy",
        choices=["envvar", "volume-mounts"],
        default="envvar",
        help="how containers learn their GPUs: NVIDIA_VISIBLE_DEVICES (envvar, default) or volume mounts the NVIDIA "
        "container toolkit reads (with accept-nvidia-visible-devices-as-volume-mounts = true and "
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false a pod's own GPU list is ignored)",
    )
    p.add_argument("--type-label-key", default="gpu-type", help="node label key for the short GPU type ('' = none)")
    p.add_argument("--kubeconfig", help="kubeconfig for node labels and evictions (default: in-cluster)")
    p.add_argument("--usage-interval", type=float, default=5.0, help="seconds between usage samples (default 5)")
    p.add_argument(
        "--overuse-grace", type=float, default=60.0, help="seconds a pod may use more than allocated (default 60)"
    )
    p.add_argument("--evict-overusers", action="store_true", help="evict pods that over-use past the grace period")
    p.add_argument("--proc-root", default="/proc", help="host /proc (needs hostPID) for PID -> pod mapping")
    p.set_defaults(func=run)


def make_backend(args: argparse.Namespace) -> Any:
    """The GPU backend: fake when --fake-gpus is given, else NVML (exits with a clear message without it)."""
    from services.node_agent.discovery import FakeBackend, NoGpuBackend

    if args.fake_gpus:
        try:
            return FakeBackend(args.node, args.fake_gpus)
        except ValueError as exc:
            raise NoGpuBackend(str(exc)) from None
    from services.node_agent.nvml import NvmlBackend

    return NvmlBackend()


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run until SIGTERM / SIGINT."""
    if not args.node:
        raise SystemExit("no node name: pass --node or set NODE_NAME (the downward API's spec.nodeName)")
    backend = make_backend(args)
    try:
        return asyncio.run(_serve(args, settings, backend))
    finally:
        backend.close()


async def _kube(kubeconfig: str | None) -> dict[str, Any]:
    """Kubernetes callbacks for the agent, or {} when no configuration is available."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.config.config_exception import ConfigException

    from shared.kube.client import api_client

    try:
        api = await api_client(kubeconfig)
    except (ConfigException, OSError) as exc:
        log.warning("no Kubernetes access (%s): node labels and evictions are skipped", exc)
        return {}
    core = client.CoreV1Api(api)

    async def patch_node_labels(node: str, labels: dict[str, str]) -> None:
        await core.patch_node(node, {"metadata": {"labels": labels}})

    async def evict_pod(namespace: str, name: str) -> None:
        body = {"apiVersion": "policy/v1", "kind": "Eviction", "metadata": {"name": name, "namespace": namespace}}
        try:
            await core.create_namespaced_pod_eviction(name, namespace, body)
        except client.ApiException as exc:
            if exc.status != 404:
                raise
            body["apiVersion"] = "policy/v1beta1"  # clusters before 1.22
            await core.create_namespaced_pod_eviction(name, namespace, body)

    return {"patch_node_labels": patch_node_labels, "evict_pod": evict_pod, "api": api}


async def _serve(args: argparse.Namespace, settings: Settings, backend: Any) -> int:
    from fastapi import FastAPI

    from services.node_agent.agent import AgentConfig, NodeAgent
    from shared.http import install_common
    from shared.runtime import ServiceRuntime

    config = AgentConfig(
        node=args.node,
        unit=settings.resource_memory_unit,
        device_plugin_dir=Path(args.device_plugin_dir),
        pod_resources_socket=args.pod_resources_socket,
        mps=args.mps,
        device_list_strategy=args.device_list_strategy,
        type_label_key=args.type_label_key,
        usage_interval_s=args.usage_interval,
        overuse_grace_s=args.overuse_grace,
        evict_overusers=args.evict_overusers,
        proc_root=Path(args.proc_root),
        address=args.node_address,
    )
    async with ServiceRuntime("node-agent", settings, database=False) as rt:
        kube = await _kube(args.kubeconfig)
        api = kube.pop("api", None)
        assert rt.bus is not None
        agent = NodeAgent(config, backend, bus=rt.bus, stop=rt.stop, **kube)
        await agent.start()
        app = FastAPI(title="gpushare node agent", docs_url=None, redoc_url=None)
        install_common(app, ready=lambda: agent.ready() and not rt.stop.is_set(), registry=agent.metrics.registry)

        @app.get("/v1/devices")
        async def devices() -> dict[str, Any]:
            return {
                "node": config.node,
                "driver_version": agent.driver,
                "cuda_version": agent.cuda,
                "gpus": [g.model_dump() for g in agent.gpu_infos()],
            }

        try:
            await rt.serve(app, port=args.metrics_port)
        finally:
            await agent.close()
            if api is not None:
                await api.close()
    if agent.failed is not None:
        log.error("node agent stopped by a fatal error: %r", agent.failed)
        return 1
    return 0
