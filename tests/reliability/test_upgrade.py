"""Upgrades keep scheduling: from the previous release to this one, during a burst of GPU pods through the real
kube-scheduler (v1.37.2), with real PostgreSQL and NATS.

The previous release's code comes from git (tests/reliability/releases.py: its commit's tree, run with this
interpreter). The scenario runs once for the module, on the `gpushare up` stack (2 nodes x 2 Tesla-T4 16 GiB,
kubelet stand-ins), while pods are created (and bound ones deleted, to keep room) all along:

1. The previous release everywhere: its own migration made the schema; two extender replicas behind a Service
   address (kube-scheduler's extender URL; `service_proxy.py` balances connections as kube-proxy does), two
   binder replicas, accounting, a node agent per node.
2. A new extender replica starts before the migration, as `kubectl apply -k` starts new pods beside the
   migration Job: it waits, not ready, saying to run `gpushare migrate`, and gets no traffic.
3. This release's `gpushare migrate` runs (the chart's pre-upgrade hook): the previous release's services keep
   scheduling on the new schema, and an extender and a binder of the previous release restarted now start on
   it; the pods created meanwhile are bound by them alone.
4. The Deployments roll (maxSurge 1, maxUnavailable 0): old and new extender replicas side by side, then old
   and new binders, each old replica leaving once its replacement is ready; then accounting, then the node
   agents one node at a time (the DaemonSet), with no pod arriving meanwhile: kubelet rejects a pod bound to a
   node whose device plugin is restarting (docs/operations.md, "Upgrades"), whatever the release.
5. Once quiet: every pod bound, each with exactly one live allocation on its node, no GPU overcommitted, every
   deleted pod's allocation released, every container's environment its allocation's (`check_invariants`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import random
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
import pytest
from kubernetes_asyncio import client

from devstack.cluster import Paths
from devstack.embedded import free_port, with_database
from devstack.stack.processes import ServiceProcess
from devstack.stack.spec import ServiceCommand
from devstack.stack.stack import MODE_LOCAL, Stack, StackConfig
from shared.ledger.db import make_engine
from shared.ledger.replay import wait_for_quiet
from tests import system_tools
from tests.e2e import helpers as h
from tests.reliability.harness import InvariantReport, check_invariants, run_gpushare
from tests.reliability.releases import Release, current, extract, previous_release_commit
from tests.reliability.service_proxy import ServiceProxy
from tests.reliability.test_crash import _record

pytestmark = pytest.mark.e2e

log = logging.getLogger("reliability.upgrade")
REPLICAS = 2
ROOM_GIB = 36  # bound pods are deleted above this much GPU memory (the cluster has 64 GiB): churn, never full
POD_EVERY_S = 0.4
SETTLE_S = 120.0


@dataclass
class Replica:
    """One replica of a rolling Deployment: its process, port and release."""

    proc: ServiceProcess
    port: int
    release: str


class RollingStack(Stack):
    """The `gpushare up` stack started with the previous release's code everywhere (its migration too), whose
    extender and binder run as replica sets that roll to this release's code."""

    def __init__(self, config: StackConfig, previous: Release) -> None:
        super().__init__(config)
        self.previous = previous
        self.proxy = ServiceProxy(seed=7)
        self.templates: dict[str, ServiceCommand] = {}
        self.rolling: dict[str, list[Replica]] = {"extender": [], "binder": []}
        self._numbers = itertools.count()

    async def _start_stores(self) -> None:
        self.data_dir.mkdir(parents=True, exist_ok=True)
        done = await asyncio.to_thread(self.previous.run, "migrate", "--database-url", self.database_url)
        assert done.returncode == 0, f"the previous release's migration failed:\n{done.stderr[-3000:]}"

    def _spawn(self, command: ServiceCommand) -> Any:
        if command.name in self.rolling:
            self.templates[command.name] = command
            return _ReplicaSetStart(self, command.name)
        return super()._spawn(self.previous.command(command))

    def start_replica(self, name: str, release: Release | None) -> Replica:
        """A new replica of `name` on a port of its own, of the previous release or (None) this one."""
        template = self.templates[name]
        port = free_port()
        argv = list(template.argv)
        old_port = argv[argv.index("--port") + 1]
        argv[argv.index("--port") + 1] = str(port)
        label = release.version if release else "new"
        command = ServiceCommand(
            f"{name}-{label}-{next(self._numbers)}",
            argv,
            template.ready_url.replace(f":{old_port}/", f":{port}/") if template.ready_url else None,
            template.listens.replace(f":{old_port}", f":{port}"),
            template.env,
        )
        command = release.command(command) if release else current(command)
        proc = ServiceProcess(command, self.log_dir)
        proc.start()
        self.processes[command.name] = proc
        replica = Replica(proc, port, label)
        self.rolling[name].append(replica)
        return replica

    async def roll_node_agent(self, node: str) -> None:
        """The node's agent replaced by this release's, once its kubelet stand-in has seen it register again."""
        standin = self.kubelets[node].standin
        before = dict(standin.registrations)
        await self.replace(f"node-agent-{node}", None)
        for resource, count in before.items():
            await standin.wait_registered([resource], timeout_s=60, min_count=count + 1)

    async def retire(self, name: str, replica: Replica) -> None:
        """Take a replica out of service (no new connections) and stop it (SIGTERM, as a terminating pod)."""
        if name == "extender":
            self.proxy.remove(replica.port)
        await asyncio.to_thread(replica.proc.stop)
        self.rolling[name].remove(replica)
        self.processes.pop(replica.proc.name, None)

    async def ready(self, name: str, replica: Replica) -> None:
        """Wait until the replica is ready, then give it traffic (the extender: the Service's endpoints)."""
        await replica.proc.wait_ready(self.config.ready_timeout)
        if name == "extender":
            self.proxy.add(replica.port)

    async def replace(self, process_name: str, release: Release | None) -> ServiceProcess:
        """Stop a single process (accounting, a node agent) and start it again from `release` (None: this one)."""
        old = self.processes[process_name]
        await asyncio.to_thread(old.stop)
        command = release.command(old.command) if release else current(old.command)
        proc = ServiceProcess(command, self.log_dir)
        proc.start()
        self.processes[process_name] = proc
        await proc.wait_ready(self.config.ready_timeout)
        return proc

    async def stop(self) -> None:
        await super().stop()
        await self.proxy.stop()


