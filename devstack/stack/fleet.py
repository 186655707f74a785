"""Many simulated GPU nodes in one process: for each node a real `NodeAgent` (fake GPUs, its three device-plugin
gRPC servers, its ledger link over NATS) and a kubelet stand-in (registration and pod-resources servers), with
one shared pod list admitting every node's pods in kubelet's order.

Hundreds of node agents as processes would not fit on a small machine; as objects in one event loop they
share a NATS connection and the code paths are the same as in the DaemonSet (the agent's own classes), so
the central services see what they would see from that many nodes.

    python -m devstack.stack.fleet --nodes gpu-1,gpu-2 --gpus 8x16GiB:Tesla-T4 --socket-dir /tmp/fleet \\
        --kubeconfig KUBECONFIG --nats-url nats://127.0.0.1:4222 [--port 0] [--no-admit]

It serves `/healthz` (alive) and `/readyz` (every agent ready) on `--port`, and `/metrics` with the agents'
device-plugin outcomes summed.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from devstack.cluster.releases import Release
from devstack.stack.kubelets import NodeKubelet, SharedAdmission, api_release
from services.node_agent.agent import AgentConfig, NodeAgent
from services.node_agent.discovery import FakeBackend
from shared.annotations import RESOURCES
from shared.events.bus import BusNames, EventBus
from shared.logging import configure_logging
from shared.settings import MemoryUnit

log = logging.getLogger("gpushare.fleet")

START_CONCURRENCY = 16


@dataclass
class FleetNode:
    """One simulated node's agent and kubelet."""

    name: str
    agent: NodeAgent
    kubelet: NodeKubelet


class Fleet:
    """The simulated nodes of one process."""

    def __init__(
        self,
        api: Any,
        bus: EventBus,
        nodes: list[str],
        gpus: str,
        socket_dir: Path,
        *,
        unit: MemoryUnit = MemoryUnit.GIB,
        usage_interval_s: float = 60.0,
        admit: bool = True,
        addresses: dict[str, str] | None = None,
        simulate_usage: str | None = None,
        overuse_grace_s: float = 60.0,
    ) -> None:
        self.api = api
        self.bus = bus
        self.names = nodes
        self.gpus = gpus
        self.socket_dir = socket_dir
        self.unit = unit
        self.usage_interval_s = usage_interval_s
        self.admit = admit
        self.addresses = addresses or {}
        self.simulate_usage = simulate_usage
        self.overuse_grace_s = overuse_grace_s
        self.nodes: dict[str, FleetNode] = {}
        self.admission: SharedAdmission | None = None
        self.release: Release | None = None  # the API server's, which every kubelet stand-in plays

    async def start(self, progress: Any = None) -> None:
        """Start every node's kubelet stand-in and agent (a few at a time), then the shared admission."""
        gate = asyncio.Semaphore(START_CONCURRENCY)
        self.release = await api_release(self.api)

        async def one(name: str) -> None:
            async with gate:
                self.nodes[name] = await self._start_node(name)
                if progress is not None and len(self.nodes) % 50 == 0:
                    progress(f"{len(self.nodes)} of {len(self.names)} simulated nodes started")

        await asyncio.gather(*(one(n) for n in self.names))
        if self.admit:
            kubelets = {name: node.kubelet for name, node in self.nodes.items()}
            self.admission = SharedAdmission(self.api, kubelets).start()

    async def _start_node(self, name: str) -> FleetNode:
        base = self.socket_dir / name
        dp_dir = base / "dp"
        dp_dir.mkdir(parents=True, exist_ok=True)
        kubelet = NodeKubelet(self.api, name, dp_dir, base / "pod-resources.sock", release=self.release)
        await kubelet.start(poll=False)
        config = AgentConfig(
            node=name,
            unit=self.unit,
            device_plugin_dir=dp_dir,
            pod_resources_socket=str(base / "pod-resources.sock"),
            usage_interval_s=self.usage_interval_s,
            overuse_grace_s=self.overuse_grace_s,
            address=self.addresses.get(name, ""),
            proc_root=base / "proc",  # the simulated processes' cgroup files (--simulate-usage)
        )
        backend = FakeBackend(name, self.gpus, simulate=self.simulate_usage, proc_root=config.proc_root)
        agent = NodeAgent(config, backend, bus=self.bus)
        backend.attach(agent.view.containers)
        await agent.start()
        await kubelet.standin.wait_registered(RESOURCES, timeout_s=60)
        return FleetNode(name, agent, kubelet)

    def ready(self) -> int:
        """How many agents are ready (inventory in the ledger, view loaded)."""
        return sum(1 for n in self.nodes.values() if n.agent.ready())

    def failed(self) -> list[str]:
        """Nodes whose agent stopped on a fatal error."""
        return [name for name, n in self.nodes.items() if n.agent.failed is not None]

    def outcomes(self) -> dict[str, float]:
        """Device-plugin outcomes summed over the agents (reason -> count)."""
        totals: dict[str, float] = {}
        for n in self.nodes.values():
            for metric in n.agent.metrics.plugin_outcomes.collect():
                for sample in metric.samples:
                    if sample.name.endswith("_total"):
                        reason = sample.labels.get("reason", "")
                        totals[reason] = totals.get(reason, 0.0) + sample.value
        return totals

    async def stop(self) -> None:
        """Stop admission, agents and kubelets."""
        if self.admission is not None:
            await self.admission.stop()
        for n in self.nodes.values():
            with contextlib.suppress(Exception):
                await n.agent.close()
            n.agent.backend.close()
            with contextlib.suppress(Exception):
                await n.kubelet.stop()


