"""Server failover during a burst of GPU pods through the real kube-scheduler: PostgreSQL and NATS.

The `gpushare up` stack (real kube-apiserver, kube-scheduler v1.37.2 with the extender wired, extender, binder,
accounting, node agents with kubelet stand-ins) runs on replicated servers (`devstack.ha`): a PostgreSQL primary
with a synchronous standby, reached through a multi-host URL with `target_session_attrs=read-write`, and a
three-server NATS cluster given to every client as one comma-separated URL, its streams at
`GPUSHARE_STREAM_REPLICAS=3`. One fault at a time, mid-burst:

* `postgres-failover`: kill -9 of the primary (postmaster and every backend), then `pg_promote()` on the
  standby, as an HA operator does once it has seen the primary gone (its detection time comes on top);
* `nats-leader-kill`: kill -9 of the server leading the ledger stream;
* `nats-freeze-30s`: the server holding most client connections frozen (SIGSTOP) for 30 s, then resumed: its
  TCP connections stay open and answer nothing, as with a hung machine or a network partition.

After each: every pod bound exactly once (no pod lost, no pod with two bound allocations), no GPU
overcommitted, every bound pod's container environment and `gpushare.io/allocation` annotation equal to its
live allocation, accounting caught up and equal to the ledger, and the ledger equal to a replay of the stream
(`gpushare ledger rebuild`). Measured: the seconds from the fault to the first bind of a pod created after it.
The servers are made whole again (the old primary rebuilt as the new one's standby, the NATS server restarted
or resumed and caught up) before the next fault.

Each fault runs once here (one stack for the module); `GPUSHARE_SOAK=1` runs each three times for the
median and worst in docs/reliability.md ("Failover: PostgreSQL and NATS servers").
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import shutil
import statistics
import tempfile
import time
import urllib.request
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import asyncpg
import httpx
import pytest

from devstack.ha import NatsCluster, PostgresPair
from shared.annotations import ALLOCATION, parse_allocation
from shared.ledger.db import make_engine
from shared.ledger.replay import load_state, wait_for_quiet
from shared.ledger.rules import is_live
from tests.reliability.harness import burst_stack_config, ledger_rebuild, require_complete, settled_invariants
from tests.reliability.profile import PROFILE
from tests.reliability.test_crash import RESULTS, accounting_caught_up
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

log = logging.getLogger("reliability.failover")
RUNS = 3 if PROFILE.soak else 1
BEFORE_FAULT = 4  # pods created before the fault
AFTER_FAULT_S = 16.0  # ... and one a second for this long after it
BIND_WAIT_S = 120.0
FREEZE_S = 30.0
TARGETS_S = {"postgres-failover": 30.0, "nats-leader-kill": 15.0, "nats-freeze-30s": 15.0}


@dataclass
class Servers:
    """The replicated servers under the stack."""

    pg: PostgresPair
    nats: NatsCluster
    database_url: str


@dataclass
class Outcome:
    """What one fault did (one row of the failover table, before aggregation)."""

    fault: str
    run: int
    recovery_s: float | None = None
    pods: int = 0
    lost: list[str] = field(default_factory=list)
    double_binds: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)


@pytest.fixture(scope="module")
async def servers() -> AsyncIterator[Servers]:
    """A PostgreSQL primary with a synchronous standby and a three-server NATS cluster."""
    root = Path(tempfile.mkdtemp(prefix="gpushare-failover-"))
    pg = PostgresPair(root / "pg")
    nats = NatsCluster(root / "nats")
    try:
        await asyncio.to_thread(nats.start)
        await asyncio.to_thread(pg.start)
        admin = await asyncpg.connect(pg.url())
        await admin.execute('CREATE DATABASE "gpushare"')
        await admin.close()
        yield Servers(pg, nats, pg.url("gpushare"))
    finally:
        await asyncio.to_thread(nats.stop)
        await asyncio.to_thread(pg.stop)
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
async def ha_stack(servers: Servers, control_plane_binaries, tmp_path_factory: pytest.TempPathFactory):  # type: ignore[no-untyped-def]
    """The stack on the replicated servers: services given the multi-host database URL (each as its own role)
    and every NATS server's URL, with GPUSHARE_STREAM_REPLICAS=3 as the HA manifests set it."""
    from devstack.stack.stack import Stack

    config = burst_stack_config(
        tmp_path_factory.mktemp("failover-stack"),
        control_plane_binaries,
        tag=uuid.uuid4().hex[:6],
        letter="f",
        nats_url=servers.nats.url,
        log=log,
        database_url=servers.database_url,
        admin_token="failover",
        service_roles=True,
    )
    previous = os.environ.get("GPUSHARE_STREAM_REPLICAS")
    os.environ["GPUSHARE_STREAM_REPLICAS"] = "3"  # every service process (and its restarts) reads it
    stack = Stack(config)
    try:
        await stack.start()
        require_complete(stack)
        yield stack
    finally:
        dead = stack.check_alive()
        await stack.stop()
        if previous is None:
            os.environ.pop("GPUSHARE_STREAM_REPLICAS", None)
        else:
            os.environ["GPUSHARE_STREAM_REPLICAS"] = previous
        assert not dead, f"service processes died: {dead}"


