"""`gpushare node-agent`: the per-node DaemonSet (discovery, device plugins, exact assignment, usage)."""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from shared.dra import CDI_DIR, PLUGIN_DIR, REGISTRATION_DIR
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
    p.add_argument(
        "--host",
        default="0.0.0.0",
        help="listen address of /metrics, /healthz, /readyz (default 0.0.0.0; 127.0.0.1 on a host network that must "
        "not be reached from outside the machine)",
    )
    p.add_argument("--metrics-port", type=int, default=9119, help="port of /metrics, /healthz, /readyz (default 9119)")
    p.add_argument("--mps", action="store_true", help="the node runs the MPS control daemon: hand out MPS limits")
    p.add_argument(
        "--mps-root",
        metavar="DIR",
        help="the MPS control daemon's directory (k8s/components/mps: /run/nvidia-mps): hand out MPS limits, and "
        "make containers its clients, while the daemon runs (its DIR/pipe/control exists)",
    )
    p.add_argument(
        "--device-list-strategy",
        choices=["envvar", "volume-mounts"],
        default="envvar",
        help="how containers learn their GPUs: NVIDIA_VISIBLE_DEVICES (envvar, default) or volume mounts the NVIDIA "
        "container toolkit reads (with accept-nvidia-visible-devices-as-volume-mounts = true and "
        "accept-nvidia-visible-devices-envvar-when-unprivileged = false a pod's own GPU list is ignored)",
    )
    p.add_argument("--type-label-key", default="gpu-type", help="node label key for the short GPU type ('' = none)")
    p.add_argument(
        "--dra",
        action="store_true",
        help="a DRA node: publish a ResourceSlice and serve kubelet's DRA plugin API (driver gpu.gpushare.io) instead "
        "of the device plugins; kube-scheduler then places the shares, the binder records them in the ledger and no "
        "claim the ledger does not hold is prepared (needs Kubernetes 1.36+, or 1.34-1.35 with DRAConsumableCapacity; "
        "label the node gpushare.io/dra-gate=ledger to have the ledger decide before each bind; docs/dra.md)",
    )
    p.add_argument(
        "--dra-ledger-wait",
        type=float,
        default=10.0,
        help="with --dra: seconds NodePrepareResources waits for the ledger to hold a claim's allocation before "
        "refusing it (kubelet then retries; default 10)",
    )
    p.add_argument(
        "--dra-registration-dir",
        default=REGISTRATION_DIR,
        help=f"with --dra: kubelet's plugin registration directory (default {REGISTRATION_DIR})",
    )
    p.add_argument(
        "--dra-plugin-dir",
        default=PLUGIN_DIR,
        help=f"with --dra: where the plugin's socket lives (default {PLUGIN_DIR})",
    )
    p.add_argument(
        "--cdi-dir",
        default=CDI_DIR,
        help=f"with --dra: where the container runtime reads CDI specs (default {CDI_DIR})",
    )
    p.add_argument("--kubeconfig", help="kubeconfig for node labels and evictions (default: in-cluster)")
    p.add_argument("--usage-interval", type=float, default=5.0, help="seconds between usage samples (default 5)")
    p.add_argument(
        "--overuse-grace", type=float, default=60.0, help="seconds a pod may use more than allocated (default 60)"
    )
    p.add_argument("--evict-overusers", action="store_true", help="evict pods that over-use past the grace period")
    p.add_argument(
        "--proc-root", default=None, help="host /proc (needs hostPID) for PID -> pod mapping (default /proc)"
    )
    p.add_argument(
        "--simulate-usage",
        metavar="RULES",
        help="with --fake-gpus only, never on a node with GPUs: give the fake GPUs workloads, e.g. "
        "'gpushare-demo/bert-*=steady:0.9;*=ramp:0.2:0.7:300' or @FILE (re-read when it changes); shapes "
        "steady:F, ramp:F1:F2:SECONDS, spike:F1:F2:EVERY:FOR, idle (F: fraction of the share); see docs/metrics.md",
    )
    p.set_defaults(func=run)


def make_backend(args: argparse.Namespace) -> Any:
    """The GPU backend: fake when --fake-gpus is given, else NVML (exits with a clear message without it).

    `--simulate-usage` needs `--fake-gpus` and a machine without NVIDIA GPUs; its simulated processes' cgroup
    files go to `args.proc_root` (a folder of their own, never the host's /proc)."""
    from services.node_agent.discovery import FakeBackend, NoGpuBackend, nvidia_gpus_present

    if args.simulate_usage:
        if not args.fake_gpus:
            raise NoGpuBackend("--simulate-usage needs --fake-gpus: simulated usage only ever drives fake GPUs")
        found = nvidia_gpus_present()
        if found:
            raise NoGpuBackend(
                f"--simulate-usage refused: this machine has NVIDIA GPUs ({found}); simulated usage is for "
                "machines without GPUs and would hide the real usage"
            )
    if args.fake_gpus:
        try:
            return FakeBackend(
                args.node,
                args.fake_gpus,
                simulate=args.simulate_usage or None,
                proc_root=Path(args.proc_root) if args.simulate_usage else None,
            )
        except ValueError as exc:
            raise NoGpuBackend(str(exc)) from None
    from services.node_agent.nvml import NvmlBackend

    return NvmlBackend()


