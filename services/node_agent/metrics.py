"""Prometheus metrics of the node agent (a private registry per agent, served on --metrics-port).

One node's live view, named `gpushare_node_agent_*` so it never adds up with accounting's cluster view of the
same GPUs; GPUs carry dcgm-exporter's labels (`shared.metrics.GPU_LABELS`), amounts are bytes and ratios.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from shared.metrics import GPU_LABELS, SeriesSet

POD_LABELS = ("node", "namespace", "pod")


class AgentMetrics:
    """Per GPU total / allocated / used memory, utilisation and health; per pod allocated vs used and SM utilisation
    (only the node's live pods: `SeriesSet`); outcomes."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        gpu, pod, r = GPU_LABELS, POD_LABELS, self.registry
        self.gpu_total = Gauge("gpushare_node_agent_gpu_memory_bytes", "Schedulable GPU memory", gpu, registry=r)
        self.gpu_allocated = Gauge(
            "gpushare_node_agent_gpu_memory_allocated_bytes", "GPU memory held by live allocations", gpu, registry=r
        )
        self.gpu_used = Gauge(
            "gpushare_node_agent_gpu_memory_used_bytes", "GPU memory used by processes (NVML)", gpu, registry=r
        )
        self.gpu_util = Gauge(
            "gpushare_node_agent_gpu_utilization_ratio", "GPU utilisation, 0 to 1 (NVML)", gpu, registry=r
        )
        self.gpu_healthy = Gauge("gpushare_node_agent_gpu_healthy", "1 when the GPU is healthy", gpu, registry=r)
        self.pod_allocated = SeriesSet(
            Gauge(
                "gpushare_node_agent_pod_gpu_memory_allocated_bytes", "GPU memory allocated to a pod", pod, registry=r
            )
        )
        self.pod_used = SeriesSet(
            Gauge("gpushare_node_agent_pod_gpu_memory_used_bytes", "GPU memory a pod's processes use", pod, registry=r)
        )
        self.pod_sm = SeriesSet(
            Gauge(
                "gpushare_node_agent_pod_sm_utilization_ratio",
                "Share of a GPU's SMs a pod's processes kept busy since the previous sample, 0 to 1 (NVML's "
                "per-process utilisation); container empty when several of the pod's containers share the GPU",
                [*gpu, "namespace", "pod", "container"],
                registry=r,
            )
        )
        self.pod_overuse = SeriesSet(
            Gauge(
                "gpushare_node_agent_pod_gpu_memory_overuse",
                "1 while a pod uses more GPU memory than allocated past the grace period",
                pod,
                registry=r,
            )
        )
        self.overuse_events = Counter(
            "gpushare_node_agent_pod_gpu_memory_overuse_episodes_total",
            "Over-use episodes past the grace period",
            pod,
            registry=r,
        )
        unallocated = [*gpu, "namespace", "pod"]  # a GPU's labels (dcgm-exporter's) and the pod that reached it
        self.pod_unallocated = Gauge(
            "gpushare_node_agent_pod_unallocated_gpu_use",
            "1 while a pod uses a GPU where it holds no share (past the grace): isolation was bypassed",
            unallocated,
            registry=r,
        )
        self.unallocated_events = Counter(
            "gpushare_node_agent_pod_unallocated_gpu_use_episodes_total",
            "Episodes of a pod using a GPU where it holds no share",
            unallocated,
            registry=r,
        )
        self.plugin_calls = Counter(
            "gpushare_node_agent_device_plugin_calls_total",
            "kubelet's calls of the device plugins (Allocate, PreStartContainer), per resource",
            ["node", "resource", "call"],
            registry=r,
        )
        self.plugin_outcomes = Counter(
            "gpushare_node_agent_device_plugin_outcomes_total",
            "Allocate / PreStartContainer outcomes",
            ["node", "reason"],
            registry=r,
        )
        self.dra_prepares = Counter(
            "gpushare_node_agent_dra_prepares_total",
            "NodePrepareResources per claim: prepared, or refused (the message went to kubelet)",
            ["node", "outcome"],
            registry=r,
        )
        self.dra_ledger_wait = Histogram(
            "gpushare_node_agent_dra_prepare_ledger_wait_seconds",
            "How long NodePrepareResources waited for the ledger to hold the claim's allocation on this node "
            "(0 when it did at once; a claim still not held at the end is refused and kubelet retries)",
            ["node"],
            buckets=(0.0, 0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0),
            registry=r,
        )
