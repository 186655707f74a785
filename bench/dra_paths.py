"""12. The DRA path beside the extender path, plain pods and Kubernetes' DRA alone: the same pods, the whole life of
each, in one run.

One stack on the local control plane (v1.37.2): three node pools of equal shape (`nodes` device-plugin nodes,
`nodes` DRA nodes and `nodes` baseline nodes, 8 x 16 GiB each), the first two with a real node agent process per
node (`--dra` on the DRA pool), every node a kubelet stand-in that admits the pods bound to it. Four phases, each
the same `pods` pods named alike:

* plain: pods asking `cpu: 10m`, placed and bound by kube-scheduler alone, admitted by the kubelet stand-ins;
* extender: the pods asking `aliyun.com/gpu-mem: 1`: kube-scheduler calls the extender (filter, prioritize,
  bind), the ledger reserves, the binder posts the Binding, kubelet's device-manager calls reach the node agents'
  device plugins (GetPreferredAllocation, Allocate, PreStartContainer) and the agents record `assigned`;
* dra: the same manifests in a namespace labelled `gpushare.io/allocator=dra`: gpushare admission (served by the
  extender) rewrites each into a claim template, kube-controller-manager makes the claim (counted against the
  namespace's quota by gpushare's claim webhook), kube-scheduler allocates it from the DRA nodes' ResourceSlices
  (no binding condition: the default pool) and binds at once; the binder records the allocation from its claim
  watch; kubelet's DRA side prepares the claim through the node agent (NodePrepareResources: waits for the ledger
  to hold the claim, CDI spec, `assigned`) before the pod runs;
* baseline: the very claim admission writes, hand-written, in a namespace that did not opt in, on the third pool
  whose slices a minimal driver publishes (`bench.dra_baseline`): kube-scheduler's DRA with nothing of gpushare on
  the path (no webhook, no ledger, no node agent); the kubelet stand-ins prepare each claim through the minimal
  driver's kubelet plugin, as kubelet prepares any DRA driver's claims.

Each phase keeps `level` pods in flight (created and not yet bound: a new pod is created as soon as one is bound)
and ends when every pod runs; then its pods are deleted and the phase's teardown (unprepare, release, claims
deleted) runs to the end. CPU per pod by component covers both windows, with what the idle stack spends over the
same seconds (measured before the phases) taken out; gross figures are reported too. Creation -> bound is from
the benchmark sending the create to its pod watch seeing `spec.nodeName`; bound -> running to seeing
`phase: Running` (the stand-ins poll their node's pods every 0.5 s). For the DRA path also: how long each
NodePrepareResources waited for the ledger (the node agents' histogram) and when the ledger recorded each claim
against when the pod was seen bound.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import time
import uuid
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

import asyncpg
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from bench import api_requests, db_counts, dra_baseline, extender_calls, prepare_wait
from bench.common import BenchResult, Context, Target, latency_summary
from bench.cpu import (
    CONTROL_PLANE_GROUPS,
    PRODUCT_GROUPS,
    CpuWindow,
    benchmark_roots,
    cpu_by_group,
    ms_per_item,
    product_ms_per_pod,
)
from bench.kube_stack import SCHEDULER_QPS, create_namespace, pod_body, whole_stack
from bench.pyspy import phase_profiles
from bench.scheduler_overhead import settle
from shared.kube.raw import read_json
from shared.kube.watching import SYNCED, watch_objects
from shared.ledger.models import LIVE_SQL

NAME = "dra"
TITLE = "12. DRA path vs extender path vs plain pods: pods/s, creation -> bound, CPU per pod (whole life)"
GPUS = "8x16GiB:Tesla-T4"
PATHS = ("plain", "extender", "dra", "baseline")
DRA_NAMESPACE = {"gpushare.io/allocator": "dra"}  # the label that opts a namespace in to gpushare admission
# issue 42's targets: creation -> bound p50 <= 1 s and p99 <= 2 s at 16 in flight; DRA pods/s >= 0.8 x the
# baseline's (Kubernetes' DRA alone) at every level; gpushare CPU per DRA pod <= per extender-path pod
TO_BOUND_P50_MS, TO_BOUND_P99_MS, TO_BOUND_LEVEL = 1000.0, 2000.0, 16
RATE_TARGET = 0.8
CPU_TARGET = 1.0
# kube-controller-manager's API client defaults to 20 requests/s (burst 30: pkg/controller/apis/config/v1alpha1/
# defaults.go), shared by its resourceclaim controller's two writes per pod (the claim, the pod's
# resourceClaimStatuses): left there it, not gpushare, would cap the DRA path near 10 pods/s. Raised as
# kube-scheduler's is (bench.kube_stack.SCHEDULER_QPS); GPUSHARE_BENCH_DRA_KCM_QPS=0 keeps the default.
CONTROLLER_MANAGER_QPS = SCHEDULER_QPS

EXERCISED = {
    "plain": "kube-scheduler (no extender call) -> Binding by kube-scheduler -> kubelet stand-in admits -> Running",
    "extender": "kube-scheduler -> extender filter/prioritize/bind -> ledger reserve -> binder Binding -> kubelet "
    "stand-in: GetPreferredAllocation, Allocate, PreStartContainer on the node agents' device plugins (assigned) "
    "-> Running; delete -> binder release",
    "dra": "gpushare admission (extender webhook) -> resourceclaim controller -> claim webhook (quota) -> "
    "kube-scheduler DynamicResources -> Binding by kube-scheduler; binder claim watch (ledger reserve_claim, "
    "annotations) -> kubelet stand-in: NodePrepareResources on the node agent (waits for the ledger's record, CDI "
    "spec, assigned) -> Running; delete -> NodeUnprepareResources, binder release, claim deleted",
    "baseline": "resourceclaim controller -> kube-scheduler DynamicResources on a minimal driver's slices -> "
    "Binding by kube-scheduler -> kubelet stand-in: NodePrepareResources on the minimal driver's plugin (claim read, "
    "CDI spec) -> Running; delete -> NodeUnprepareResources, claim deleted",
}


@dataclass(frozen=True)
class Sizes:
    """Nodes in each pool, pods per phase, and the numbers of pods in flight measured."""

    nodes: int
    pods: int
    levels: tuple[int, ...]


def sizes(ctx: Context) -> Sizes:
    """This run's sizes (GPUSHARE_BENCH_DRA_NODES / _PODS / _LEVELS override them, e.g. `16,128`)."""
    base: Sizes = ctx.pick(Sizes(1, 6, (2, 6)), Sizes(2, 96, (16, 48)), Sizes(5, 480, (16, 128)))
    env = os.environ
    levels = tuple(int(x) for x in env.get("GPUSHARE_BENCH_DRA_LEVELS", "").split(",") if x.strip())
    return Sizes(
        int(env.get("GPUSHARE_BENCH_DRA_NODES") or base.nodes),
        int(env.get("GPUSHARE_BENCH_DRA_PODS") or base.pods),
        levels or base.levels,
    )