class _ReplicaSetStart:
    """What the stack waits on for a replicated service: its first replicas of the previous release."""

    def __init__(self, stack: RollingStack, name: str) -> None:
        self.stack, self.name = stack, name

    async def wait_ready(self, timeout_s: float) -> None:
        if self.name == "extender":
            template = self.stack.templates["extender"]
            self.stack.proxy.port = int(template.argv[template.argv.index("--port") + 1])
            await self.stack.proxy.start()
        replicas = [self.stack.start_replica(self.name, self.stack.previous) for _ in range(REPLICAS)]
        await asyncio.gather(*(self.stack.ready(self.name, r) for r in replicas))


@dataclass
class Burst:
    """Pods created all along, bound ones deleted above `ROOM_GIB`; which phase created each."""

    api: Any
    namespace: str
    rng: random.Random = field(default_factory=lambda: random.Random(35))
    phase: str = "previous release"
    created: dict[str, str] = field(default_factory=dict)  # pod -> phase
    sizes: dict[str, int] = field(default_factory=dict)
    deleted: list[str] = field(default_factory=list)
    stop: asyncio.Event = field(default_factory=asyncio.Event)
    running: asyncio.Event = field(default_factory=asyncio.Event)  # cleared: no new pods for now

    async def run(self) -> None:
        core = client.CoreV1Api(self.api)
        self.running.set()
        for i in itertools.count():
            await self.running.wait()
            if self.stop.is_set():
                return
            pods = (await core.list_namespaced_pod(self.namespace)).items
            bound = [p for p in pods if p.spec.node_name and p.metadata.deletion_timestamp is None]
            held = sum(self.sizes[p.metadata.name] for p in bound)
            if held > ROOM_GIB:
                victim = self.rng.choice(bound).metadata.name
                await h.delete_pod(self.api, self.namespace, victim)
                self.deleted.append(victim)
            name = f"up-{i}"
            size = self.rng.choice([1, 1, 2])  # a 2 GiB pod finds no GPU only with 60 of 64 GiB held
            await h.create_pod(self.api, self.namespace, h.gpu_pod(name, [size]))
            self.created[name], self.sizes[name] = self.phase, size
            await asyncio.sleep(POD_EVERY_S)

    async def unbound(self, phase: str | None = None) -> list[str]:
        """Pods (of `phase`, or any) that exist and are not bound."""
        pods = (await client.CoreV1Api(self.api).list_namespaced_pod(self.namespace)).items
        return [
            p.metadata.name
            for p in pods
            if not p.spec.node_name and (phase is None or self.created.get(p.metadata.name) == phase)
        ]


