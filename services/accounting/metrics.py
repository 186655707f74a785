"""Accounting's Prometheus metrics: ledger gauges computed on scrape, latencies observed from events."""

from __future__ import annotations

import re
import time
from collections import Counter as Tally
from collections.abc import Iterable
from dataclasses import dataclass, field

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.metrics import GPU_LABELS, NODE_LABELS, gpu_labels, mib_to_bytes, node_labels

from . import queries
from .pending_pods import pending_items
from .scheduling import WAIT_BUCKETS, SchedulingWaits

LATENCY_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300)


def reason_label(text: str) -> str:
    """A bounded-cardinality label for a refusal reason: numbers become N, at most 100 characters."""
    return re.sub(r"\d+(\.\d+)?", "N", text.strip())[:100] or "unknown"


@dataclass
class Snapshot:
    """Gauge values read from the ledger and projections."""

    nodes: list[str] = field(default_factory=list)  # in service, by name
    gpus: list[queries.GpuGauge] = field(default_factory=list)  # their GPUs in service, by node and index
    namespaces: dict[str, tuple[int, int]] = field(default_factory=dict)
    quotas: list[dict] = field(default_factory=list)
    pending_by_reason: dict[str, int] = field(default_factory=dict)
    pod_ratios: list[queries.PodRatio] = field(default_factory=list)


class LedgerCollector(Collector):
    """Yields gauges from the latest snapshot (refreshed before each scrape)."""

    def __init__(self) -> None:
        self.snapshot = Snapshot()

    def collect(self) -> Iterable[Metric]:
        # One family at a time: at 5,000 nodes x 8 GPUs each per-GPU family is 40,000 samples, and /metrics
        # renders each family as it comes (shared.http.exposition), so only one is held at once.
        s = self.snapshot
        per_node: dict[str, list[int]] = {}  # node -> [memory, allocated, GPUs]
        for node, _index, _uuid, _model, memory, allocated, _used in s.gpus:
            sums = per_node.setdefault(node, [0, 0, 0])
            sums[0] += memory
            sums[1] += allocated
            sums[2] += 1
        node_families = (
            ("gpushare_node_gpu_memory_bytes", "Schedulable GPU memory of a node", 0, mib_to_bytes),
            ("gpushare_node_gpu_memory_allocated_bytes", "GPU memory allocated on a node", 1, mib_to_bytes),
            ("gpushare_node_gpus", "GPUs of a node in the ledger", 2, int),
        )
        for name, help_text, column, scale in node_families:
            family = GaugeMetricFamily(name, help_text, labels=NODE_LABELS)
            for node in s.nodes:
                family.add_metric(node_labels(node), scale(per_node.get(node, (0, 0, 0))[column]))
            yield family
        gpu_families = (
            ("gpushare_gpu_memory_bytes", "Schedulable memory of a GPU", 4),
            ("gpushare_gpu_memory_allocated_bytes", "Memory of a GPU held by live allocations", 5),
            ("gpushare_gpu_memory_used_bytes", "Memory of a GPU in use at its latest usage sample", 6),
        )
        for name, help_text, column in gpu_families:
            family = GaugeMetricFamily(name, help_text, labels=GPU_LABELS)
            for row in s.gpus:
                if row[column] is not None:
                    family.add_metric(gpu_labels(*row[:4]), mib_to_bytes(row[column]))  # type: ignore[arg-type]
            yield family
        ns_alloc = GaugeMetricFamily(
            "gpushare_namespace_gpu_memory_allocated_bytes", "GPU memory a namespace holds", labels=["namespace"]
        )
        for ns, (mem, _compute) in sorted(s.namespaces.items()):
            ns_alloc.add_metric([ns], mib_to_bytes(mem))
        ns_quota = GaugeMetricFamily(
            "gpushare_namespace_gpu_memory_quota_bytes", "A namespace's GPU memory quota", labels=["namespace"]
        )
        for q in s.quotas:
            if q["memory_mib"] is not None:
                ns_quota.add_metric([q["namespace"]], mib_to_bytes(q["memory_mib"]))
        pending = GaugeMetricFamily(
            "gpushare_pending_pods",
            "GPU pods waiting for a node, by reason (the extender's, or kube-scheduler's own message)",
            labels=["reason"],
        )
        for reason, count in sorted(s.pending_by_reason.items()):
            pending.add_metric([reason], count)
        ratio = GaugeMetricFamily(
            "gpushare_pod_gpu_memory_usage_ratio",
            "Used / allocated GPU memory of a pod at its latest usage sample, with its workload (for an HPA through "
            "a metrics adapter: a Pods metric, or the External metric aliyun_gpu_mem_usage selected by workload)",
            labels=["namespace", "pod", "workload_kind", "workload"],
        )
        for ns, pod, kind, workload, value in s.pod_ratios:
            ratio.add_metric([ns, pod, kind, workload], value)
        yield from (ns_alloc, ns_quota, pending, ratio)