def _metrics_text(fleet: Fleet) -> str:
    lines = [
        "# HELP gpushare_fleet_agents_ready Simulated node agents that are ready",
        "# TYPE gpushare_fleet_agents_ready gauge",
        f"gpushare_fleet_agents_ready {fleet.ready()}",
        "# HELP gpushare_node_agent_device_plugin_outcomes_total Device-plugin outcomes of every node, summed",
        "# TYPE gpushare_node_agent_device_plugin_outcomes_total counter",
    ]
    lines += [
        f'gpushare_node_agent_device_plugin_outcomes_total{{reason="{r}"}} {v}'
        for r, v in sorted(fleet.outcomes().items())
    ]
    return "\n".join(lines) + "\n"


async def _serve(fleet: Fleet, port: int, stop: asyncio.Event) -> None:
    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        request = (await reader.readline()).decode(errors="replace").split()
        with contextlib.suppress(Exception):
            while (await reader.readline()).strip():
                pass
        path = request[1] if len(request) > 1 else "/"
        status, body = "404 Not Found", "not found\n"
        if path == "/healthz":
            status, body = "200 OK", "ok\n"
        elif path == "/readyz":
            ready = fleet.ready() == len(fleet.names) and not fleet.failed()
            status = "200 OK" if ready else "503 Service Unavailable"
            body = f"{fleet.ready()} of {len(fleet.names)} agents ready\n"
        elif path == "/metrics":
            status, body = "200 OK", _metrics_text(fleet)
        data = body.encode()
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n".encode() + data)
        with contextlib.suppress(Exception):
            await writer.drain()
        writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", port)
    async with server:
        await stop.wait()


async def main_async(args: argparse.Namespace) -> int:
    """Run the fleet until SIGTERM / SIGINT."""
    from shared.kube.client import api_client

    nodes = [n for n in args.nodes.split(",") if n]
    loop = asyncio.get_running_loop()
    # every agent's health loop waits in a thread: give them room beside the other blocking calls
    loop.set_default_executor(ThreadPoolExecutor(max_workers=len(nodes) + 16, thread_name_prefix="fleet"))
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    bus = await EventBus.connect(args.nats_url, BusNames(args.stream_name, args.subject_prefix), name="gpushare-fleet")
    api = await api_client(args.kubeconfig)
    addresses = dict(pair.split("=", 1) for pair in args.addresses.split(",") if "=" in pair)
    fleet = Fleet(
        api,
        bus,
        nodes,
        args.gpus,
        Path(args.socket_dir),
        unit=MemoryUnit(args.memory_unit),
        usage_interval_s=args.usage_interval,
        admit=not args.no_admit,
        addresses=addresses,
        simulate_usage=args.simulate_usage,
        overuse_grace_s=args.overuse_grace,
    )
    server = asyncio.create_task(_serve(fleet, args.port, stop))
    try:
        await fleet.start(progress=lambda m: log.info(m))
        log.info("%d simulated nodes started", len(nodes))
        await stop.wait()
    finally:
        await fleet.stop()
        stop.set()
        await server
        await api.close()
        await bus.close()
    return 1 if fleet.failed() else 0


def main(argv: list[str] | None = None) -> int:
    """`python -m devstack.stack.fleet`."""
    p = argparse.ArgumentParser(
        prog="python -m devstack.stack.fleet",
        description="Run many simulated GPU nodes (node agents with fake GPUs and kubelet stand-ins) in one process.",
    )
    p.add_argument("--nodes", required=True, help="comma-separated node names (the Node objects must exist)")
    p.add_argument("--gpus", default="8x16GiB:Tesla-T4", help="fake GPUs of every node (default 8x16GiB:Tesla-T4)")
    p.add_argument("--socket-dir", required=True, help="where each node's kubelet sockets go")
    p.add_argument("--kubeconfig", required=True, help="the cluster the nodes belong to")
    p.add_argument("--nats-url", required=True, help="NATS URL")
    p.add_argument("--stream-name", default="GPUSHARE", help="JetStream stream (default GPUSHARE)")
    p.add_argument("--subject-prefix", default="gpushare", help="event subject prefix (default gpushare)")
    p.add_argument("--memory-unit", default="GiB", choices=["GiB", "MiB"], help="unit of aliyun.com/gpu-mem")
    p.add_argument("--usage-interval", type=float, default=60.0, help="seconds between usage samples (default 60)")
    p.add_argument("--simulate-usage", metavar="RULES", help="simulated usage of every node (the node agent's flag)")
    p.add_argument("--overuse-grace", type=float, default=60.0, help="seconds a pod may over-use (default 60)")
    p.add_argument("--addresses", default="", help="node=IP,... for inspect's IPADDRESS column")
    p.add_argument("--port", type=int, default=0, help="port of /healthz, /readyz, /metrics")
    p.add_argument("--no-admit", action="store_true", help="do not admit pods (scheduling benchmarks)")
    p.add_argument("--log-level", default="INFO")
    p.add_argument("--log-format", default="json", choices=["json", "text"])
    args = p.parse_args(argv)
    configure_logging(args.log_level, args.log_format)
    return asyncio.run(main_async(args))


if __name__ == "__main__":
    sys.exit(main())