def simulated_proc_root(args: argparse.Namespace) -> Path | None:
    """With `--simulate-usage`: the folder for the simulated processes' cgroup files (`--proc-root`, else a new
    temporary one, which the caller removes). SystemExit when `--proc-root` is a real /proc."""
    if not args.simulate_usage:
        return None
    if args.proc_root is None:
        return Path(tempfile.mkdtemp(prefix=f"gpushare-simulated-proc-{args.node}-"))
    root = Path(args.proc_root)
    if (root / "self").exists() or root.resolve() == Path("/proc"):
        raise SystemExit(
            f"--proc-root {root} is a real /proc: --simulate-usage writes its processes' cgroup files into a "
            "folder of its own (leave --proc-root out, or name an empty folder)"
        )
    return root


def run(args: argparse.Namespace, settings: Settings) -> int:
    """Run until SIGTERM / SIGINT."""
    from shared.runtime import run_main

    if not args.node:
        raise SystemExit("no node name: pass --node or set NODE_NAME (the downward API's spec.nodeName)")
    made = args.simulate_usage and args.proc_root is None
    args.proc_root = simulated_proc_root(args) or args.proc_root
    try:
        backend = make_backend(args)
        try:
            return run_main(_serve(args, settings, backend))
        finally:
            backend.close()
    finally:
        if made and args.proc_root:
            shutil.rmtree(args.proc_root, ignore_errors=True)


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
    from services.node_agent.discovery import FakeBackend
    from shared.http import install_common
    from shared.runtime import Listen, ServiceRuntime

    config = AgentConfig(
        node=args.node,
        unit=settings.resource_memory_unit,
        device_plugin_dir=Path(args.device_plugin_dir),
        pod_resources_socket=args.pod_resources_socket,
        mps=args.mps,
        mps_root=Path(args.mps_root) if args.mps_root else None,
        device_list_strategy=args.device_list_strategy,
        type_label_key=args.type_label_key,
        usage_interval_s=args.usage_interval,
        overuse_grace_s=args.overuse_grace,
        evict_overusers=args.evict_overusers,
        proc_root=Path(args.proc_root or "/proc"),
        address=args.node_address,
        dra=args.dra,
        dra_registration_dir=Path(args.dra_registration_dir),
        dra_plugin_dir=Path(args.dra_plugin_dir),
        cdi_dir=Path(args.cdi_dir),
        dra_ledger_wait_s=args.dra_ledger_wait,
    )
    listen = Listen(host=args.host, port=args.metrics_port)
    async with ServiceRuntime("node-agent", settings, database=False, listen=listen) as rt:
        kube = await _kube(args.kubeconfig)
        api = kube.pop("api", None)
        if args.dra and api is None:
            raise SystemExit("--dra needs Kubernetes access (the ResourceSlice and the claims): pass --kubeconfig")
        assert rt.bus is not None
        agent = NodeAgent(config, backend, bus=rt.bus, stop=rt.stop, kube_api=api, **kube)
        if isinstance(backend, FakeBackend) and backend.rules is not None:
            backend.attach(agent.view.containers)
            log.warning(
                "simulated usage is on: this agent reports made-up GPU usage (%s)",
                "; ".join(map(str, backend.rules.current())) or "no rule yet",
                extra={"node": config.node, "rules": args.simulate_usage},
            )
        await agent.start()
        app = FastAPI(title="gpushare node agent", docs_url=None, redoc_url=None)
        install_common(app, ready=lambda: agent.ready() and not rt.stop.is_set(), registry=agent.metrics.registry)

        @app.get("/v1/devices")
        async def devices() -> dict[str, Any]:
            return {
                "node": config.node,
                "driver_version": agent.driver,
                "cuda_version": agent.cuda,
                "simulated_usage": bool(args.simulate_usage),
                "gpus": [g.model_dump() for g in agent.gpu_infos()],
            }

        try:
            await rt.serve(app)
        finally:
            await agent.close()
            if api is not None:
                await api.close()
    if agent.failed is not None:
        log.error("node agent stopped by a fatal error: %r", agent.failed)
        return 1
    return 0