class AccountingMetrics:
    """Every metric accounting exports, in its own registry."""

    def __init__(self, registry: CollectorRegistry | None = None, *, min_refresh_s: float = 1.0) -> None:
        self.registry = registry or CollectorRegistry()
        self.collector = LedgerCollector()
        self.registry.register(self.collector)
        self.min_refresh_s = min_refresh_s
        self._refreshed = 0.0
        self.reserved_to_bound = Histogram(
            "gpushare_reserved_to_bound_seconds",
            "Time from an allocation's reservation to its pod's Binding",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.bound_to_assigned = Histogram(
            "gpushare_bound_to_assigned_seconds",
            "Time from a pod's Binding to its first container receiving its GPU",
            buckets=LATENCY_BUCKETS,
            registry=self.registry,
        )
        self.scheduling_wait = Histogram(
            "gpushare_scheduling_wait_seconds",
            "Time from a GPU pod's creation to its Binding (outcome bound), or to its deletion while unbound "
            "(outcome deleted), from the pod's own timestamps (whole seconds)",
            labelnames=["namespace", "outcome"],
            buckets=WAIT_BUCKETS,
            registry=self.registry,
        )
        self.events_applied = Counter(
            "gpushare_accounting_events_applied_total",
            "Events applied to accounting's projections",
            registry=self.registry,
        )
        self.pruned_rows = Counter(
            "gpushare_accounting_pruned_rows_total",
            "Rows housekeeping deleted (usage samples thinned or expired, old claims, old refusals)",
            labelnames=["table"],
            registry=self.registry,
        )
        self.housekeeping_failures = Counter(
            "gpushare_accounting_housekeeping_failures_total",
            "Housekeeping steps that failed (retried on their next turn)",
            labelnames=["task"],
            registry=self.registry,
        )
        self.snapshot_sequence = Gauge(
            "gpushare_ledger_snapshot_sequence",
            "Ledger stream sequence the newest ledger snapshot covers",
            registry=self.registry,
        )
        self.snapshot_success = Gauge(
            "gpushare_ledger_snapshot_last_success_timestamp_seconds",
            "When the ledger snapshot was last brought up to date (Unix time)",
            registry=self.registry,
        )
        self.stream_trimmed = Counter(
            "gpushare_ledger_stream_trimmed_events_total",
            "Ledger stream events purged because a snapshot covers them and every durable consumer read them",
            registry=self.registry,
        )

    def observe_snapshot(self, sequence: int, trimmed: int) -> None:
        """Record a snapshot brought up to date (and what it trimmed)."""
        self.snapshot_sequence.set(sequence)
        self.snapshot_success.set(time.time())
        self.stream_trimmed.inc(trimmed)

    def observe_wait(self, namespace: str, outcome: str, seconds: float) -> None:
        """Record a GPU pod's scheduling wait (`scheduling.SchedulingWaits`)."""
        self.scheduling_wait.labels(namespace=namespace, outcome=outcome).observe(seconds)

    def observe_latency(self, name: str, seconds: float) -> None:
        """Record a life-cycle latency reported by the projector."""
        if name == "reserved_to_bound":
            self.reserved_to_bound.observe(seconds)
        elif name == "bound_to_assigned":
            self.bound_to_assigned.observe(seconds)

    async def refresh(
        self,
        engine: AsyncEngine,
        *,
        force: bool = False,
        owners: queries.OwnerLookup | None = None,
        scheduling: SchedulingWaits | None = None,
    ) -> None:
        """Read the gauges' values from the database (at most once per `min_refresh_s` unless forced; `owners`
        names pods' workloads, a ReplicaSet's by its Deployment; `scheduling` adds the pods kube-scheduler refused
        before the extender saw them)."""
        if not force and time.monotonic() - self._refreshed < self.min_refresh_s:
            return
        async with engine.connect() as conn:
            pending = await pending_items(conn, scheduling)
            tally: Tally[str] = Tally()
            for p in pending:
                texts = set(p["reasons"].values()) or {p["summary"]}
                for reason in {reason_label(t) for t in texts}:
                    tally[reason] += 1
            names, gpu_rows = await queries.gpu_gauges(conn)
            self.collector.snapshot = Snapshot(
                nodes=names,
                gpus=gpu_rows,
                namespaces=await queries.namespace_allocated(conn),
                quotas=await queries.list_quotas(conn),
                pending_by_reason=dict(tally),
                pod_ratios=await queries.pod_usage_ratios(conn, owners=owners or queries.as_recorded),
            )
        self._refreshed = time.monotonic()