@dataclass
class Outcome:
    """What the scenario saw, for the tests below."""

    previous: Release
    early_readyz: dict[str, Any]
    restarted_on_new_schema: list[str]
    bound_by_previous_on_new_schema: int
    pods: dict[str, str]
    deleted: int
    unbound: list[str]
    report: InvariantReport
    dead: list[str]
    logs: dict[str, str]
    seconds: float


async def _readyz(port: int) -> dict[str, Any]:
    async with httpx.AsyncClient(timeout=5) as http:
        answer = await http.get(f"http://127.0.0.1:{port}/readyz")
        return {**answer.json(), "code": answer.status_code}


async def _eventually(check: Any, what: str, within: float) -> None:
    deadline = time.monotonic() + within
    while not await check():
        if time.monotonic() > deadline:
            raise TimeoutError(f"timed out after {within:.0f}s waiting for {what}")
        await asyncio.sleep(0.5)


@pytest.fixture(scope="module")
def previous(tmp_path_factory: pytest.TempPathFactory) -> Release:
    """The previous release's tree, ready to run."""
    found = previous_release_commit()
    if found is None:
        system_tools.unavailable("no previous release in this checkout's git history (a shallow clone?)")
        raise AssertionError("unreachable")
    version, commit = found
    return extract(version, commit, tmp_path_factory.mktemp("previous-release"))


@pytest.fixture(scope="module")
async def upgrade(
    previous: Release, control_plane_binaries: Paths, pg_server_url: str, nats_url: str, tmp_path_factory: Any
) -> AsyncIterator[Outcome]:
    """The whole scenario, once."""
    tag = uuid.uuid4().hex[:8]
    db = f"gpushare_upgrade_{tag}"
    admin = await asyncpg.connect(pg_server_url)
    await admin.execute(f'CREATE DATABASE "{db}"')
    stack = RollingStack(
        StackConfig(
            data_dir=tmp_path_factory.mktemp("upgrade-stack"),
            nodes=2,
            gpus="2x16GiB:Tesla-T4",
            node_prefix=f"up-{tag[:4]}",
            extender_port=0,
            binder_port=0,
            accounting_port=0,
            bind_timeout=15.0,
            database_url=with_database(pg_server_url, db),
            nats_url=nats_url,
            stream_name=f"GPUSHARE_U{tag}",
            subject_prefix=f"gsu{tag}",
            log_format="text",
            scheduler_extra={"podInitialBackoffSeconds": 1, "podMaxBackoffSeconds": 2},
            control_plane_paths=control_plane_binaries,
            progress=lambda m: log.info(m),
            service_roles=True,
        ),
        previous,
    )
    burst_task: asyncio.Task[None] | None = None
    try:
        await stack.start()
        if stack.mode != MODE_LOCAL:
            system_tools.unavailable(f"the stack did not get the local control plane: {stack.mode_reason}")
        started = time.monotonic()
        api = await stack.api_client()
        namespace = f"upgrade-{tag[:5]}"
        await h.create_namespace(api, namespace)
        burst = Burst(api, namespace)
        burst_task = asyncio.create_task(burst.run())
        await asyncio.sleep(4)

        # 2. a new extender replica before the migration: waits, says why, gets no traffic
        burst.phase = "new pod before the migration"
        early = stack.start_replica("extender", None)
        await _eventually(
            lambda: _has_reason(early.port, "gpushare migrate"), "the early new extender to say why it waits", 90
        )
        early_readyz = await _readyz(early.port)

        # 3. this release's migration, while the previous release schedules; one of each restarted on it
        burst.phase = "previous release on the new schema"
        migrated = await asyncio.to_thread(run_gpushare, "migrate", "--database-url", stack.database_url)
        assert migrated.returncode == 0, migrated.stderr[-3000:]
        restarted = []
        for name in ("extender", "binder"):
            oldest = next(r for r in stack.rolling[name] if r.release == previous.version)
            again = stack.start_replica(name, previous)
            await stack.ready(name, again)
            await stack.retire(name, oldest)
            restarted.append(again.proc.name)
        await asyncio.sleep(4)
        await _eventually(
            lambda: _none(burst.unbound("previous release on the new schema")),
            "the previous release to bind the pods created after the migration",
            90,
        )
        on_new_schema = sum(1 for p in burst.created.values() if p == "previous release on the new schema")

        # 4. the rollout: extenders (the early one first, now ready), binders, accounting, node agents
        burst.phase = "rolling upgrade"
        await stack.ready("extender", early)
        for name in ("extender", "binder"):
            for old in [r for r in stack.rolling[name] if r.release == previous.version]:
                if sum(1 for r in stack.rolling[name] if r.release == "new") < REPLICAS:
                    await stack.ready(name, stack.start_replica(name, None))
                await stack.retire(name, old)
                await asyncio.sleep(1)
        await stack.replace("accounting", None)
        # The node agents roll with no pod arriving: kubelet marks a resource's devices unhealthy while its last
        # device plugin is away (pkg/kubelet/cm/devicemanager/manager.go, markResourceUnhealthy) and rejects a
        # pod bound there meanwhile; kube-scheduler does not see it (the extender manages aliyun.com/gpu-*).
        burst.running.clear()
        await _eventually(lambda: _admitted(stack, burst), "the pods so far to be bound and admitted", 90)
        for node in stack.node_names:
            await stack.roll_node_agent(node)
        burst.phase = "this release"
        burst.running.set()
        await asyncio.sleep(4)
        burst.stop.set()
        burst.running.set()
        await burst_task
        burst_task = None

        # 5. quiet: every pod bound once, nothing overcommitted
        engine = make_engine(stack.database_url, pool_size=2)
        try:
            deadline = time.monotonic() + SETTLE_S
            while True:
                unbound = await burst.unbound()
                report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
                if (report.settled and not unbound) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(2)
            await wait_for_quiet(engine, timeout_s=60)
            report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
        finally:
            await engine.dispose()
        dead = stack.check_alive()
        logs = {p.stem: p.read_text(errors="replace") for p in stack.log_dir.glob("*.log")}
        yield Outcome(
            previous=previous,
            early_readyz=early_readyz,
            restarted_on_new_schema=restarted,
            bound_by_previous_on_new_schema=on_new_schema,
            pods=dict(burst.created),
            deleted=len(burst.deleted),
            unbound=unbound,
            report=report,
            dead=dead,
            logs=logs,
            seconds=round(time.monotonic() - started, 1),
        )
    finally:
        if burst_task is not None:
            burst_task.cancel()
        await stack.stop()
        await admin.execute(f'DROP DATABASE IF EXISTS "{db}" WITH (FORCE)')
        await admin.close()