def fits(s: Sizes, gpu_gib: int = 16, gpus_per_node: int = 8) -> bool:
    """Whether a pool holds a phase of 1 GiB pods, with room for the shares in flight."""
    return s.pods + max(s.levels) <= s.nodes * gpus_per_node * gpu_gib


def max_pods_per_node(s: Sizes) -> int:
    """Each node's pod capacity: a GPU phase puts all its pods on one pool."""
    return max(110, s.pods // s.nodes + 10)


@dataclass
class Flight:
    """When each pod of a phase was created, seen bound and seen running (monotonic seconds)."""

    created: dict[str, float] = field(default_factory=dict)
    bound: dict[str, float] = field(default_factory=dict)
    bound_wall: dict[str, float] = field(default_factory=dict)  # the same moment by the wall clock (epoch seconds)
    claimed: dict[str, float] = field(default_factory=dict)  # first seen with its claim's name in its status
    running: dict[str, float] = field(default_factory=dict)
    failed: dict[str, str] = field(default_factory=dict)  # pod -> why its create failed

    def creation_to_bound(self) -> list[float]:
        return [self.bound[p] - self.created[p] for p in self.bound if p in self.created]

    def creation_to_claimed(self) -> list[float]:
        """Creation -> the resourceclaim controller named the pod's claim in its status (claim created)."""
        return [self.claimed[p] - self.created[p] for p in self.claimed if p in self.created]

    def claimed_to_bound(self) -> list[float]:
        return [self.bound[p] - self.claimed[p] for p in self.bound if p in self.claimed]

    def bound_to_running(self) -> list[float]:
        return [self.running[p] - self.bound[p] for p in self.running if p in self.bound]

    def pods_per_s(self) -> float:
        """Bound pods / (last seen bound - first create)."""
        if not self.bound or not self.created:
            return 0.0
        span = max(self.bound.values()) - min(self.created.values())
        return len(self.bound) / span if span > 0 else 0.0

    def running_span_s(self) -> float:
        """First create -> last pod seen running."""
        if not self.running or not self.created:
            return 0.0
        return max(self.running.values()) - min(self.created.values())


def record(flight: Flight, pod: dict[str, Any], now: float, free: asyncio.Semaphore) -> None:
    """A pod the watch saw: the first time it has a node frees a slot in flight (pure but for the semaphore)."""
    name = str((pod.get("metadata") or {}).get("name") or "")
    if name not in flight.created:
        return
    if (pod.get("status") or {}).get("resourceClaimStatuses") and name not in flight.claimed:
        flight.claimed[name] = now
    if (pod.get("spec") or {}).get("nodeName") and name not in flight.bound:
        flight.bound[name] = now
        flight.bound_wall[name] = time.time()
        free.release()
    if (pod.get("status") or {}).get("phase") == "Running" and name in flight.bound:
        flight.running.setdefault(name, now)


async def closed_loop(
    api: Any, namespace: str, bodies: list[dict[str, Any]], in_flight: int, timeout_s: float
) -> Flight:
    """Create the pods keeping at most `in_flight` created and not yet bound; return once every created pod is
    running (or at `timeout_s`)."""
    core = client.CoreV1Api(api)
    flight = Flight()
    free = asyncio.Semaphore(in_flight)
    stop, synced, all_created, all_running = asyncio.Event(), asyncio.Event(), asyncio.Event(), asyncio.Event()

    def check() -> None:
        if all_created.is_set() and len(flight.running) >= len(flight.created):
            all_running.set()

    async def follow() -> None:
        listing = functools.partial(core.list_namespaced_pod, namespace)
        async for event in watch_objects(listing, what="bench pods", stop=stop):
            if event.type == SYNCED:
                synced.set()
            elif event.object:
                record(flight, event.object, time.monotonic(), free)
                check()

    async def create(body: dict[str, Any]) -> None:
        name = body["metadata"]["name"]
        flight.created[name] = time.monotonic()
        try:
            await read_json(await core.create_namespaced_pod(namespace, body, _preload_content=False))
        except (ApiException, OSError, TimeoutError) as exc:
            flight.failed[name] = str(getattr(exc, "body", None) or exc)[:300]
            del flight.created[name]
            free.release()

    deadline = time.monotonic() + timeout_s
    watcher = asyncio.create_task(follow())
    try:
        await asyncio.wait_for(synced.wait(), 30)
        creates = []
        for body in bodies:
            try:
                await asyncio.wait_for(free.acquire(), max(0.1, deadline - time.monotonic()))
            except TimeoutError:
                break
            creates.append(asyncio.create_task(create(body)))
        await asyncio.gather(*creates)
        all_created.set()
        check()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(all_running.wait(), max(0.1, deadline - time.monotonic()))
    finally:
        stop.set()
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    return flight


async def teardown(api: Any, namespace: str, database_url: str, timeout_s: float) -> bool:
    """Delete the phase's pods and wait until they, their ledger allocations and their claims are gone (the
    whole end of their life: unprepare, release, claim deletion); False when that took longer than `timeout_s`."""
    core = client.CoreV1Api(api)
    resource = client.ResourceV1Api(api)
    await core.delete_collection_namespaced_pod(namespace, grace_period_seconds=0, _preload_content=False)
    deadline = time.monotonic() + timeout_s
    conn = await asyncpg.connect(database_url)
    try:
        while time.monotonic() < deadline:
            pods = await read_json(await core.list_namespaced_pod(namespace, limit=1, _preload_content=False))
            claims = await read_json(
                await resource.list_namespaced_resource_claim(namespace, limit=1, _preload_content=False)
            )
            live = await conn.fetchval(
                f"SELECT count(*) FROM allocations WHERE namespace = $1 AND {LIVE_SQL}", namespace
            )
            if not pods.get("items") and not claims.get("items") and not live:
                return True
            await asyncio.sleep(0.2)
    finally:
        await conn.close()
    return False


async def recorded_after_bound(database_url: str, namespace: str, flight: Flight) -> list[float]:
    """Per DRA pod: seconds from the benchmark's watch seeing it bound to the ledger's record of its claim
    (`reserved_at`; negative when the record came first). Both by the wall clock of this machine."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT pod_name, extract(epoch FROM reserved_at)::float8 AS at FROM allocations"
            " WHERE namespace = $1 AND claim_uid IS NOT NULL",
            namespace,
        )
    finally:
        await conn.close()
    return [r["at"] - flight.bound_wall[r["pod_name"]] for r in rows if r["pod_name"] in flight.bound_wall]


async def ledger_states(database_url: str, namespace: str) -> Counter[str]:
    """The phase's allocations by state, and how many came from claims (`claim`)."""
    conn = await asyncpg.connect(database_url)
    try:
        rows = await conn.fetch(
            "SELECT state::text AS state, count(*) AS n, count(claim_uid) AS claims FROM allocations"
            " WHERE namespace = $1 GROUP BY state",
            namespace,
        )
    finally:
        await conn.close()
    out: Counter[str] = Counter({r["state"]: int(r["n"]) for r in rows})
    out["claim"] = sum(int(r["claims"]) for r in rows)
    return out


@dataclass
class Idle:
    """What the stack spends doing nothing: CPU seconds per group over `seconds`."""

    spent: dict[str, float]
    seconds: float

    def over(self, seconds: float) -> dict[str, float]:
        """The idle CPU per group over a window of `seconds`."""
        scale = seconds / self.seconds if self.seconds > 0 else 0.0
        return {g: s * scale for g, s in self.spent.items()}

    def cores(self) -> float:
        """Cores the idle stack keeps busy (the load generator left out)."""
        return sum(s for g, s in self.spent.items() if g != "bench") / self.seconds if self.seconds else 0.0


def net(spent: dict[str, float], background: dict[str, float]) -> dict[str, float]:
    """A window's CPU per group with the idle stack's share taken out (never below 0) (pure)."""
    return {g: max(0.0, s - background.get(g, 0.0)) for g, s in spent.items()}


@dataclass
class PhaseResult:
    """One phase's figures, keyed `<path>_c<level>_...`."""

    path: str
    level: int
    flight: Flight
    cpu: dict[str, float]  # CPU seconds per group over the phase's life (start and teardown windows)
    background: dict[str, float]  # the idle stack's over the same seconds
    seconds: float  # the two windows' length
    calls: dict[str, float]
    api_before: Counter[str]
    api_after: Counter[str]
    db: dict[str, float]
    ledger: Counter[str]
    torn_down: bool
    held: dict[str, float]  # CPU seconds per group, net of the idle stack, over `held_s` with every pod running
    held_s: float
    presence_s: float  # pod-seconds the phase's pods existed during its start window
    extra: dict[str, float] = field(default_factory=dict)  # the DRA path's prepare waits and record lag

    def presence(self, p: str, pods: int) -> dict[str, float]:
        """What the pods cost while they only exist (periodic work: reconciliation passes, the kubelet stand-ins'
        polls), per pod per second of existence, and that cost over their start window's presence, per pod: the
        part of `<p>_*_cpu_ms_per_pod` that grows with how long pods wait rather than with what they do."""
        out: dict[str, float] = {f"{p}_presence_s_per_pod": round(self.presence_s / pods, 2)}
        for name, groups in (("product", PRODUCT_GROUPS), ("control_plane", CONTROL_PLANE_GROUPS)):
            per_pod_s = sum(self.held.get(g, 0.0) for g in groups) / (pods * self.held_s) if self.held_s else 0.0
            out[f"{p}_held_{name}_cpu_us_per_pod_s"] = round(per_pod_s * 1e6, 2)
            out[f"{p}_{name}_cpu_ms_per_pod_from_presence"] = round(per_pod_s * self.presence_s / pods * 1000, 2)
        return out

    def shortfall(self, pods: int) -> str:
        """What went wrong, as a note."""
        f = self.flight
        note = f"{self.path} at {self.level} in flight: {len(f.bound)} of {pods} bound, {len(f.running)} running"
        note += f", torn down: {self.torn_down}"
        return note + (f"; a create failed: {next(iter(f.failed.values()))}" if f.failed else "")

    def api_note(self) -> str:
        """kube-apiserver's busiest requests and watch events per pod, as a note."""
        pods = max(1, len(self.flight.bound))
        return f"{self.prefix} per pod: {api_requests.breakdown(self.api_before, self.api_after, pods, top=12)}"

    @property
    def prefix(self) -> str:
        return f"{self.path}_c{self.level}"

    def metrics(self) -> dict[str, float]:
        f, p = self.flight, self.prefix
        pods = max(1, len(f.bound))
        m: dict[str, float] = {
            f"{p}_pods_per_s": round(f.pods_per_s(), 2),
            f"{p}_product_cpu_ms_per_pod": 0.0,  # filled in below, listed here to stand beside the rate
        }
        m.update(latency_summary(f"{p}_to_bound", f.creation_to_bound()))
        m.update(latency_summary(f"{p}_bound_to_running", f.bound_to_running()))
        if f.claimed:  # the pod's claim made from its template: creation -> claim, claim -> bound
            m.update(latency_summary(f"{p}_to_claimed", f.creation_to_claimed()))
            m.update(latency_summary(f"{p}_claimed_to_bound", f.claimed_to_bound()))
        m[f"{p}_bound"] = len(f.bound)
        m[f"{p}_running"] = len(f.running)
        m[f"{p}_create_failed"] = len(f.failed)
        m[f"{p}_first_create_to_last_running_s"] = round(f.running_span_s(), 2)
        m[f"{p}_life_s"] = round(self.seconds, 2)
        net_cpu = ms_per_item(net(self.cpu, self.background), pods, p)
        gross_cpu = ms_per_item(self.cpu, pods, f"{p}_gross")
        m[f"{p}_product_cpu_ms_per_pod"] = product_ms_per_pod(net_cpu, p)
        m[f"{p}_product_cpu_ms_per_pod_gross"] = product_ms_per_pod(gross_cpu, f"{p}_gross")
        m[f"{p}_control_plane_cpu_ms_per_pod"] = product_ms_per_pod(net_cpu, p, CONTROL_PLANE_GROUPS)
        # everything but the load generator and kubelet stand-ins: at this much CPU per pod, the machine's cores
        # cannot carry more pods per second whatever the concurrency
        system = m[f"{p}_product_cpu_ms_per_pod"] + m[f"{p}_control_plane_cpu_ms_per_pod"]
        m[f"{p}_system_cpu_ms_per_pod"] = round(system, 2)
        m[f"{p}_cpu_bound_pods_per_s"] = round((os.cpu_count() or 1) * 1000 / system, 1) if system else 0.0
        m.update(net_cpu)
        m[f"{p}_gross_cpu_ms_per_pod_total"] = gross_cpu[f"{p}_gross_cpu_ms_per_pod_total"]
        m.update(self.presence(p, pods))
        m.update(self.calls)
        m.update(api_requests.per_pod(self.api_before, self.api_after, pods, p))
        m.update(api_requests.webhook_means(self.api_before, self.api_after, p))
        m.update(self.db)
        m.update(self.extra)
        if self.path in ("extender", "dra"):
            m[f"{p}_ledger_allocations"] = sum(v for k, v in self.ledger.items() if k != "claim")
            m[f"{p}_ledger_assigned"] = self.ledger.get("assigned", 0)
            m[f"{p}_ledger_from_claims"] = self.ledger.get("claim", 0)
        return m


async def measure_idle(roots: list[int], seconds: float) -> Idle:
    """CPU per group of the quiet stack over `seconds` (kubelet stand-ins and node agents idling as they do)."""
    before, t0 = cpu_by_group(roots), time.monotonic()
    await asyncio.sleep(seconds)
    after, t1 = cpu_by_group(roots), time.monotonic()
    return Idle({g: max(0.0, after[g] - before.get(g, 0.0)) for g in after}, t1 - t0)


async def run_phase(
    stack: Any,
    api: Any,
    path: str,
    level: int,
    pods: int,
    idle: Idle,
    listeners: list[int | str],
    timeout_s: float,
    hold_s: float,
    agents: list[str],
) -> PhaseResult:
    """One path's phase at one level: the pods' start, then their end, in two CPU windows; between them `hold_s`
    with every pod running, measured apart (what pods cost while they only exist). `agents`: the DRA node agents'
    base URLs (their prepare waits are read around the DRA phase's start)."""
    ns = f"bench-dra-{path}-c{level}-{uuid.uuid4().hex[:5]}"
    await create_namespace(api, ns, DRA_NAMESPACE if path == "dra" else None)
    if path == "baseline":
        await dra_baseline.create_template(api, ns)
        bodies = [dra_baseline.pod_body(f"p-{i}") for i in range(pods)]
    else:
        bodies = [pod_body(f"p-{i}", gpu_gib=0 if path == "plain" else 1) for i in range(pods)]
    calls_before = await extender_calls.read_calls(stack.extender_url)
    waits_before = await prepare_wait.read(agents) if path == "dra" else None
    readings = [await _counts(api, stack)]
    with CpuWindow(listeners) as start, phase_profiles(f"dra-{path}-c{level}-start"):
        flight = await closed_loop(api, ns, bodies, level, timeout_s)
    ended = time.monotonic()
    ledger = await ledger_states(stack.database_url, ns)  # outside the windows: the benchmark's own reading
    p = f"{path}_c{level}"
    extra: dict[str, float] = {}
    if waits_before is not None:
        extra.update(prepare_wait.figures(waits_before, await prepare_wait.read(agents), p))
        extra.update(
            latency_summary(f"{p}_recorded_after_bound", await recorded_after_bound(stack.database_url, ns, flight))
        )
    readings.append(await _counts(api, stack))
    with CpuWindow(listeners) as held:
        await asyncio.sleep(hold_s)
    readings.append(await _counts(api, stack))
    with CpuWindow(listeners) as end, phase_profiles(f"dra-{path}-c{level}-end"):
        torn_down = await teardown(api, ns, stack.database_url, timeout_s)
    calls_after = await extender_calls.read_calls(stack.extender_url)
    readings.append(await _counts(api, stack))
    await client.CoreV1Api(api).delete_namespace(ns, _preload_content=False)
    done = max(1, len(flight.bound))
    spent = Counter(start.spent())
    spent.update(end.spent())
    seconds = start.seconds + end.seconds
    (api0, db0, ev0), (api1, db1, ev1), (api2, db2, ev2), (api3, db3, ev3) = readings
    api_after = Counter({k: api1[k] + api3[k] - api2[k] for k in api3})  # the held window left out
    db_after = {k: db1.get(k, 0) + db3[k] - db2.get(k, 0) for k in db3}
    return PhaseResult(
        path=path,
        level=level,
        flight=flight,
        cpu=dict(spent),
        background=idle.over(seconds),
        seconds=seconds,
        calls=extender_calls.per_pod(calls_before, calls_after, done, p),
        api_before=api0,
        api_after=api_after,
        db={
            **db_counts.per_pod(db0, db_after, done, p),
            # reads end in a rollback (SQLAlchemy gives back a connection that wrote nothing that way)
            f"{p}_db_rolled_back_per_pod": round((db_after["xact_rollback"] - db0["xact_rollback"]) / done, 2),
            # what the ledger sent to accounting and the node agents (the held window left out)
            f"{p}_ledger_events_per_pod": round((ev1 - ev0 + ev3 - ev2) / done, 2),
        },
        ledger=ledger,
        torn_down=torn_down,
        held=net(held.spent(), idle.over(held.seconds)),
        held_s=held.seconds,
        presence_s=sum(ended - t for t in flight.created.values()),
        extra=extra,
    )


async def _counts(api: Any, stack: Any) -> tuple[Counter[str], dict[str, int], int]:
    """kube-apiserver's request counts, PostgreSQL's for the ledger's database, and the ledger stream's last
    sequence (every event the ledger staged and its relay published), read together."""
    import nats

    from shared.events.bus import nats_servers

    nc = await nats.connect(nats_servers(stack.nats_url))
    try:
        last = int((await nc.jetstream().stream_info(stack.config.stream_name)).state.last_seq)
    finally:
        await nc.close()
    return await api_requests.read_counts(api), await db_counts.read_counts(stack.database_url), last


def ratios(m: dict[str, float], level: int) -> dict[str, float]:
    """DRA against the extender path at one level: pods/s, gpushare CPU per pod, p50 to bound (pure)."""
    out: dict[str, float] = {}

    def ratio(key: str, a: str, b: str) -> None:
        x, y = m.get(f"{a}_c{level}_{key}"), m.get(f"{b}_c{level}_{key}")
        if isinstance(x, int | float) and isinstance(y, int | float) and y:
            out[f"{a}_vs_{b}_{key}_c{level}"] = round(x / y, 3)

    ratio("pods_per_s", "dra", "baseline")
    ratio("to_bound_p50_ms", "dra", "baseline")
    ratio("control_plane_cpu_ms_per_pod", "dra", "baseline")
    ratio("pods_per_s", "dra", "extender")
    ratio("product_cpu_ms_per_pod", "dra", "extender")
    ratio("product_cpu_ms_per_pod_gross", "dra", "extender")
    ratio("to_bound_p50_ms", "dra", "extender")
    ratio("pods_per_s", "extender", "plain")
    ratio("pods_per_s", "dra", "plain")
    ratio("pods_per_s", "baseline", "plain")
    return out


def little_bound(level: int, to_bound_p50_ms: float) -> float:
    """The pods/s a closed loop of `level` pods in flight can reach when each takes `to_bound_p50_ms` from
    creation to bound (Little's law, L = lambda W) (pure)."""
    return round(level / (to_bound_p50_ms / 1000.0), 2) if to_bound_p50_ms > 0 else 0.0


async def run(ctx: Context) -> BenchResult:
    """The three paths at each level, on one stack."""
    s = sizes(ctx)
    kcm_qps = int(os.environ.get("GPUSHARE_BENCH_DRA_KCM_QPS", CONTROLLER_MANAGER_QPS))
    result = BenchResult(
        NAME,
        TITLE,
        ctx.profile,
        params={
            "nodes_per_pool": s.nodes,
            "pools": "device-plugin (extender) and DRA, side by side in one stack",
            "gpus": GPUS,
            "pods_per_phase": s.pods,
            "pod": "aliyun.com/gpu-mem: 1 (plain: cpu: 10m)",
            "in_flight": list(s.levels),
            "kube_controller_manager_qps": kcm_qps or "default (20, burst 30)",
            "kube_scheduler_qps": SCHEDULER_QPS,
        },
    )
    if not fits(s):
        raise ValueError(f"{s.pods} pods and {max(s.levels)} in flight do not fit {s.nodes} nodes of {GPUS}")
    if TO_BOUND_LEVEL in s.levels:
        result.targets.append(Target(f"dra_c{TO_BOUND_LEVEL}_to_bound_p50_ms", "<=", TO_BOUND_P50_MS))
        result.targets.append(Target(f"dra_c{TO_BOUND_LEVEL}_to_bound_p99_ms", "<=", TO_BOUND_P99_MS))
    for level in s.levels:
        result.targets.append(Target(f"dra_vs_baseline_pods_per_s_c{level}", ">=", RATE_TARGET))
        result.targets.append(Target(f"dra_vs_extender_product_cpu_ms_per_pod_c{level}", "<=", CPU_TARGET))
    kcm = [f"--kube-api-qps={kcm_qps}", f"--kube-api-burst={kcm_qps}"] if kcm_qps else []
    listeners = ctx.server_ports()
    timeout = ctx.pick(120.0, 300.0, 600.0)
    hold = ctx.pick(2.0, 5.0, 10.0)
    m = result.metrics
    async with (
        whole_stack(
            ctx, 2 * s.nodes, dra_nodes=s.nodes, max_pods=max_pods_per_node(s), gpus=GPUS, controller_manager_extra=kcm
        ) as stack,
        dra_baseline.baseline_pool(
            await stack.api_client(), stack.config.node_prefix, s.nodes, GPUS, max_pods_per_node(s)
        ) as base,
    ):
        api = await stack.api_client()
        agents = [
            str(stack.processes[f"node-agent-{n}"].command.ready_url).rsplit("/", 1)[0] for n in stack.dra_node_names
        ]
        roots = benchmark_roots(listeners)
        await settle(roots, most_s=ctx.pick(10.0, 30.0, 30.0))
        idle = await measure_idle(roots, ctx.pick(3.0, 10.0, 15.0))
        m["idle_cores"] = round(idle.cores(), 3)
        busy_below = idle.cores() + 0.25
        for level in s.levels:
            for path in PATHS:
                prepared = base.prepared()
                phase = await run_phase(stack, api, path, level, s.pods, idle, listeners, timeout, hold, agents)
                m.update(phase.metrics())
                if path == "baseline":  # the minimal driver's plugin prepared each baseline claim
                    m[f"baseline_c{level}_prepare_calls"] = base.prepared() - prepared
                if level == max(s.levels):
                    result.notes.append(phase.api_note())
                if len(phase.flight.running) < s.pods or not phase.torn_down:
                    result.status = "error"
                    result.notes.append(phase.shortfall(s.pods))
                await settle(roots, busy_below=busy_below, most_s=ctx.pick(10.0, 30.0, 30.0))
            m.update(ratios(m, level))
            m[f"dra_c{level}_littles_law_pods_per_s"] = little_bound(level, m.get(f"dra_c{level}_to_bound_p50_ms", 0.0))
    result.notes.append(
        f"pools: {s.nodes} device-plugin node(s), {s.nodes} DRA node(s) and {s.nodes} baseline node(s) (a minimal "
        "driver's slices, no gpushare), one stack, same shape"
    )
    for path in PATHS:
        result.notes.append(f"{path}: {EXERCISED[path]}")
    result.notes.append(
        "in flight = pods created and not yet bound; CPU per pod is net of the idle stack's CPU over the same "
        "seconds (`_gross` with it); `bench` is the load generator with the kubelet stand-ins (not gpushare)"
    )
    result.notes.append(
        "dra_c<L>_prepare_*: NodePrepareResources on the DRA nodes during the phase's start, from the node agents' "
        "histogram (wait for the ledger's record; *_le_ms: the upper bound of the bucket holding the quantile, -1 "
        "past 30 s); dra_c<L>_recorded_after_bound_*: the ledger's reserved_at minus the moment the benchmark saw the "
        "pod bound (negative: recorded first)"
    )
    result.notes.append(
        "<path>_c<L>_ledger_events_per_pod: events the ledger stream gained over the start and end windows (what the "
        "ledger sent to accounting and the node agents), per pod"
    )
    return result