# ------------------------------------------------------------------------------------------------ faults

Fault = Callable[[Servers, Any], Awaitable[dict[str, Any]]]


async def postgres_failover(servers: Servers, stack: Any) -> dict[str, Any]:
    """kill -9 the primary, promote the standby at once."""
    started = time.monotonic()
    killed = servers.pg.kill9_primary()
    promoted = await servers.pg.promote_standby()
    return {"killed": killed.name, "promoted": promoted.name, "promote_s": round(time.monotonic() - started, 2)}


async def nats_leader_kill(servers: Servers, stack: Any) -> dict[str, Any]:
    """kill -9 the server leading the ledger stream."""
    leader = await servers.nats.stream_leader(stack.config.stream_name)
    servers.nats.servers[leader].kill9()
    return {"killed": f"n{leader}"}


async def nats_freeze(servers: Servers, stack: Any) -> dict[str, Any]:
    """SIGSTOP the server most clients are connected to; SIGCONT after `FREEZE_S` (in the background)."""
    counts = [_client_connections(servers.nats, i) for i in range(len(servers.nats.servers))]
    target = counts.index(max(counts))
    leader = await servers.nats.stream_leader(stack.config.stream_name)
    servers.nats.servers[target].pause()
    asyncio.get_running_loop().call_later(FREEZE_S, servers.nats.servers[target].resume)
    return {"frozen": f"n{target}", "clients_on_it": counts[target], "was_stream_leader": target == leader}


def _client_connections(cluster: NatsCluster, index: int) -> int:
    port = cluster.servers[index].monitor_port
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/varz", timeout=2) as reply:
        return int(json.loads(reply.read()).get("connections", 0))


async def make_whole(servers: Servers, stack: Any) -> None:
    """Every server back: the lost primary rebuilt as the new primary's synchronous standby, every NATS server
    running (restarted on its data, or resumed), every stream current on it (the snapshot object store's too) and every
    durable consumer led."""
    await servers.pg.rejoin()
    for server in servers.nats.servers:
        server.resume()
        if server.pid is None:
            await asyncio.to_thread(server.start)
    await asyncio.to_thread(servers.nats.wait_meta_leader)
    for stream in await servers.nats.stream_names():  # the snapshot store's own stream too (`ledger rebuild`)
        await servers.nats.wait_current(stream, timeout_s=120)
    await servers.nats.wait_consumers_current(stack.config.stream_name, timeout_s=120)


FAULTS: dict[str, Fault] = {
    "postgres-failover": postgres_failover,
    "nats-leader-kill": nats_leader_kill,
    "nats-freeze-30s": nats_freeze,
}


# -------------------------------------------------------------------------------------------- the burst


