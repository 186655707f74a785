"""Two `gpushare binder` processes (issue 32): both bind from the shared consumer, only the Lease's holder runs
the pod and node watches, reconciliation and node nudges, and when the holder is killed with SIGKILL the other
takes the lease over and those duties with it; nothing is bound twice.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from sqlalchemy import func, select

from devstack.cluster.controlplane import free_ports
from services.binder.nudge import LABEL as CAPACITY_FREED
from services.binder.service import Binder, BinderConfig
from shared.kube.client import skip_environment_lookups
from shared.kube.leases import ElectionConfig, ElectionTiming
from shared.ledger.models import allocations
from tests.binder.conftest import request_for, state_becomes
from tests.reliability.throttle_proxy import Pressure, ThrottleProxy
from tests.waiting import eventually, stream_events

pytestmark = pytest.mark.e2e

PODS = 12
LEASE = ["--lease-duration", "6", "--renew-deadline", "5", "--retry-period", "0.5"]  # short, with room for load


class Replica:
    """One binder subprocess with its port and log."""

    def __init__(self, name: str, env: dict[str, str], tmp_path: Path, lease: str) -> None:
        self.name = name
        self.env = env
        self.port = free_ports(1)[0]
        self.log = tmp_path / f"{name}.log"
        self.lease = lease
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> Replica:
        cmd = [sys.executable, "-m", "services.cli", "binder", "--port", str(self.port), "--concurrency", "2"]
        # one reconciliation each term begins with is all this test needs: a periodic pass could release a deleted
        # pod before the leader's pod watch does, and the watch's release (its count, its nudge) would find nothing
        cmd += ["--reserve-grace", "2", "--reconcile-interval", "30", "--lease-identity", self.name]
        cmd += ["--lease-name", self.lease, "--lease-namespace", "default", *LEASE]
        with self.log.open("ab") as fh:
            self.proc = subprocess.Popen(
                cmd, env=self.env, stdout=fh, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2]
            )
        return self

    async def get(self, path: str) -> httpx.Response:
        async with httpx.AsyncClient() as http:
            return await http.get(f"http://127.0.0.1:{self.port}{path}", timeout=3)

    async def health(self) -> dict:  # type: ignore[type-arg]
        try:
            return (await self.get("/healthz")).json()
        except (httpx.HTTPError, ValueError):
            return {}

    async def ready(self) -> bool:
        try:
            return (await self.get("/readyz")).status_code == 200
        except httpx.HTTPError:
            return False

    async def metric(self, name: str, **labels: str) -> float:
        text = (await self.get("/metrics")).text
        want = name + ("{" + ",".join(f'{k}="{v}"' for k, v in labels.items()) + "}" if labels else "")
        for line in text.splitlines():
            if line.startswith(want + " "):
                return float(line.split()[-1])
        return 0.0

    def kill9(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> int | None:
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.proc.wait(20)
        if self.proc.poll() is None:
            self.kill9()
        return self.proc.returncode


async def test_only_the_lease_holder_watches_and_reconciles_and_the_other_takes_over_after_a_kill(
    cluster, ledger, engine, bus, binder_env, tmp_path
) -> None:  # type: ignore[no-untyped-def]
    node = await cluster.node(ledger)
    lease = f"binder-{node.name}"
    replicas = [Replica(n, binder_env, tmp_path, lease).start() for n in ("r1", "r2")]
    logs = lambda: "\n".join(f"--- {r.name}\n{r.log.read_text()[-2500:]}" for r in replicas)  # noqa: E731
    try:
        for r in replicas:
            await eventually(r.ready, what=f"{r.name} ready", within=60)
        # each is ready once its first election round has ended (the leader also once its watches listed)
        roles = await eventually(lambda: _roles(replicas), what="one leader and one standby", within=30)
        leader = next(r for r in replicas if roles[r.name] == "leader")
        standby = next(r for r in replicas if r is not leader)
        await eventually(leader.ready, what=f"{leader.name} ready as the leader", within=60)
        # the standby names the holder once it has read the lease the leader created (its next retry period: when it
        # first looked, under load, the lease may not have existed yet)
        health = await eventually(
            lambda: _names_holder(standby, leader.name), what=f"{standby.name} to name the holder", within=20
        )
        assert health["lease"] == f"default/{lease}", health

        # both bind from the shared consumer, each reservation once
        pods = [await cluster.pod(gib=1) for _ in range(PODS)]
        reservations = [await ledger.reserve(request_for(p, node, gib=1, gpu=i % 2)) for i, p in enumerate(pods)]
        for res in reservations:
            await state_becomes(engine, res, "bound", within=60)
        # the cluster-wide duties ran on the leader only: reconciliation, and the release (and the node nudge) of a
        # deleted pod, which only the leader's pod watch saw
        gone = pods[0]
        await cluster.delete_pod(gone.metadata.name, grace=0)
        await state_becomes(engine, reservations[0], "released", within=30)
        await eventually(lambda: _labelled(cluster, node.name), what=f"{CAPACITY_FREED} stamped on the node", within=20)
        assert await leader.metric("gpushare_binder_reconciliations_total") > 0
        assert await standby.metric("gpushare_binder_reconciliations_total") == 0, logs()
        assert await standby.metric("gpushare_binder_released_total", reason="pod_deleted") == 0
        assert await leader.metric("gpushare_binder_released_total", reason="pod_deleted") == 1
        assert await standby.metric("gpushare_binder_leader") == 0 and await leader.metric("gpushare_binder_leader")

        # the leader dies without a word: the standby takes the lease over (a failover) and the duties with it
        leader.kill9()
        await eventually(
            lambda: _role(standby, "leader"), what="the standby to take the lease over", within=30, interval=0.1
        )
        assert await standby.metric("gpushare_binder_leader_changes_total", change="took_over") == 1
        await eventually(standby.ready, what="the new leader ready (watches listed, reconciled)", within=30)
        late = [await cluster.pod(gib=1) for _ in range(3)]
        late_reservations = [await ledger.reserve(request_for(p, node, gib=1)) for p in late]
        for res in late_reservations:
            await state_becomes(engine, res, "bound", within=60)
        await cluster.delete_pod(pods[1].metadata.name, grace=0)
        await state_becomes(engine, reservations[1], "released", within=30)
        assert await standby.metric("gpushare_binder_reconciliations_total") > 0

        # the dead one comes back as a standby
        leader.start()
        await eventually(leader.ready, what="the restarted replica ready", within=60)
        assert (await leader.health())["role"] == "standby"
    finally:
        codes = [r.stop() for r in replicas]
    assert codes[replicas.index(standby)] == 0, logs()

    bound_ids = [e.allocation_id for e in await stream_events(bus, "bound")]
    assert len(bound_ids) == len(set(bound_ids)), "an allocation was marked bound twice"
    assert {r.allocation_id for r in [*reservations, *late_reservations]} <= set(bound_ids)
    async with engine.connect() as conn:
        left = (await conn.execute(select(func.count()).where(allocations.c.state == "reserved"))).scalar()
    assert left == 0


async def test_a_replica_is_ready_only_once_its_first_election_round_has_ended(control_plane, ledger, bus) -> None:  # type: ignore[no-untyped-def]
    """A replica starts as a standby; until its first round of the election has read the Lease it does not know
    whether it leads, so it must not say ready yet. (tests/reliability/test_slow_apiserver.py restarts the binder
    and counts its requests when /readyz first says 200: under CI load that was once 0, the binder ready as a
    standby before its first round.) Every request to the API server waits 2 s here, so the consumers are ready
    long before the round ends; the free Lease makes this replica the leader, and it is ready only as that."""
    certs = control_plane.work_dir / "certs"
    proxy = ThrottleProxy(control_plane.server_url, certs / "apiserver.crt", certs / "apiserver.key")
    await proxy.start()
    proxy.pressure = Pressure(delay_s=(2.0, 2.0), reject_fraction=0.0)
    conf = control_plane.client_configuration()
    conf.host = proxy.url
    api = ApiClient(configuration=conf)
    skip_environment_lookups(api)
    election = ElectionConfig(
        name=f"ready-{uuid.uuid4().hex[:6]}",
        namespace="default",
        identity="only",
        timing=ElectionTiming(lease_duration_s=15, renew_deadline_s=10, retry_period_s=1),
    )
    binder = Binder(ledger, bus, api, BinderConfig(concurrency=2, reconcile_interval_s=3600, election=election))
    stop = asyncio.Event()
    task = asyncio.create_task(binder.run(stop))
    consumers_ready_while_undecided = False
    try:
        deadline = time.monotonic() + 90
        while not binder.ready():
            assert not task.done(), f"the binder stopped: {task.exception() if not task.cancelled() else 'cancelled'}"
            assert time.monotonic() < deadline, f"never ready: {binder.describe()}"
            assert binder.elector is not None
            if not binder.elector.decided and binder.consumer.ready.is_set() and binder.gateway.ready.is_set():
                consumers_ready_while_undecided = True
            await asyncio.sleep(0.02)
        assert binder.elector is not None and binder.elector.decided
        assert binder.role == "leader", f"ready as {binder.describe()} before the election told it its role"
        assert binder.lifecycle.pods_synced.is_set() and binder.claims.synced.is_set()
        assert proxy.counts["requests"] - proxy.in_flight > 0, proxy.counts
        # the case the test is for did arise: the shared duties were up while the round was still going on
        assert consumers_ready_while_undecided, "the consumers were never ready before the first round ended"
    finally:
        stop.set()
        with contextlib.suppress(asyncio.TimeoutError, asyncio.CancelledError, Exception):
            await asyncio.wait_for(task, 30)
        await api.close()
        await proxy.stop()


async def _roles(replicas: list[Replica]) -> dict[str, str] | None:
    roles = {r.name: str((await r.health()).get("role")) for r in replicas}
    return roles if sorted(roles.values()) == ["leader", "standby"] else None


async def _names_holder(replica: Replica, holder: str) -> dict | None:  # type: ignore[type-arg]
    health = await replica.health()
    return health if health.get("holder") == holder else None


async def _role(replica: Replica, role: str) -> bool:
    return (await replica.health()).get("role") == role


async def _labelled(cluster, node: str) -> bool:  # type: ignore[no-untyped-def]
    got = await client.CoreV1Api(cluster.api).read_node(node)
    return CAPACITY_FREED in (got.metadata.labels or {})
