"""Pure helpers of `gpushare up`: GPU specs, service command lines, where things listen."""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Sequence
from dataclasses import dataclass, field

from services.extender.wire import DEFAULT_PREFIX as EXTENDER_PREFIX

_GPU_ENTRY = re.compile(
    r"^\s*(?:(?P<count>\d+)\s*x\s*)?(?P<mem>\d+)\s*(?P<unit>GiB|MiB|G|M)?\s*(?::\s*(?P<model>[\w.\-]+))?\s*$"
)

DEFAULT_GPUS = "1x16GiB:Tesla-T4"


@dataclass(frozen=True)
class GpuModelSpec:
    """`count` GPUs of `memory_mib` each, all of one model."""

    count: int
    memory_mib: int
    model: str


def parse_gpus(spec: str) -> list[GpuModelSpec]:
    """Parse `"1x16GiB:Tesla-T4,2x24GiB:A10"`; raises ValueError naming the bad entry."""
    out: list[GpuModelSpec] = []
    for entry in spec.split(","):
        m = _GPU_ENTRY.match(entry)
        if not m:
            raise ValueError(
                f"bad GPU spec {entry.strip()!r}: expected COUNTxMEM[GiB|MiB]:MODEL, e.g. 1x16GiB:Tesla-T4"
            )
        count = int(m["count"] or 1)
        mem = int(m["mem"])
        mib = mem if (m["unit"] or "GiB").startswith("M") else mem * 1024
        if count < 1 or count > 16 or mib < 1:
            raise ValueError(f"bad GPU spec {entry.strip()!r}: 1..16 GPUs of at least 1 MiB")
        out.append(GpuModelSpec(count, mib, m["model"] or "Tesla-T4"))
    return out