async def _watch_binds(api: Any, namespace: str, bound_at: dict[str, float], stop: asyncio.Event) -> None:
    """Note when each pod of `namespace` is first seen bound (the apiserver may be slow: errors are retried)."""
    from kubernetes_asyncio import client

    core = client.CoreV1Api(api)
    while not stop.is_set():
        try:
            for pod in (await core.list_namespaced_pod(namespace)).items:
                if pod.spec.node_name and pod.metadata.name not in bound_at:
                    bound_at[pod.metadata.name] = time.monotonic()
        except Exception as exc:
            log.info("listing pods failed: %r", exc)
        await asyncio.sleep(0.2)


async def burst_with_fault(stack: Any, servers: Servers, fault: str, run: int, rng: random.Random) -> Outcome:
    """Pods before and after one fault; waits until they are bound (or `BIND_WAIT_S` passed)."""
    from tests.e2e import helpers as h

    api = await stack.api_client()
    namespace = f"fo-{fault[:8]}-{run}-{uuid.uuid4().hex[:4]}"
    await h.create_namespace(api, namespace)
    outcome = Outcome(fault, run)
    bound_at: dict[str, float] = {}
    created_at: dict[str, float] = {}
    stop = asyncio.Event()
    watcher = asyncio.create_task(_watch_binds(api, namespace, bound_at, stop))

    async def create(name: str) -> None:
        await h.create_pod(api, namespace, h.gpu_pod(name, [rng.choice([1, 1, 2])]))
        created_at[name] = time.monotonic()

    try:
        for i in range(BEFORE_FAULT):
            await create(f"before-{i}")
            await asyncio.sleep(0.5)
        fault_at = time.monotonic()
        outcome.details = await FAULTS[fault](servers, stack)
        i = 0
        while time.monotonic() - fault_at < AFTER_FAULT_S:
            await create(f"after-{i}")
            i += 1
            await asyncio.sleep(1.0)
        deadline = time.monotonic() + BIND_WAIT_S
        while time.monotonic() < deadline:
            if len(bound_at) >= len(created_at):
                break
            await asyncio.sleep(0.5)
    finally:
        stop.set()
        await watcher
    after = [bound_at[n] - fault_at for n in created_at if n.startswith("after-") and n in bound_at]
    outcome.recovery_s = round(min(after), 2) if after else None
    outcome.pods = len(created_at)
    outcome.lost = sorted(set(created_at) - set(bound_at))
    outcome.details["namespace"] = namespace
    return outcome


async def check_after(stack: Any, servers: Servers, outcome: Outcome) -> None:
    """The invariants once the burst settled; problems go into `outcome`."""
    engine = make_engine(stack.database_url, pool_size=2)
    api = await stack.api_client()
    try:
        report = await settled_invariants(engine, stack)
        await wait_for_quiet(engine, timeout_s=60)
        outcome.problems += report.problems
        outcome.problems += await annotation_problems(engine, api, stack.node_names)
        outcome.double_binds = await double_binds(stack.database_url, outcome.details["namespace"])
        accounting = await accounting_caught_up(stack, report.allocated_memory_mib)
        outcome.details["accounting"] = accounting
        if accounting.get("backlog") != (0, 0) or accounting.get("accounting_allocated_mib") != (
            report.allocated_memory_mib
        ):
            outcome.problems.append(f"accounting != ledger: {accounting}")
    finally:
        await engine.dispose()
    rebuild = await ledger_rebuild(stack)
    if rebuild.returncode != 0:
        outcome.problems.append("ledger != replay of the stream:\n" + rebuild.stderr[-2000:])


