"""Process faults during a burst of GPU pods through a replicated stack (issue 32): the scenario, its measures and
its checks, shared by `test_process_faults.py` (each fault once) and its soak profile (each fault three times, the
figures of docs/reliability.md).

The stack runs two replicas of the extender (behind one address, a Service stand-in), the binder (electing a
leader) and accounting, and two kube-schedulers electing a leader. One round: pods are created in waves of three,
six at once a third of the way through and, while those are on their way, one fault; the rest of the burst
follows. Measured: the time from the fault to the first binding of a pod created after it (the whole path
working again), the longest wait of the pods in flight at the fault, and the takeover: until the lease the
fault freed has a new holder (binder, kube-scheduler), or until the Service stops handing out the dead replica
(an extender alone). Checked once the burst settles: every pod bound (none lost), none bound twice (one `bound`
event per allocation and per pod), no GPU overcommitted, the ledger equal to the containers' environments and to
the pods' annotations, and accounting's projection equal to a replay of the streams.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import random
import signal
import statistics
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg
import httpx
from kubernetes_asyncio import client

from shared.annotations import ALLOCATION, GPU_MEM_IDX, parse_allocation
from shared.kube.watching import ADDED, MODIFIED, SYNCED, watch_objects
from shared.ledger.db import make_engine
from shared.ledger.replay import wait_for_quiet
from tests.e2e import helpers as h
from tests.reliability.harness import check_invariants, ledger_rebuild
from tests.waiting import eventually, stream_events

log = logging.getLogger("reliability.process_faults")

KILL_BINDER = "kill -9 the leading binder"
KILL_EXTENDER = "kill -9 one extender replica"
KILL_EXTENDER_AND_SCHEDULER = "kill -9 one extender replica and the leading kube-scheduler"
FAULTS = (KILL_BINDER, KILL_EXTENDER, KILL_EXTENDER_AND_SCHEDULER)
WAVE = 3  # pods created at once
FAULT_WAVE = 6  # ... and right before the fault, so that some are in flight when it comes
PACE_S = 0.6  # between waves
IN_FLIGHT_S = 0.05  # from the wave before the fault to the fault (its pods are being scheduled and bound)


@dataclass
class Round:
    """What one fault during one burst showed."""

    fault: str
    pods: int
    recovery_s: float | None = None  # fault -> first binding of a pod created after it
    in_flight: int = 0  # pods created before the fault and not bound at the fault
    in_flight_worst_s: float | None = None  # fault -> binding of the last pod that was in flight at the fault
    takeover_s: float | None = None  # fault -> the lease the fault freed has a new holder
    lost: list[str] = field(default_factory=list)  # pods never bound
    double_binds: list[str] = field(default_factory=list)
    problems: list[str] = field(default_factory=list)  # broken invariants

    def figures(self) -> dict[str, Any]:
        """For the results file (and the doc's table)."""
        return {
            "fault": self.fault,
            "pods": self.pods,
            "recovery_s": _round(self.recovery_s),
            "in_flight": self.in_flight,
            "in_flight_worst_s": _round(self.in_flight_worst_s),
            "takeover_s": _round(self.takeover_s),
            "lost": len(self.lost),
            "double_binds": len(self.double_binds),
            "problems": self.problems[:10],
        }


def _round(value: float | None) -> float | None:
    return None if value is None else round(value, 2)


class BindTimes:
    """When each pod of a namespace was first seen bound (a pod watch), on this process's monotonic clock."""

    def __init__(self, api: client.ApiClient, namespace: str) -> None:
        self.api = api
        self.namespace = namespace
        self.bound: dict[str, float] = {}
        self._task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> BindTimes:
        core = client.CoreV1Api(self.api)
        synced = asyncio.Event()

        async def follow() -> None:
            listing = functools.partial(core.list_namespaced_pod, self.namespace)
            async for event in watch_objects(listing, what="pods"):
                if event.type == SYNCED:
                    synced.set()
                if event.type not in (ADDED, MODIFIED):
                    continue
                name = str((event.object.get("metadata") or {}).get("name") or "")
                if (event.object.get("spec") or {}).get("nodeName") and name not in self.bound:
                    self.bound[name] = time.monotonic()

        self._task = asyncio.create_task(follow())
        await asyncio.wait_for(synced.wait(), 30)
        return self

    async def __aexit__(self, *exc: object) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._task


async def role(url: str) -> str:
    """A binder's role from its /healthz ('' when it does not answer)."""
    try:
        async with httpx.AsyncClient(timeout=2) as http:
            return str((await http.get(url + "/healthz")).json().get("role") or "")
    except (httpx.HTTPError, ValueError):
        return ""


def kill9(proc: Any) -> None:
    """SIGKILL a stack service process (its whole process group)."""
    if proc.popen is not None and proc.popen.poll() is None:
        os.killpg(proc.popen.pid, signal.SIGKILL)
        proc.popen.wait(10)


class Faults:
    """The faults, each with its takeover measure and what restores the stack afterwards."""

    def __init__(self, stack: Any, rng: random.Random) -> None:
        self.stack = stack
        self.rng = rng
        self.killed: list[Any] = []
        self.killed_schedulers: list[str] = []

    async def leading_binder(self) -> Any:
        for proc in self.stack.replicas("binder"):
            if proc.alive() and await role(proc.command.listens) == "leader":
                return proc
        raise AssertionError("no binder replica leads")

    async def inject(self, fault: str) -> asyncio.Task[float]:
        """Inject `fault` now; returns a task measuring the takeover (seconds from now)."""
        started = time.monotonic()
        if fault == KILL_BINDER:
            leader = await self.leading_binder()
            kill9(leader)
            self.killed.append(leader)
            others = [p for p in self.stack.replicas("binder") if p is not leader]

            async def binder_takeover() -> float:
                async def led() -> bool:
                    return any([await role(p.command.listens) == "leader" for p in others])

                await eventually(led, what="another binder to lead", within=60, interval=0.1)
                return time.monotonic() - started

            return asyncio.create_task(binder_takeover())
        if fault == KILL_EXTENDER:
            extender = self.rng.choice(self.stack.replicas("extender"))
            kill9(extender)
            self.killed.append(extender)
            proxy = self.stack.service_proxies["extender"]

            async def endpoint_gone() -> float:  # the Service stops handing out the dead replica
                await eventually(
                    lambda: len(proxy.ready_endpoints()) == len(proxy.endpoints) - 1,
                    what="the dead extender out of the Service",
                    within=30,
                    interval=0.05,
                )
                return time.monotonic() - started

            return asyncio.create_task(endpoint_gone())
        if fault == KILL_EXTENDER_AND_SCHEDULER:
            cp = self.stack.control_plane
            leading = cp.leading_scheduler()
            assert leading is not None, "no kube-scheduler leads"
            extender = self.rng.choice(self.stack.replicas("extender"))
            kill9(extender)
            await asyncio.to_thread(cp.kill_component, leading)
            self.killed.append(extender)
            self.killed_schedulers.append(leading)

            async def scheduler_takeover() -> float:
                await eventually(
                    lambda: cp.leading_scheduler() not in (None, leading),
                    what="another kube-scheduler to lead",
                    within=90,
                    interval=0.1,
                )
                return time.monotonic() - started

            return asyncio.create_task(scheduler_takeover())
        raise ValueError(f"unknown fault {fault!r}")

    async def restore(self) -> None:
        """Start what the faults killed again (as the Deployment's controller would), and wait until ready."""
        for proc in self.killed:
            proc.start()
        await asyncio.gather(*(p.wait_ready(90) for p in self.killed))
        for name in self.killed_schedulers:
            await asyncio.to_thread(self.stack.control_plane.start_component, name)
        self.killed, self.killed_schedulers = [], []


async def run_round(stack: Any, fault: str, pods: int, rng: random.Random) -> Round:
    """One burst of `pods` GPU pods with `fault` a third of the way through; returns what it showed (the pods
    stay: the caller deletes the namespace)."""
    api = await stack.api_client()
    namespace = f"ha-{uuid.uuid4().hex[:6]}"
    await h.create_namespace(api, namespace)
    names = [f"p{i:02d}" for i in range(pods)]
    at = max(FAULT_WAVE, pods // 3)  # the first pod created after the fault
    waves = [names[i : i + WAVE] for i in range(0, at - FAULT_WAVE, WAVE)] + [names[at - FAULT_WAVE : at]]
    waves += [names[i : i + WAVE] for i in range(at, pods, WAVE)]
    result = Round(fault, pods)
    faults = Faults(stack, rng)
    async with BindTimes(api, namespace) as times:
        created: dict[str, float] = {}
        takeover: asyncio.Task[float] | None = None
        fault_at = 0.0
        in_flight: list[str] = []
        for wave in waves:
            if wave[0] == names[at]:
                in_flight = [n for n in created if n not in times.bound]
                fault_at = time.monotonic()
                takeover = await faults.inject(fault)
                log.info("%s: injected with %d pod(s) in flight", fault, len(in_flight))
            bodies = [h.gpu_pod(n, [rng.choice([1, 1, 2])]) for n in wave]
            await asyncio.gather(*(h.create_pod(api, namespace, body) for body in bodies))
            created |= {n: time.monotonic() for n in wave}
            # the wave before the fault is still on its way when the fault comes (scheduled, reserved, binding)
            await asyncio.sleep(IN_FLIGHT_S if wave[-1] == names[at - 1] else PACE_S)
        with contextlib.suppress(TimeoutError):
            await eventually(lambda: len(times.bound) == pods, what="every pod bound", within=180, interval=0.2)
        assert takeover is not None
        result.takeover_s = await asyncio.wait_for(takeover, 120)
        after = [times.bound[n] for n in names[at:] if n in times.bound]
        result.recovery_s = min(after) - fault_at if after else None
        waited = [times.bound[n] - fault_at for n in in_flight if n in times.bound]
        result.in_flight = len(in_flight)
        result.in_flight_worst_s = max(waited) if waited else None
        result.lost = [n for n in names if n not in times.bound]
    await faults.restore()
    result.problems = await settled_problems(stack, namespace)
    uids = {p.metadata.uid for p in (await client.CoreV1Api(api).list_namespaced_pod(namespace)).items}
    result.double_binds = await double_binds(stack, uids)
    return result


async def settled_problems(stack: Any, namespace: str, within_s: float = 90.0) -> list[str]:
    """Broken invariants once the stack is quiet ([] when none): the ledger against the cluster and the kubelets'
    container environments (`check_invariants`), the pods' annotations against the ledger, and accounting."""
    api = await stack.api_client()
    engine = make_engine(stack.database_url, pool_size=2)
    try:
        await wait_for_quiet(engine, timeout_s=60)
        deadline = time.monotonic() + within_s
        while True:
            report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
            problems = report.problems + await annotation_problems(api, stack.database_url, namespace)
            if not problems or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
    finally:
        await engine.dispose()
    return problems + await accounting_problems(stack, report.allocated_memory_mib)


async def annotation_problems(api: client.ApiClient, database_url: str, namespace: str) -> list[str]:
    """Bound pods whose `gpushare.io/allocation` and `ALIYUN_COM_GPU_MEM_IDX` do not say what the ledger holds."""
    ledger = await h.ledger_allocations(database_url, namespace)
    out = []
    for pod in (await client.CoreV1Api(api).list_namespaced_pod(namespace)).items:
        if not pod.spec.node_name:
            continue
        name, ann = pod.metadata.name, pod.metadata.annotations or {}
        live = ledger.get(name)
        if live is None or ALLOCATION not in ann:
            out.append(f"{namespace}/{name}: annotation {ALLOCATION in ann}, live allocation {live is not None}")
            continue
        allocation_id, node, parts = parse_allocation(ann[ALLOCATION])
        annotated = sorted((p.container, p.gpu_uuid, p.memory_mib) for p in parts)
        held = sorted((p["container"], p["gpu_uuid"], p["memory_mib"]) for p in live["parts"])
        indices = ",".join(str(i) for i in sorted({p["gpu_index"] for p in live["parts"]}))
        if (allocation_id, node, annotated) != (live["id"], live["node"], held) or ann.get(GPU_MEM_IDX) != indices:
            out.append(f"{namespace}/{name}: annotations {allocation_id} {node} {annotated} {ann.get(GPU_MEM_IDX)}")
    return out


async def accounting_problems(stack: Any, ledger_allocated_mib: int) -> list[str]:
    """Accounting caught up (both replicas' consumers share the durables), every replica serves the ledger's
    figure, and its projection equals a replay of the streams (`gpushare ledger rebuild` compares the ledger
    with a replay, then refills the projections from the streams: they must come out as they were)."""
    out: list[str] = []
    backlog = await accounting_backlog(stack)
    if backlog:
        out.append(f"accounting did not catch up: {backlog}")
    for proc in stack.replicas("accounting"):
        async with httpx.AsyncClient(timeout=5) as http:
            figures = (await http.get(proc.command.listens + "/v1/cluster")).json()
        if figures.get("allocated_memory_mib") != ledger_allocated_mib:
            served = figures.get("allocated_memory_mib")
            out.append(f"{proc.name} serves {served} MiB allocated, the ledger {ledger_allocated_mib}")
    before = await projections(stack.database_url)
    rebuild = await ledger_rebuild(stack)
    if rebuild.returncode != 0:
        out.append("ledger != replay of the stream: " + rebuild.stderr[-1500:])
    after = await projections(stack.database_url)
    for table in before:
        if before[table] != after[table]:
            missing, extra = before[table] - after[table], after[table] - before[table]
            out.append(
                f"accounting's {table} != replay: {len(missing)} rows only live, {len(extra)} only replayed, "
                f"e.g. {sorted(map(str, missing))[:2]} {sorted(map(str, extra))[:2]}"
            )
    return out


async def accounting_backlog(stack: Any, within_s: float = 60.0) -> dict[str, tuple[int, int]]:
    """Waits until accounting's durable consumers have nothing pending or unacknowledged; returns what is left
    ({} once caught up)."""
    from shared.events.bus import BusNames, EventBus

    names = BusNames(stack.config.stream_name, stack.config.subject_prefix)
    bus = await EventBus.connect(stack.nats_url, names)
    left: dict[str, tuple[int, int]] = {}
    try:
        deadline = time.monotonic() + within_s
        while True:
            left = {}
            for stream, durable in ((names.stream, "accounting"), (names.samples_stream, "accounting-samples")):
                info = await bus.js.consumer_info(stream, durable)
                if info.num_pending or info.num_ack_pending:
                    left[durable] = (info.num_pending, info.num_ack_pending)
            if not left or time.monotonic() > deadline:
                return left
            await asyncio.sleep(0.5)
    finally:
        await bus.close()


async def projections(database_url: str) -> dict[str, set[tuple[Any, ...]]]:
    """Accounting's read models derived from the ledger stream and refusals, as sets of rows (without serial ids)."""
    conn = await asyncpg.connect(database_url)
    try:
        timeline = await conn.fetch("SELECT event_id, allocation_id, pod_uid, node, step, ts, detail FROM acc_timeline")
        pending = await conn.fetch("SELECT pod_uid, event_id, summary, refused_at FROM acc_pending")
    finally:
        await conn.close()
    return {"acc_timeline": {tuple(r) for r in timeline}, "acc_pending": {tuple(r) for r in pending}}


async def double_binds(stack: Any, pod_uids: set[str]) -> list[str]:
    """Allocations or pods (of `pod_uids`) with more than one `bound` event in the stream."""
    from shared.events.bus import BusNames, EventBus

    bus = await EventBus.connect(stack.nats_url, BusNames(stack.config.stream_name, stack.config.subject_prefix))
    try:
        bound = [e for e in await stream_events(bus, "bound") if e.pod_uid in pod_uids]
    finally:
        await bus.close()
    by_allocation = Counter(e.allocation_id for e in bound)
    by_pod = Counter(e.pod_uid for e in bound)
    return [f"allocation {a} bound {n} times" for a, n in by_allocation.items() if n > 1] + [
        f"pod {p} bound {n} times" for p, n in by_pod.items() if n > 1
    ]


def table(rounds: list[Round]) -> list[str]:
    """docs/reliability.md's table: per fault, recovery (median and worst), pods lost, double binds, and what the
    fault cost the pods in flight and the lease it freed."""
    lines = [
        "| fault | runs | recovery: fault to next bind, median / worst | pods in flight at the fault: worst wait "
        "| takeover, median / worst | pods lost | double binds |",
        "|---|---|---|---|---|---|---|",
    ]
    for fault in FAULTS:
        mine = [r for r in rounds if r.fault == fault]
        if not mine:
            continue
        rec = [r.recovery_s for r in mine if r.recovery_s is not None]
        take = [r.takeover_s for r in mine if r.takeover_s is not None]
        waits = [r.in_flight_worst_s for r in mine if r.in_flight_worst_s is not None]
        flying = sum(r.in_flight for r in mine)
        wait = f"{max(waits):.1f} s ({flying} pods)" if waits else f"- ({flying} pods)"
        lost = sum(len(r.lost) for r in mine)
        doubled = sum(len(r.double_binds) for r in mine)
        lines.append(f"| {fault} | {len(mine)} | {_spread(rec)} | {wait} | {_spread(take)} | {lost} | {doubled} |")
    return lines


def _spread(values: list[float]) -> str:
    return f"{statistics.median(values):.1f} s / {max(values):.1f} s" if values else "-"
