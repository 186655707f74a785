"""The orchestration behind `gpushare up` (and the e2e fixtures): everything started in order, stopped in reverse.

    stack = Stack(StackConfig(data_dir=Path(".gpushare")))
    await stack.start()          # stores, migrations, control plane, services, simulated nodes
    ...
    await stack.stop()

Services run as subprocesses of `python -m services.cli <service>` with the common flags, so the stack depends
only on the command-line contract. The kubelet stand-ins (one per simulated node) run in this process.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import importlib.util
import logging
import shutil
import tempfile
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg

from devstack.embedded import EmbeddedNats, EmbeddedPostgres, free_port, port_or_free, with_database, with_user
from devstack.stack import spec
from devstack.stack.processes import ServiceProcess

log = logging.getLogger(__name__)

Progress = Callable[[str], None]

MODE_LOCAL = "local control plane"
MODE_EXTERNAL = "existing cluster (KUBECONFIG)"
MODE_SIMULATOR = "scheduler simulator"


def _print_progress(msg: str) -> None:
    print(f"==> {msg}", flush=True)


@dataclass
class StackConfig:
    """Everything `gpushare up` can be told."""

    data_dir: Path = Path(".gpushare")
    nodes: int = 2
    gpus: str = spec.DEFAULT_GPUS
    max_pods: int = 110  # each simulated node's pod capacity (a kubelet's --max-pods; 110 is its default)
    node_prefix: str = "gpu-node"
    extender_port: int = 12345
    binder_port: int = 8081
    accounting_port: int = 8080
    bind_timeout: float = 30.0
    database_url: str | None = None
    nats_url: str | None = None
    stream_name: str = "GPUSHARE"
    subject_prefix: str = "gpushare"
    log_format: str = "json"
    log_level: str = "INFO"
    memory_unit: str = "GiB"
    admin_token: str | None = None
    kubeconfig: str | None = None
    simulate: bool = False
    scheduler_extra: dict[str, Any] | None = None
    # replicas of the extender, binder and accounting: the extenders behind one address (a Service stand-in,
    # `service_proxy.py`) that kube-scheduler calls, the accountings behind another, the binders electing a leader
    replicas: int = 1
    schedulers: int = 1  # kube-scheduler processes; more than one elect a leader (the local control plane only)
    control_plane_paths: Any = None
    node_labels: dict[str, str] = field(default_factory=dict)
    ready_timeout: float = 90.0
    fleet: bool = False  # every node's agent and kubelet stand-in in one process (hundreds of nodes)
    fleet_admit: bool = True  # the fleet admits pods (off: scheduling benchmarks)
    usage: spec.AgentUsage = field(default_factory=spec.AgentUsage)  # simulated usage of the node agents
    controller_manager_extra: list[str] = field(default_factory=list)  # e.g. a short HPA sync period for tests
    monitoring: bool = False  # Prometheus scraping the services, prometheus-adapter serving custom.metrics.k8s.io
    admission_policies: bool = False  # k8s/base's ValidatingAdmissionPolicies on the local control plane (1.30+)
    scrape_interval: float = 5.0
    progress: Progress = _print_progress
    # each service connects as its own PostgreSQL role (migration 0007: least privilege); None: when the stack
    # runs its own PostgreSQL (which trusts local connections, so the roles need no passwords)
    service_roles: bool | None = None
    # how many of the nodes (the last ones) are DRA nodes: their agents run --dra, kube-scheduler places their
    # shares from ResourceClaims and the kubelet stand-in plays kubelet's DRA side (docs/dra.md)
    dra_nodes: int = 0
    # `real`: each node a real kubelet and containerd running real containers (devstack/stack/realnodes.py);
    # `auto`: real when the machine can, else stand-ins, saying why; `stand-in`: kubelet stand-ins (the default here,
    # for the many-node stacks of the tests; `gpushare up` asks for `auto`)
    nodes_kind: str = "stand-in"
    # of the DRA nodes, how many (the last ones) are a gated pool: labelled gpushare.io/dra-gate=ledger, their slices
    # carry the ledger's binding conditions and kube-scheduler binds their pods only once the binder recorded them
    dra_gated_nodes: int = 0
    binder_extra: list[str] = field(default_factory=list)  # more `gpushare binder` flags (e.g. --template-grace)


class Stack:
    """Stores, control plane, services and simulated nodes of one local gpushare installation."""

    def __init__(self, config: StackConfig) -> None:
        self.config = config
        self.data_dir = Path(config.data_dir).resolve()
        self.log_dir = self.data_dir / "logs"
        self._t0 = time.monotonic()
        self.mode = MODE_LOCAL
        self.mode_reason = ""
        self.database_url = config.database_url or ""
        self.nats_url = config.nats_url or ""
        self.kubeconfig: str | None = config.kubeconfig
        # what the services use: on the local control plane a client-certificate user (the people's kubeconfig
        # has a token user), so both ordinary kinds of access run in every local stack
        self.services_kubeconfig: str | None = config.kubeconfig
        self.control_plane: Any = None
        self.node_names = spec.node_names(config.node_prefix, config.nodes)
        self.dra_node_names = self.node_names[len(self.node_names) - config.dra_nodes :] if config.dra_nodes else []
        if config.dra_nodes and config.fleet:
            raise ValueError("DRA nodes run their own node agents: they cannot run in the fleet process")
        self.processes: dict[str, ServiceProcess] = {}
        self.kubelets: dict[str, Any] = {}
        self.real_nodes: dict[str, Any] = {}  # node -> devstack.cluster.realnode.RealNode, with real nodes
        self.nodes_kind = "stand-in"  # what the nodes are: `real` or `stand-in`
        self.nodes_kind_reason = ""  # why stand-ins when real nodes were asked for with `auto`
        self.missing: list[str] = []
        self.extender_url = ""
        self.webhook_url = ""  # gpushare admission (DRA nodes on the local control plane)
        self._webhook_tls: Any = None
        self.binder_url = ""
        self.accounting_url = ""
        self._pg: EmbeddedPostgres | None = None
        self._nats: EmbeddedNats | None = None
        self._api: Any = None
        self._heartbeat: Any = None
        self._socket_dir: Path | None = None
        self._stopped = False
        self.service_proxies: dict[str, Any] = {}  # service -> ServiceProxy, with replicas
        self.prometheus: Any = None
        self.adapter: Any = None
        self.monitoring_error = ""  # why monitoring was asked for and is not there

    def progress(self, msg: str) -> None:
        """One progress line, with the seconds since the stack began starting."""
        self.config.progress(f"[{time.monotonic() - self._t0:5.1f}s] {msg}")

    # ------------------------------------------------------------------ start
    async def start(self) -> Stack:
        """Bring everything up; on any failure, stop what started and re-raise."""
        self._t0 = t0 = time.monotonic()
        try:
            await self._start_stores()
            await self._start_services_and_cluster()
            if self.config.monitoring:
                await self._start_monitoring()
        except BaseException:
            await self.stop()
            raise
        self.progress(f"stack up in {time.monotonic() - t0:.1f}s ({self.mode})")
        return self

    async def _start_stores(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        if not self.database_url:
            self.progress(f"starting embedded PostgreSQL in {self.data_dir / 'postgres'}")
            self._pg = EmbeddedPostgres(self.data_dir / "postgres", cleanup="stop")
            server_url = await asyncio.to_thread(self._pg.start)
            self.database_url = await _ensure_database(server_url, "gpushare")
        if not self.nats_url:
            self.progress(f"starting embedded NATS (JetStream in {self.data_dir / 'nats'})")
            self._nats = EmbeddedNats(self.data_dir / "nats", log_file=self.log_dir / "nats-server.log")
            self.log_dir.mkdir(parents=True, exist_ok=True)
            self.nats_url = await asyncio.to_thread(self._nats.start)
        from shared.ledger import migrate

        self.progress("migrating the ledger schema")
        await asyncio.to_thread(migrate.upgrade, self.database_url)

    @property
    def service_roles(self) -> bool:
        """Whether each service connects as its own role (`StackConfig.service_roles`)."""
        return self.config.service_roles if self.config.service_roles is not None else self._pg is not None

    def service_database_url(self, service: str) -> str:
        """The URL a service connects with: as its role (gpushare_<service>), or the stack's own."""
        if not self.service_roles:
            return self.database_url
        return with_user(self.database_url, f"gpushare_{service}")

    def _common(self, service: str = "") -> spec.CommonFlags:
        c = self.config
        return spec.CommonFlags(
            database_url=self.service_database_url(service) if service else self.database_url,
            nats_url=self.nats_url,
            stream_name=c.stream_name,
            subject_prefix=c.subject_prefix,
            log_format=c.log_format,
            log_level=c.log_level,
            memory_unit=c.memory_unit,
            accounting_url=self.accounting_url or None,
        )

    def replicas(self, service: str) -> list[ServiceProcess]:
        """The running-or-not processes of one service's replicas (`extender`, `binder`, `accounting`)."""
        names = spec.replica_names(service, self.config.replicas)
        return [self.processes[n] for n in names if n in self.processes]

    def _spawn_replicas(
        self, service: str, port: int, make: Callable[[str, int], spec.ServiceCommand]
    ) -> list[ServiceProcess | None]:
        """Start a service's replicas: one on `port`, or (with replicas) each on a free port, behind `port` later."""
        names = spec.replica_names(service, self.config.replicas)
        ports = [port] if len(names) == 1 else [free_port() for _ in names]
        return [self._spawn(make(name, p)) for name, p in zip(names, ports, strict=True)]

    async def _start_service_proxies(self, ports: dict[str, int]) -> None:
        """With replicas: one address in front of each service's replicas (what its Service would be)."""
        if self.config.replicas == 1:
            return
        from devstack.stack.service_proxy import Endpoint, ServiceProxy

        for service, port in ports.items():
            endpoints = [
                Endpoint("127.0.0.1", p.command.port, p.command.ready_url)
                for p in self.replicas(service)
                if p.command.ready_url
            ]
            if endpoints:
                self.service_proxies[service] = await ServiceProxy(service, endpoints, port=port).start()
                self.progress(f"{service}: {len(endpoints)} replicas behind 127.0.0.1:{port}")

    def _spawn(self, command: spec.ServiceCommand) -> ServiceProcess | None:
        subcommand = command.argv[3]
        if command.argv[2] == "services.cli" and subcommand not in available_subcommands():
            self.missing.append(subcommand)
            self.progress(f"WARNING: `gpushare {subcommand}` is not installed here; running without it")
            return None
        proc = ServiceProcess(command, self.log_dir)
        proc.start()
        self.processes[command.name] = proc
        return proc

    async def _start_services_and_cluster(self) -> None:
        c = self.config
        ext_port = port_or_free(c.extender_port)
        acc_port = port_or_free(c.accounting_port)
        self.extender_url = f"http://127.0.0.1:{ext_port}{spec.EXTENDER_PREFIX}"
        self.accounting_url = f"http://127.0.0.1:{acc_port}"
        self.progress("starting extender and accounting" + (f" ({c.replicas} replicas each)" if c.replicas > 1 else ""))
        # bind reads pods from the API server: the local control plane writes its kubeconfig here when it starts
        kubeconfig = self._future_kubeconfig()
        webhook = self._webhook_listen() if kubeconfig and not c.kubeconfig else None
        first = [
            *self._spawn_replicas(
                "extender",
                ext_port,
                lambda name, port: spec.extender_command(
                    self._common("extender"),
                    port,
                    c.bind_timeout,
                    kubeconfig,
                    name=name,
                    # gpushare admission on one replica: kube-apiserver calls the one URL registered for it
                    webhook=webhook if name == spec.replica_names("extender", c.replicas)[0] else None,
                ),
            ),
            *self._spawn_replicas(
                "accounting",
                acc_port,
                lambda name, port: spec.accounting_command(
                    self._common("accounting"), port, c.admin_token, kubeconfig, name=name
                ),
            ),
        ]
        cluster = asyncio.create_task(self._obtain_cluster())
        await asyncio.gather(*(p.wait_ready(c.ready_timeout) for p in first if p))
        await self._start_service_proxies({"extender": ext_port, "accounting": acc_port})
        await cluster
        if self.mode == MODE_SIMULATOR:
            self.webhook_url = ""
            if kubeconfig is not None:  # no API server after all
                for old in self.replicas("extender"):
                    await asyncio.to_thread(self.processes.pop(old.name).stop)
                    restarted = self._spawn(
                        spec.extender_command(self._common("extender"), old.command.port, c.bind_timeout, name=old.name)
                    )
                    if restarted is not None:
                        await restarted.wait_ready(c.ready_timeout)
            await self._record_simulated_inventory()
            return
        await self._create_nodes()
        if c.admission_policies and self.control_plane is not None:
            await self._apply_admission_policies()
        if self.webhook_url and self.replicas("extender"):
            await self._register_webhook()
        bnd_port = port_or_free(c.binder_port)
        self.binder_url = f"http://127.0.0.1:{bnd_port}"
        self.progress("starting binder" + (f" ({c.replicas} replicas electing a leader)" if c.replicas > 1 else ""))
        rest = self._spawn_replicas(
            "binder",
            bnd_port,
            lambda name, port: spec.binder_command(
                self._common("binder"), port, str(self.services_kubeconfig), name=name, extra=tuple(c.binder_extra)
            ),
        )
        if c.replicas > 1:  # the first replica answers on the binder port, as the one binder would
            first_binder = self.replicas("binder")[0].command.ready_url
            self.binder_url = first_binder.rsplit("/", 1)[0] if first_binder else self.binder_url
        self._socket_dir = Path(tempfile.mkdtemp(prefix="gpushare-up-"))
        if c.fleet:
            rest.append(self._spawn(self._fleet_command()))
        else:
            for node in self.node_names:
                rest.append(await self._start_node(node))
        self.progress(f"waiting for binder and {len(self.node_names)} node agent(s)")
        await asyncio.gather(*(p.wait_ready(c.ready_timeout) for p in rest if p))
        if "node-agent" not in self.missing:
            await self._wait_for_inventories(c.ready_timeout)

    def _webhook_listen(self) -> tuple[int, str, str] | None:
        """With DRA nodes: the port, certificate and key the extender serves gpushare admission on."""
        if not self.dra_node_names:
            return None
        from devstack.stack.webhook import make_certificates, webhook_url

        self._webhook_tls = make_certificates(self.data_dir / "admission")
        port = free_port()
        self.webhook_url = webhook_url(port)
        return port, str(self._webhook_tls.cert), str(self._webhook_tls.key)

    async def _register_webhook(self) -> None:
        """The MutatingWebhookConfiguration calling the extender's webhook port (namespaces labelled
        gpushare.io/allocator=dra then have their aliyun.com/* pods rewritten into DRA claims)."""
        from devstack.stack.webhook import register_webhook

        self.progress(
            f"registering gpushare admission at {self.webhook_url} (namespaces labelled gpushare.io/allocator=dra)"
        )
        await register_webhook(await self.api_client(), self.webhook_url, self._webhook_tls)

    async def _wait_for_inventories(self, timeout_s: float) -> None:
        """Until every node's GPUs are in the ledger (the agents record them through the binder's gateway): only
        then can pods be placed, so only then is the stack up."""
        deadline = time.monotonic() + timeout_s
        conn = await asyncpg.connect(self.database_url)
        try:
            while True:
                rows = await conn.fetch("SELECT DISTINCT node FROM gpus WHERE retired_at IS NULL")
                missing = sorted(set(self.node_names) - {r["node"] for r in rows})
                if not missing:
                    return
                if time.monotonic() > deadline:
                    raise TimeoutError(
                        f"no GPU inventory in the ledger after {timeout_s:.0f}s for {', '.join(missing)} "
                        f"(see the node agents' and the binder's logs in {self.log_dir})"
                    )
                await asyncio.sleep(0.2)
        finally:
            await conn.close()

    async def _start_monitoring(self) -> None:
        """Prometheus scraping every service and, on the local control plane, prometheus-adapter registered as
        custom.metrics.k8s.io (with the rules in k8s/hpa/). What cannot be had is said, and the stack goes on."""
        from devstack.cluster.buildtools import ControlPlaneUnavailable
        from devstack.monitoring.adapter import MetricsAdapter, rules_config
        from devstack.monitoring.prometheus import Prometheus

        work = self.data_dir / "monitoring"
        say = lambda m: self.progress(f"monitoring: {m}")  # noqa: E731
        try:
            self.progress("starting Prometheus (Debian's package; installed on first use)")
            prom = Prometheus(work, self.metrics_targets(), scrape_interval_s=self.config.scrape_interval, progress=say)
            self.prometheus = await asyncio.to_thread(prom.start)
            if self.control_plane is None:
                self.monitoring_error = "prometheus-adapter needs the local control plane (its aggregation layer)"
                self.progress(f"WARNING: {self.monitoring_error}")
                return
            self.progress("starting prometheus-adapter (built from its Go module on first use, ~9 min)")
            adapter = MetricsAdapter(work, str(self.kubeconfig), prom.url, rules_config(), progress=say)
            self.adapter = await asyncio.to_thread(adapter.start)
            await adapter.register(await self.api_client())
        except ControlPlaneUnavailable as exc:
            self.monitoring_error = exc.reason.splitlines()[0]
            self.progress(f"WARNING: monitoring unavailable: {exc.reason}")

    def _fleet_command(self) -> spec.ServiceCommand:
        assert self._socket_dir is not None and self.services_kubeconfig is not None
        return spec.fleet_command(
            self._common(),
            nodes=self.node_names,
            gpus=self.config.gpus,
            socket_dir=str(self._socket_dir),
            kubeconfig=self.services_kubeconfig,
            port=free_port(),
            addresses={n: self.node_address(n) for n in self.node_names},
            admit=self.config.fleet_admit,
            usage=self.config.usage,
        )

    def _future_kubeconfig(self) -> str | None:
        """The kubeconfig of the cluster `_obtain_cluster` will use (None: the simulator, no cluster)."""
        if self.config.kubeconfig:
            return self.config.kubeconfig
        from devstack.cluster.controlplane import KUBECONFIG_NAME

        return None if self.config.simulate else str(self.data_dir / "cluster" / KUBECONFIG_NAME)

    async def _obtain_cluster(self) -> None:
        c = self.config
        if c.kubeconfig:
            self.mode = MODE_EXTERNAL
            self.progress(f"using the cluster in KUBECONFIG={c.kubeconfig}")
            self.progress(
                f"note: its kube-scheduler must call the extender at {self.extender_url} "
                "(see k8s/ for the scheduler configuration)"
            )
            return
        if c.simulate:
            self._use_simulator("asked for with --simulate")
            return
        from devstack.cluster import ControlPlane, ControlPlaneUnavailable, ExtenderConfig

        cp = ControlPlane(
            extender=ExtenderConfig(
                url_prefix=self.extender_url,
                http_timeout=f"{max(c.bind_timeout + 5, 30):.0f}s",
            ),
            scheduler_extra=c.scheduler_extra,
            controller_manager_extra=c.controller_manager_extra,
            schedulers=c.schedulers,
            work_dir=self.data_dir / "cluster",
            paths=c.control_plane_paths,
            progress=lambda m: self.progress(f"control plane: {m}"),
        )
        self.progress("starting the local Kubernetes control plane (built once on first use, ~8 min)")
        try:
            await asyncio.to_thread(cp.start)
        except ControlPlaneUnavailable as exc:
            self._use_simulator(f"the local control plane is unavailable: {exc.reason}")
            return
        self.control_plane = cp
        self.kubeconfig = str(cp.kubeconfig_path)
        self.services_kubeconfig = str(cp.cert_kubeconfig_path)

    def _use_simulator(self, reason: str) -> None:
        self.mode = MODE_SIMULATOR
        self.mode_reason = reason
        self.progress(f"{reason}; running the scheduler simulator instead of kube-scheduler")

    async def api_client(self) -> Any:
        """A kubernetes_asyncio ApiClient for the stack's cluster (owned by the stack)."""
        if self._api is None:
            if self.control_plane is not None:
                self._api = self.control_plane.api_client()
            else:
                from shared.kube.client import api_client

                self._api = await api_client(self.kubeconfig)
        return self._api

    async def _create_nodes(self) -> None:
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        from devstack.cluster.nodes import NodeHeartbeat, create_gpu_node, delete_node

        api = await self.api_client()
        unit_mib = 1 if self.config.memory_unit == "MiB" else 1024
        gpus = spec.node_gpus(self.config.gpus, unit_mib)
        base_labels = {"gpushare.io/simulated": "true", **self.config.node_labels}
        if self.dra_node_names:
            await self._ensure_device_class(api)
        if await self._start_real_nodes():
            return
        for node in self.node_names:
            dra = node in self.dra_node_names
            labels = {**base_labels, **self._pool_label(node)}
            kind = "DRA node" if dra else "node"
            self.progress(f"creating simulated {kind} {node} with GPUs {self.config.gpus}")
            make = functools.partial(
                create_gpu_node, api, node, gpus=gpus, labels=labels, pods=str(self.config.max_pods), dra=dra
            )
            try:
                await make()
            except ApiException as exc:
                if exc.status != 409:
                    raise
                await delete_node(api, node)
                await make()
        core = client.CoreV1Api(api)
        for node in self.node_names:
            # an address for `inspect`'s IPADDRESS column (loopback: nothing listens there for the node)
            addresses = [
                {"type": "InternalIP", "address": self.node_address(node)},
                {"type": "Hostname", "address": node},
            ]
            await core.patch_node_status(node, {"status": {"addresses": addresses}})
        self._heartbeat = NodeHeartbeat(api, self.node_names, interval=10.0).start()

    def _pool_label(self, node: str) -> dict[str, str]:
        """DRA nodes carry the DRA pool's label (and the last `dra_gated_nodes` of them the gate's: docs/dra.md);
        the others `gpushare=true`, the label the gpushare guide puts on GPU nodes (and k8s/base's node agent
        selects)."""
        from shared.dra.slices import GATE_LABEL, GATE_VALUE

        if node not in self.dra_node_names:
            return {"gpushare": "true"}
        gated = self.dra_node_names[len(self.dra_node_names) - self.config.dra_gated_nodes :]
        return {"gpushare.io/allocator": "dra", **({GATE_LABEL: GATE_VALUE} if node in gated else {})}

    async def _start_real_nodes(self) -> bool:
        """With `nodes_kind` real (or auto, where the machine can): start every node as a real one; False when
        the nodes are to be stand-ins (auto says why)."""
        from devstack.stack import realnodes

        say = lambda m: self.progress(f"real nodes: {m}")  # noqa: E731
        kind, why = await asyncio.to_thread(
            realnodes.choose_nodes_kind, self.config.nodes_kind, self.control_plane, len(self.node_names), say
        )
        self.nodes_kind, self.nodes_kind_reason = kind, why
        if why:
            self.progress(f"nodes: kubelet stand-ins, not real nodes: {why}")
        if kind != realnodes.REAL:
            return False
        self.progress(f"starting {len(self.node_names)} real node(s): kubelet, containerd and runc each")
        labels = {node: {**self.config.node_labels, **self._pool_label(node)} for node in self.node_names}
        self.real_nodes = await realnodes.start_real_nodes(
            self.control_plane, labels, self.log_dir, say, max_pods=self.config.max_pods
        )
        return True

    async def _apply_admission_policies(self) -> None:
        from devstack.stack.admission import apply_policies, wait_enforced

        api, minor = await self.api_client(), self.control_plane.release.minor
        names = await apply_policies(api, minor)
        if not names:
            self.progress(f"admission policies: none on Kubernetes 1.{minor} (ValidatingAdmissionPolicy is 1.30+)")
            return
        enforced = await wait_enforced(api, "default")
        self.progress(f"admission policies of k8s/base {'enforced' if enforced else 'created'}: {', '.join(names)}")

    async def _ensure_device_class(self, api: Any) -> None:
        """The `gpushare-gpu` DeviceClass DRA claims ask for (kept when it exists)."""
        from kubernetes_asyncio import client
        from kubernetes_asyncio.client.exceptions import ApiException

        from shared.dra.classes import device_class

        try:
            await client.ResourceV1Api(api).create_device_class(device_class(), _preload_content=False)
        except ApiException as exc:
            if exc.status != 409:
                raise

    def node_address(self, node: str) -> str:
        """The loopback address a node reports (InternalIP and the ledger's node address): 127.0.0.1 for a real
        node (kube-apiserver reaches its kubelet there), one of 127.0.x.y for a simulated one."""
        if node in self.real_nodes:
            return "127.0.0.1"
        i = self.node_names.index(node)
        return f"127.0.{1 + i // 250}.{1 + i % 250}"

    async def _start_node(self, node: str) -> ServiceProcess | None:
        """The kubelet stand-in (in this process) first, then the node agent that registers with it."""
        assert self._socket_dir is not None
        base = self._socket_dir / node
        dp_dir = base / "dp"
        dp_dir.mkdir(parents=True, exist_ok=True)
        pr_socket = base / "pod-resources.sock"
        if "node-agent" not in available_subcommands():
            self.missing.append("node-agent")
            self.progress("WARNING: `gpushare node-agent` is not installed here; pods bind but get no devices")
            return None
        extra: list[str] = []
        if node in self.real_nodes:
            from devstack.stack.realnodes import agent_paths

            dp, pr, extra = agent_paths(self.real_nodes[node], node in self.dra_node_names)
            dp_dir, pr_socket = Path(dp), Path(pr)
        elif node in self.dra_node_names:
            dirs = {"registration": base / "plugins_registry", "plugin": base / "plugins", "cdi": base / "cdi"}
            extra = ["--dra", "--dra-registration-dir", str(dirs["registration"])]
            extra += ["--dra-plugin-dir", str(dirs["plugin"]), "--cdi-dir", str(dirs["cdi"])]
            self.kubelets[node] = await self._start_kubelet(node, dp_dir, pr_socket, dra_dirs=dirs)
        else:
            self.kubelets[node] = await self._start_kubelet(node, dp_dir, pr_socket)
        command = spec.node_agent_command(
            self._common(),
            node=node,
            gpus=self.config.gpus,
            device_plugin_dir=str(dp_dir),
            pod_resources_socket=str(pr_socket),
            metrics_port=free_port(),
            kubeconfig=self.services_kubeconfig,
            address=self.node_address(node),
            usage=self.config.usage,
            extra=extra,
        )
        return self._spawn(command)

    async def _start_kubelet(
        self, node: str, dp_dir: Path, pr_socket: Path, *, dra_dirs: dict[str, Path] | None = None
    ) -> Any:
        from devstack.stack.kubelets import NodeKubelet, start_kubelet

        api = await self.api_client()
        if dra_dirs is None:
            return await start_kubelet(api, node, dp_dir, pr_socket)
        from devstack.cluster.kubelet_dra import DraKubeletStandIn

        dra = DraKubeletStandIn(api, dra_dirs["registration"], dra_dirs["cdi"])
        return await NodeKubelet(api, node, dp_dir, pr_socket, dra=dra).start()

    async def _record_simulated_inventory(self) -> None:
        """Without a cluster there are no node agents: put the simulated GPUs in the ledger (and the stream)."""
        from shared.events.bus import BusNames, EventBus
        from shared.events.catalogue import GpuInfo, InventoryEvent
        from shared.ledger.db import make_engine
        from shared.ledger.ledger import Ledger
        from shared.ledger.outbox import OutboxRelay

        unit_mib = 1 if self.config.memory_unit == "MiB" else 1024
        names = BusNames(self.config.stream_name, self.config.subject_prefix)
        bus = await EventBus.connect(self.nats_url, names, name="gpushare-up")
        engine = make_engine(self.database_url, pool_size=2)
        try:
            relay = OutboxRelay(engine, bus)
            ledger = Ledger(engine, prefix=names.prefix, source="gpushare-up")
            for node in self.node_names:
                gpus = [
                    GpuInfo(
                        uuid=f"GPU-{uuid.uuid5(uuid.NAMESPACE_DNS, f'{node}.{i}.gpushare.sim')}",
                        index=i,
                        model=model,
                        memory_mib=mem * unit_mib,
                        memory_total_mib=mem * unit_mib,
                    )
                    for i, (mem, model) in enumerate(spec.node_gpus(self.config.gpus, unit_mib))
                ]
                await ledger.record(InventoryEvent(node=node, gpus=gpus, source="gpushare-up"))
            await asyncio.wait_for(relay.flush(), 10)
            self.progress(f"recorded the simulated GPUs of {len(self.node_names)} node(s) in the ledger")
        finally:
            await bus.close()
            await engine.dispose()

    # ------------------------------------------------------------------ info
    def listens(self) -> list[tuple[str, str]]:
        """Where each piece listens."""
        out = []
        if self.control_plane is not None:
            out.append(("kube-apiserver", self.control_plane.server_url))
        elif self.kubeconfig:
            out.append(("cluster", f"KUBECONFIG={self.kubeconfig}"))
        out += [(name, proc.command.listens) for name, proc in self.processes.items()]
        out += [(f"{name} (service)", f"http://{proxy.address}") for name, proxy in self.service_proxies.items()]
        out += [(f"kubelet-{name}", node.listens) for name, node in self.real_nodes.items()]
        if self.webhook_url:
            out.append(("admission", f"{self.webhook_url} (namespaces labelled gpushare.io/allocator=dra)"))
        if self.prometheus is not None:
            out.append(("prometheus", self.prometheus.url))
        if self.adapter is not None:
            out.append(("metrics-adapter", f"https://127.0.0.1:{self.adapter.port} (custom and external metrics)"))
        out.append(("postgres", _redact(self.database_url)))
        out.append(("nats", self.nats_url))
        out.append(("logs", str(self.log_dir)))
        return out

    def metrics_targets(self) -> dict[str, str]:
        """Service name -> `host:port` of its Prometheus /metrics (extender, binder, accounting, node agents)."""
        return {name: t for name, proc in self.processes.items() if (t := proc.command.metrics_target)}

    def check_alive(self) -> list[str]:
        """Names of service processes that have exited."""
        return [name for name, proc in self.processes.items() if not proc.alive()]

    # ------------------------------------------------------------------ stop
    async def stop(self) -> None:
        """Stop everything in reverse order; safe to call twice."""
        if self._stopped:
            return
        self._stopped = True
        if self._heartbeat is not None:
            try:
                await self._heartbeat.stop()
            except Exception as exc:  # e.g. the apiserver went away: the rest must still stop
                self.progress(f"node heartbeat ended with an error: {exc!r}")
        for server in (self.adapter, self.prometheus):
            if server is not None:
                await asyncio.to_thread(server.stop)
        procs = list(self.processes.values())
        # node agents first (kubelet outlives its device plugins), then the kubelet stand-ins, then the binder,
        # then extender and accounting
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs if p.name.startswith("node-agent")))
        for node, kubelet in list(self.kubelets.items()):
            with contextlib.suppress(Exception):
                await kubelet.stop()
            self.kubelets.pop(node, None)
        if self.real_nodes:
            from devstack.stack.realnodes import stop_real_nodes

            await stop_real_nodes(self.real_nodes)
            self.real_nodes = {}
        binders = self.replicas("binder")
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in binders))
        await asyncio.gather(*(asyncio.to_thread(p.stop) for p in procs))
        for proxy in self.service_proxies.values():
            await proxy.stop()
        if self._api is not None:
            with contextlib.suppress(Exception):
                await self._api.close()
        if self.control_plane is not None:
            await asyncio.to_thread(self.control_plane.stop)
        if self._nats is not None:
            await asyncio.to_thread(self._nats.stop)
        if self._pg is not None:
            await asyncio.to_thread(self._pg.stop)
        if self._socket_dir is not None:
            shutil.rmtree(self._socket_dir, ignore_errors=True)