async def annotation_problems(engine: Any, api: Any, nodes: list[str]) -> list[str]:
    """Bound pods whose `gpushare.io/allocation` annotation is not their live allocation (id, node, parts)."""
    from kubernetes_asyncio import client

    async with engine.connect() as conn:
        state = await load_state(conn)
    live = {a.pod_uid: (a_id, a) for a_id, a in state.allocations.items() if is_live(a.state)}
    problems = []
    for pod in (await client.CoreV1Api(api).list_pod_for_all_namespaces()).items:
        if pod.spec.node_name not in nodes or pod.metadata.uid not in live:
            continue
        alloc_id, alloc = live[pod.metadata.uid]
        where = f"{pod.metadata.namespace}/{pod.metadata.name}"
        value = (pod.metadata.annotations or {}).get(ALLOCATION)
        if value is None:
            problems.append(f"bound pod {where} has no {ALLOCATION} annotation")
            continue
        got_id, got_node, got_parts = parse_allocation(value)
        want = sorted((p.container, p.gpu_uuid, p.memory_mib) for p in alloc.parts)
        got = sorted((p.container, p.gpu_uuid, p.memory_mib) for p in got_parts)
        if (got_id, got_node, got) != (alloc_id, alloc.node, want):
            ledger = (alloc_id, alloc.node, want)
            problems.append(f"pod {where}: annotation {(got_id, got_node, got)} != ledger {ledger}")
    return problems