async def _has_reason(port: int, words: str) -> bool:
    try:
        answer = await _readyz(port)
    except (httpx.HTTPError, ValueError):
        return False
    return answer["code"] == 503 and words in answer.get("reason", "")


async def _admitted(stack: RollingStack, burst: Burst) -> bool:
    """Every pod so far bound, and admitted by its node's kubelet stand-in."""
    pods = (await client.CoreV1Api(burst.api).list_namespaced_pod(burst.namespace)).items
    return all(
        p.spec.node_name and (burst.namespace, p.metadata.name) in stack.kubelets[p.spec.node_name].envs for p in pods
    )


async def _none(pods: Any) -> bool:
    return not await pods


def test_a_new_service_waits_for_the_migration_and_says_so(upgrade: Outcome) -> None:
    readyz = upgrade.early_readyz
    assert readyz["code"] == 503 and readyz["status"] == "not ready", readyz
    assert "waiting for the ledger schema" in readyz["reason"] and "`gpushare migrate`" in readyz["reason"]


def test_the_previous_release_runs_and_starts_on_the_new_schema(upgrade: Outcome) -> None:
    assert upgrade.bound_by_previous_on_new_schema > 0, "no pod arrived while only the previous release ran"
    for name in upgrade.restarted_on_new_schema:
        text = upgrade.logs[name]
        assert upgrade.previous.version in name and "Traceback" not in text, text[-3000:]


def test_a_rolling_upgrade_during_a_burst_binds_every_pod_once_and_overcommits_nothing(upgrade: Outcome) -> None:
    report = upgrade.report
    assert not upgrade.dead, f"service processes died: {upgrade.dead}"
    assert not upgrade.unbound, f"pods never bound: {upgrade.unbound}"
    assert not report.problems, "invariants broken after the upgrade:\n" + "\n".join(report.problems[:20])
    phases = set(upgrade.pods.values())
    assert {"previous release", "previous release on the new schema", "rolling upgrade"} <= phases, phases
    assert report.bound_pods == len(upgrade.pods) - upgrade.deleted
    assert report.envs_checked == report.bound_pods, "every bound pod's containers got their GPUs"
    for name, text in upgrade.logs.items():
        assert "Traceback" not in text, f"{name}:\n{text[-3000:]}"
    by_phase = {phase: list(upgrade.pods.values()).count(phase) for phase in dict.fromkeys(upgrade.pods.values())}
    _record(
        "rolling-upgrade",
        previous=upgrade.previous.version,
        pods_by_phase=by_phase,
        pods_deleted=upgrade.deleted,
        seconds=upgrade.seconds,
        **report.figures(),
    )
