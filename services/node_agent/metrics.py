"""Prometheus metrics of the node agent (a private registry per agent, served on --metrics-port)."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge


class AgentMetrics:
    """Per GPU total / allocated / used memory and utilisation; per pod allocated vs used; outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        gpu = ["node", "gpu", "gpu_index", "model"]
        pod = ["node", "namespace", "pod"]
        r = self.registry
        self.gpu_total = Gauge("gpushare_gpu_memory_total_mib", "Schedulable GPU memory", gpu, registry=r)
        self.gpu_allocated = Gauge(
            "gpushare_gpu_memory_allocated_mib", "GPU memory held by live allocations", gpu, registry=r
        )
        self.gpu_used = Gauge("gpushare_gpu_memory_used_mib", "GPU memory used by processes", gpu, registry=r)
        self.gpu_util = Gauge("gpushare_gpu_utilization_pct", "GPU utilisation", gpu, registry=r)
        self.gpu_healthy = Gauge("gpushare_gpu_healthy", "1 when the GPU is healthy", gpu, registry=r)
        self.pod_allocated = Gauge(
            "gpushare_pod_memory_allocated_mib", "GPU memory allocated to a pod", pod, registry=r
        )
        self.pod_used = Gauge("gpushare_pod_memory_used_mib", "GPU memory a pod's processes use", pod, registry=r)
        self.pod_overuse = Gauge(
            "gpushare_pod_memory_overuse", "1 while a pod uses more than allocated past the grace", pod, registry=r
        )
        self.overuse_events = Counter(
            "gpushare_pod_memory_overuse_events", "Over-use episodes past the grace period", pod, registry=r
        )
        unallocated = ["node", "namespace", "pod", "gpu"]
        self.pod_unallocated = Gauge(
            "gpushare_pod_unallocated_gpu_use",
            "1 while a pod uses a GPU where it holds no share (past the grace): isolation was bypassed",
            unallocated,
            registry=r,
        )
        self.unallocated_events = Counter(
            "gpushare_pod_unallocated_gpu_use_events",
            "Episodes of a pod using a GPU where it holds no share",
            unallocated,
            registry=r,
        )
        self.plugin_outcomes = Counter(
            "gpushare_device_plugin_outcomes", "Allocate / PreStart outcomes", ["node", "reason"], registry=r
        )