async def double_binds(database_url: str, namespace: str) -> list[str]:
    """Pods of `namespace` with more than one allocation that reached `bound`."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT pod_name, count(*) AS n FROM allocations WHERE namespace = $1 AND bound_at IS NOT NULL"
            " GROUP BY pod_name HAVING count(*) > 1",
            namespace,
        )
    finally:
        await conn.close()
    return [f"{r['pod_name']} x{r['n']}" for r in rows]


def _record(outcome: Outcome) -> None:
    with RESULTS.open("a") as out:
        out.write(
            json.dumps(
                {
                    "scenario": "failover",
                    "profile": "soak" if PROFILE.soak else "bounded",
                    "fault": outcome.fault,
                    "run": outcome.run,
                    "recovery_s": outcome.recovery_s,
                    "pods": outcome.pods,
                    "lost": outcome.lost,
                    "double_binds": outcome.double_binds,
                    "problems": outcome.problems[:10],
                    "details": outcome.details,
                },
                default=str,
            )
            + "\n"
        )


async def test_each_server_fault_costs_seconds_and_no_pod(ha_stack, servers: Servers) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e import helpers as h

    rng = random.Random(PROFILE.seed)
    outcomes: list[Outcome] = []
    for run in range(RUNS):
        for fault in FAULTS:
            outcome = await burst_with_fault(ha_stack, servers, fault, run, rng)
            try:
                await make_whole(servers, ha_stack)
                await check_after(ha_stack, servers, outcome)
            finally:
                _record(outcome)
                outcomes.append(outcome)
                log.info(
                    "%s run %d: recovery %ss, %d pods, lost %s, double binds %s, problems %d",
                    fault,
                    run,
                    outcome.recovery_s,
                    outcome.pods,
                    outcome.lost,
                    outcome.double_binds,
                    len(outcome.problems),
                )
            await h.delete_all_pods(await ha_stack.api_client(), outcome.details["namespace"])
    for fault in FAULTS:
        times = [o.recovery_s for o in outcomes if o.fault == fault and o.recovery_s is not None]
        if times:
            log.info(
                "%s: recovery median %.1fs, worst %.1fs over %d runs (target %.0fs)",
                fault,
                statistics.median(times),
                max(times),
                len(times),
                TARGETS_S[fault],
            )
    for outcome in outcomes:
        where = f"{outcome.fault} run {outcome.run} ({outcome.details})"
        assert not outcome.lost, f"{where}: pods never bound: {outcome.lost}"
        assert not outcome.double_binds, f"{where}: pods bound twice: {outcome.double_binds}"
        assert outcome.recovery_s is not None, f"{where}: no pod created after the fault was bound"
        assert not outcome.problems, f"{where}:\n" + "\n".join(outcome.problems[:20])


# ------------------------------------------------------------------------ synchronous replication and scheduling

HELD = "waiting for a synchronous standby"
SERVICES = ("extender", "binder", "accounting")
HOLD_PODS = 6  # pods created, one a second, while COMMITs are held
QUORUM_PODS = 8  # pods created, one a second, with one of two quorum standbys lost


async def _readyz(url: str) -> tuple[int, str]:
    async with httpx.AsyncClient(timeout=5) as http:
        try:
            answer = await http.get(url)
        except httpx.TransportError as exc:
            return 0, repr(exc)
    return answer.status_code, answer.text


Seen = dict[str, list[tuple[float, int, str]]]  # per service: (when, /readyz status, body) at each change


async def _watch_ready(urls: dict[str, str], seen: Seen, stop: asyncio.Event) -> None:
    """Every service's `/readyz` twice a second: (when, status, body) whenever a service's answer changes."""
    while not stop.is_set():
        for service, url in urls.items():
            status, body = await _readyz(url)
            if status == 0:  # no answer within 5 s (a loaded machine): says nothing about readiness
                continue
            if not seen[service] or seen[service][-1][1] != status:
                seen[service].append((time.monotonic(), status, body))
        await asyncio.sleep(0.5)


async def _scheduler_said(api: Any, namespace: str, text: str) -> str | None:
    """The message of an event in `namespace` (kube-scheduler's FailedScheduling, say) that contains `text`."""
    from kubernetes_asyncio import client

    for item in (await client.CoreV1Api(api).list_namespaced_event(namespace)).items:
        if text in (item.message or ""):
            return str(item.message)
    return None


@dataclass
class Watched:
    """A namespace of a scenario and what is watched meanwhile: each pod's creation and first bind, every service's
    `/readyz`."""

    api: Any
    namespace: str
    seen: Seen = field(default_factory=lambda: {s: [] for s in SERVICES})
    bound_at: dict[str, float] = field(default_factory=dict)
    created_at: dict[str, float] = field(default_factory=dict)

    async def create(self, count: int, prefix: str) -> None:
        """`count` 1 GiB pods, one a second."""
        from tests.e2e import helpers as h

        for i in range(count):
            await h.create_pod(self.api, self.namespace, h.gpu_pod(f"{prefix}-{i}", [1]))
            self.created_at[f"{prefix}-{i}"] = time.monotonic()
            await asyncio.sleep(1.0)

    async def all_bound(self) -> None:
        await eventually(
            lambda: len(self.bound_at) >= len(self.created_at), what="every pod created bound", within=BIND_WAIT_S
        )


@contextlib.asynccontextmanager
async def watching(stack: Any, prefix: str) -> AsyncIterator[Watched]:
    """A fresh namespace, its binds and every service's `/readyz` watched for the block; its pods deleted after."""
    from tests.e2e import helpers as h

    api = await stack.api_client()
    watched = Watched(api, f"{prefix}-{uuid.uuid4().hex[:6]}")
    await h.create_namespace(api, watched.namespace)
    urls = {s: stack.replicas(s)[0].command.ready_url for s in SERVICES}
    stop = asyncio.Event()
    watchers = [
        asyncio.create_task(_watch_binds(api, watched.namespace, watched.bound_at, stop)),
        asyncio.create_task(_watch_ready(urls, watched.seen, stop)),
    ]
    try:
        yield watched
    finally:
        stop.set()
        await asyncio.gather(*watchers, return_exceptions=True)


async def _settle(stack: Any, servers: Servers, watched: Watched, outcome: Outcome) -> None:
    """The invariants after a scenario (`check_after`), recorded, the namespace's pods deleted; then its asserts."""
    from tests.e2e import helpers as h

    outcome.pods = len(watched.created_at)
    outcome.lost = sorted(set(watched.created_at) - set(watched.bound_at))
    try:
        await check_after(stack, servers, outcome)
    finally:
        _record(outcome)
        log.info("%s: %s", outcome.fault, outcome)
        await h.delete_all_pods(watched.api, watched.namespace)
    assert not outcome.lost, f"pods never bound: {outcome.lost}"
    assert not outcome.double_binds, f"pods bound twice: {outcome.double_binds}"
    assert not outcome.problems, "\n".join(outcome.problems[:20])


def _first(seen: list[tuple[float, int, str]], status: int, after: float) -> float | None:
    return next((t - after for t, s, _ in seen if s == status and t >= after), None)


async def test_commits_held_for_a_missing_synchronous_standby_are_said_then_every_pod_binds_once(  # type: ignore[no-untyped-def]
    ha_stack, servers: Servers
) -> None:
    """Strict synchronous replication on two instances (`synchronous_standby_names` names the one standby) and the
    standby lost: PostgreSQL holds every COMMIT. gpushare says so instead of hanging: every service's `/readyz`
    answers 503 naming the missing standby, kube-scheduler's bind of each pod created meanwhile is answered with
    that reason (its FailedScheduling event), and nothing is bound. Once the standby is back, without anyone's help,
    every pod created meanwhile is bound exactly once, no GPU is overcommitted, accounting and a replay of the stream
    agree with the ledger, and `/readyz` is 200 again."""
    outcome = Outcome("commit-hold", 0)
    standby_back = False
    async with watching(ha_stack, "hold") as w:
        outcome.details["namespace"] = w.namespace
        try:
            held_at = time.monotonic()
            await asyncio.to_thread(servers.pg.stop_standby)
            await w.create(HOLD_PODS, "held")
            for service in SERVICES:
                await eventually(
                    lambda service=service: any(s == 503 and HELD in b for _, s, b in w.seen[service]),
                    what=f"{service}'s /readyz 503 naming the missing standby",
                    within=60,
                )
            said = await eventually(
                lambda: _scheduler_said(w.api, w.namespace, HELD),
                what="kube-scheduler told why the bind failed",
                within=90,
            )
            assert not w.bound_at, f"pods bound while no COMMIT could complete: {w.bound_at}"
            outcome.details["scheduler_event"] = said[:300]
            outcome.details["not_ready_after_s"] = {s: _first(w.seen[s], 503, held_at) for s in SERVICES}

            released_at = time.monotonic()
            await servers.pg.start_standby()
            standby_back = True
            await w.all_bound()
            for service in SERVICES:
                await eventually(
                    lambda service=service: w.seen[service] and w.seen[service][-1][1] == 200,
                    what=f"{service}'s /readyz 200 again",
                    within=60,
                )
            outcome.details["ready_again_after_s"] = {s: _first(w.seen[s], 200, released_at) for s in SERVICES}
            outcome.recovery_s = round(min(w.bound_at.values()) - released_at, 2)
            outcome.details["all_bound_after_s"] = round(max(w.bound_at.values()) - released_at, 2)
        finally:
            if not standby_back:
                await servers.pg.start_standby()
    await _settle(ha_stack, servers, w, outcome)


async def test_with_two_quorum_standbys_losing_one_keeps_scheduling(ha_stack, servers: Servers) -> None:  # type: ignore[no-untyped-def]
    """Three instances, `synchronous_standby_names = 'ANY 1 (pg1, pg2)'` (what the HA overlay's CloudNativePG
    cluster runs: `method: any`, `number: 1`): one standby lost, the other confirms every COMMIT. Pods created
    meanwhile bind as usual, and no service's `/readyz` leaves 200."""
    pg = servers.pg
    lost = pg.standby
    assert lost is not None
    extra = await pg.add_standby()
    await pg.set_synchronous(f"ANY 1 ({lost.name}, {extra.name})")
    outcome = Outcome("quorum-standby-lost", 0)
    try:
        async with watching(ha_stack, "quorum") as w:
            outcome.details["namespace"] = w.namespace
            await asyncio.to_thread(pg.stop_node, lost)
            await w.create(QUORUM_PODS, "q")
            await w.all_bound()
            waits = sorted(w.bound_at[n] - w.created_at[n] for n in w.created_at)
            median, worst = round(statistics.median(waits), 2), round(waits[-1], 2)
            outcome.details["create_to_bind_s"] = {"median": median, "max": worst}
            outcome.details["readyz"] = {s: [st for _, st, _ in w.seen[s]] for s in SERVICES}
    finally:
        await pg.start_node(lost)
        await pg.set_synchronous(lost.name)
        pg.remove_standby(extra)
    for service in SERVICES:
        assert [st for _, st, _ in w.seen[service]] == [200], f"{service}'s /readyz left 200: {w.seen[service]}"
    await _settle(ha_stack, servers, w, outcome)