def node_gpus(spec: str, unit_mib: int = 1024) -> list[tuple[int, str]]:
    """`(memory in resource units, model)` per GPU, as `devstack.cluster.nodes.create_gpu_node` takes them."""
    return [(g.memory_mib // unit_mib, g.model) for g in parse_gpus(spec) for _ in range(g.count)]


def node_names(prefix: str, count: int) -> list[str]:
    """Names of the simulated nodes: `gpu-node-1`, `gpu-node-2`, ..."""
    return [f"{prefix}-{i}" for i in range(1, count + 1)]


@dataclass(frozen=True)
class CommonFlags:
    """The common flags every service subprocess gets (so it depends only on the CLI contract)."""

    database_url: str
    nats_url: str
    stream_name: str = "GPUSHARE"
    subject_prefix: str = "gpushare"
    log_format: str = "json"
    log_level: str = "INFO"
    memory_unit: str = "GiB"
    accounting_url: str | None = None

    def argv(self) -> list[str]:
        """The flags as arguments."""
        args = ["--database-url", self.database_url] if self.database_url else []
        args += [
            "--nats-url",
            self.nats_url,
            "--stream-name",
            self.stream_name,
            "--subject-prefix",
            self.subject_prefix,
            "--log-format",
            self.log_format,
            "--log-level",
            self.log_level,
            "--memory-unit",
            self.memory_unit,
        ]
        if self.accounting_url:
            args += ["--accounting-url", self.accounting_url]
        return args


@dataclass(frozen=True)
class ServiceCommand:
    """One service subprocess: its name, argv, and the URL that says it is ready."""

    name: str
    argv: list[str]
    ready_url: str | None
    listens: str = ""
    env: dict[str, str] = field(default_factory=dict)

    @property
    def metrics_target(self) -> str:
        """`host:port` of its /metrics (every service serves it beside /readyz or /healthz), "" when unknown."""
        if not self.ready_url or "://" not in self.ready_url:
            return ""
        return self.ready_url.split("://", 1)[1].split("/", 1)[0]

    @property
    def port(self) -> int:
        """The port it serves HTTP on (0 when unknown)."""
        target = self.metrics_target
        return int(target.rsplit(":", 1)[1]) if ":" in target else 0


@dataclass(frozen=True)
class AgentUsage:
    """How the simulated nodes' agents sample usage: `simulate` (`--simulate-usage` rules or @FILE; None: no
    simulated usage), the sampling interval and the over-use grace period, in seconds."""

    simulate: str | None = None
    interval_s: float = 5.0
    overuse_grace_s: float = 60.0

    def argv(self) -> list[str]:
        """The node agent's flags."""
        args = ["--usage-interval", f"{self.interval_s:g}", "--overuse-grace", f"{self.overuse_grace_s:g}"]
        return args + (["--simulate-usage", self.simulate] if self.simulate else [])


def gpushare_argv(subcommand: str, *args: str, common: CommonFlags | None = None) -> list[str]:
    """`python -m services.cli SUBCOMMAND ARGS COMMON-FLAGS` with this interpreter."""
    return [sys.executable, "-m", "services.cli", subcommand, *args, *(common.argv() if common else [])]


def extender_command(
    common: CommonFlags,
    port: int,
    bind_timeout: float,
    kubeconfig: str | None = None,
    *,
    name: str = "extender",
    webhook: tuple[int, str, str] | None = None,
) -> ServiceCommand:
    """The scheduler extender (kube-scheduler calls it at http://127.0.0.1:PORT/gpushare-scheduler).

    Bind verifies each pod in the API server of `kubeconfig`; without one (the scheduler simulator, no API
    server) it trusts what filter saw (`--trust-filter-pods`, development only). `webhook` (port, certificate,
    key): also serve gpushare admission over HTTPS there (DRA nodes; needs `kubeconfig`)."""
    pods = ["--kubeconfig", kubeconfig] if kubeconfig else ["--trust-filter-pods"]
    if webhook is not None and kubeconfig:
        pods += ["--webhook-port", str(webhook[0]), "--webhook-tls-cert", webhook[1], "--webhook-tls-key", webhook[2]]
    argv = gpushare_argv(
        "extender",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--prefix",
        EXTENDER_PREFIX,
        "--bind-timeout",
        f"{bind_timeout:g}",
        *pods,
        common=common,
    )
    return ServiceCommand(name, argv, f"http://127.0.0.1:{port}/readyz", f"http://127.0.0.1:{port}{EXTENDER_PREFIX}")


def binder_command(
    common: CommonFlags,
    port: int,
    kubeconfig: str,
    *,
    name: str = "binder",
    lease_namespace: str = "default",
    extra: tuple[str, ...] = (),
) -> ServiceCommand:
    """The binder (creates Bindings for reserved pods). Replicas share one host here, so each is named in the
    leader election's Lease by its process name (in Kubernetes the pod name does that), and the Lease lives in
    `lease_namespace` of the stack's cluster (not the namespace of a pod the stack itself may run in)."""
    argv = gpushare_argv(
        "binder",
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--kubeconfig",
        kubeconfig,
        "--lease-identity",
        name,
        "--lease-namespace",
        lease_namespace,
        *extra,
        common=common,
    )
    return ServiceCommand(name, argv, f"http://127.0.0.1:{port}/readyz", f"http://127.0.0.1:{port}")


def accounting_command(
    common: CommonFlags,
    port: int,
    admin_token: str | None,
    kubeconfig: str | None = None,
    *,
    name: str = "accounting",
) -> ServiceCommand:
    """Accounting (REST /v1, dashboard /ui); with `kubeconfig` it shows that cluster's ResourceQuotas too."""
    kube = ["--kubeconfig", kubeconfig] if kubeconfig else ["--no-kubernetes"]
    argv = gpushare_argv("accounting", "--host", "127.0.0.1", "--port", str(port), *kube, common=common)
    env = {"GPUSHARE_ADMIN_TOKEN": admin_token} if admin_token else {}
    return ServiceCommand(name, argv, f"http://127.0.0.1:{port}/readyz", f"http://127.0.0.1:{port}", env)


def node_agent_command(
    common: CommonFlags,
    *,
    node: str,
    gpus: str,
    device_plugin_dir: str,
    pod_resources_socket: str,
    metrics_port: int,
    kubeconfig: str | None,
    address: str = "",
    usage: AgentUsage | None = None,
    extra: Sequence[str] = (),
) -> ServiceCommand:
    """One node agent in fake-GPU mode (no database URL: agents reach the ledger over NATS only), with simulated
    usage when `usage` has rules; `extra` arguments are passed on (`--dra` and its directories)."""
    args = [
        "--node",
        node,
        "--node-address",
        address,
        "--fake-gpus",
        gpus,
        "--device-plugin-dir",
        device_plugin_dir,
        "--pod-resources-socket",
        pod_resources_socket,
        "--metrics-port",
        str(metrics_port),
        "--host",
        "127.0.0.1",  # a local stack listens on loopback only
    ]
    if kubeconfig:
        args += ["--kubeconfig", kubeconfig]
    args += (usage or AgentUsage()).argv()
    args += list(extra)
    argv = gpushare_argv("node-agent", *args, common=dataclasses.replace(common, database_url=""))
    return ServiceCommand(
        f"node-agent-{node}", argv, f"http://127.0.0.1:{metrics_port}/healthz", f"http://127.0.0.1:{metrics_port}"
    )


def fleet_command(
    common: CommonFlags,
    *,
    nodes: Sequence[str],
    gpus: str,
    socket_dir: str,
    kubeconfig: str,
    port: int,
    addresses: dict[str, str],
    admit: bool = True,
    usage: AgentUsage | None = None,
) -> ServiceCommand:
    """Every simulated node's agent and kubelet stand-in in one process (`devstack.stack.fleet`); with simulated
    usage when `usage` has rules (the fleet otherwise keeps its own, longer, sampling interval)."""
    argv = [
        sys.executable,
        "-m",
        "devstack.stack.fleet",
        "--nodes",
        ",".join(nodes),
        "--gpus",
        gpus,
        "--socket-dir",
        socket_dir,
        "--kubeconfig",
        kubeconfig,
        "--nats-url",
        common.nats_url,
        "--stream-name",
        common.stream_name,
        "--subject-prefix",
        common.subject_prefix,
        "--memory-unit",
        common.memory_unit,
        "--addresses",
        ",".join(f"{n}={a}" for n, a in addresses.items()),
        "--port",
        str(port),
        "--log-level",
        common.log_level,
        "--log-format",
        common.log_format,
    ]
    if not admit:
        argv.append("--no-admit")
    if usage is not None and usage.simulate:
        argv += usage.argv()
    return ServiceCommand("node-fleet", argv, f"http://127.0.0.1:{port}/readyz", f"http://127.0.0.1:{port}")


def replica_names(service: str, replicas: int) -> list[str]:
    """The process names of a service's replicas: the service's own name for one, `binder-1`, `binder-2`, ... for
    more."""
    return [service] if replicas == 1 else [f"{service}-{i}" for i in range(1, replicas + 1)]


def summary_lines(listens: Sequence[tuple[str, str]]) -> list[str]:
    """Aligned `name  where` lines."""
    width = max((len(n) for n, _ in listens), default=0)
    return [f"  {n.ljust(width)}  {w}" for n, w in listens]