SERVICE_PACKAGES = {
    "extender": "services.extender",
    "binder": "services.binder",
    "accounting": "services.accounting",
    "node-agent": "services.node_agent",
    "migrate": "shared.ledger.migrate",
}
"""The package behind each `gpushare` subcommand the stack runs."""


@functools.cache
def available_subcommands() -> frozenset[str]:
    """The `gpushare` subcommands this installation has (probed without importing the CLI)."""
    return frozenset(name for name, package in SERVICE_PACKAGES.items() if _installed(package))


def _installed(package: str) -> bool:
    try:
        return importlib.util.find_spec(package) is not None
    except ModuleNotFoundError:
        return False


def _redact(url: str) -> str:
    """A URL without its password."""
    if "@" in url and "://" in url:
        scheme, rest = url.split("://", 1)
        creds, host = rest.rsplit("@", 1)
        user = creds.split(":", 1)[0]
        return f"{scheme}://{user}@{host}"
    return url


async def _ensure_database(server_url: str, name: str) -> str:
    """Create database `name` on the server unless it exists; returns its URL."""
    conn = await asyncpg.connect(server_url)
    try:
        exists = await conn.fetchval("SELECT 1 FROM pg_database WHERE datname = $1", name)
        if not exists:
            await conn.execute(f'CREATE DATABASE "{name}"')
    finally:
        await conn.close()
    return with_database(server_url, name)
