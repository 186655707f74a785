"""Metric names, labels and values on /metrics."""

from __future__ import annotations

from prometheus_client.parser import text_string_to_metric_families

from .conftest import GIB, Stack

MIB = 1024 * 1024


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


async def test_metrics_names_and_values(seeded: Stack) -> None:
    r = await seeded.client.get("/metrics")
    assert r.status_code == 200
    m = _samples(r.text)
    assert m[("gpushare_node_gpu_memory_bytes", (("Hostname", "node-0"), ("node", "node-0")))] == 30 * GIB * MIB
    assert (
        m[("gpushare_node_gpu_memory_allocated_bytes", (("Hostname", "node-1"), ("node", "node-1")))] == 8 * GIB * MIB
    )
    # dcgm-exporter's labels: gpu = index, UUID, modelName, Hostname (beside Kubernetes' node)
    gpu = (("Hostname", "node-0"), ("UUID", "GPU-0-0"), ("gpu", "0"), ("modelName", "Tesla-T4"), ("node", "node-0"))
    assert m[("gpushare_gpu_memory_bytes", gpu)] == 15 * GIB * MIB
    assert m[("gpushare_gpu_memory_allocated_bytes", gpu)] == 2 * GIB * MIB
    assert m[("gpushare_gpu_memory_used_bytes", gpu)] == 1200 * MIB
    assert m[("gpushare_namespace_gpu_memory_allocated_bytes", (("namespace", "team-a"),))] == 4 * GIB * MIB
    pending = {k[1]: v for k, v in m.items() if k[0] == "gpushare_pending_pods"}
    assert pending == {
        (("reason", "needs N GiB on one GPU"),): 1,
        (("reason", "needs N GiB on one GPU, largest free N GiB"),): 1,
    }
    bert = (("namespace", "team-a"), ("pod", "bert-1"), ("workload", "bert"), ("workload_kind", "Deployment"))
    assert abs(m[("gpushare_pod_gpu_memory_usage_ratio", bert)] - 1200 / 2048) < 1e-9
    train = (("namespace", "team-b"), ("pod", "train-0"), ("workload", "train"), ("workload_kind", "Job"))
    assert m[("gpushare_pod_gpu_memory_usage_ratio", train)] == 0.75
    # Latency histograms observed from the events: 3 bindings, 2 first assignments.
    assert m[("gpushare_reserved_to_bound_seconds_count", ())] == 3
    assert m[("gpushare_bound_to_assigned_seconds_count", ())] == 2
    assert m[("gpushare_reserved_to_bound_seconds_sum", ())] >= 0
    assert m[("gpushare_accounting_events_applied_total", ())] == 0  # counted by the service's handler only

    # Every metric uses the prefix and the project's label names.
    allowed = {"node", "Hostname", "gpu", "UUID", "modelName", "namespace", "pod", "reason", "le"}
    allowed |= {"outcome", "workload_kind", "workload"}
    families = list(text_string_to_metric_families(r.text))
    assert {f.name for f in families} >= {
        "gpushare_node_gpu_memory_bytes",
        "gpushare_node_gpu_memory_allocated_bytes",
        "gpushare_node_gpus",
        "gpushare_gpu_memory_bytes",
        "gpushare_gpu_memory_allocated_bytes",
        "gpushare_gpu_memory_used_bytes",
        "gpushare_namespace_gpu_memory_allocated_bytes",
        "gpushare_namespace_gpu_memory_quota_bytes",
        "gpushare_pending_pods",
        "gpushare_pod_gpu_memory_usage_ratio",
        "gpushare_reserved_to_bound_seconds",
        "gpushare_bound_to_assigned_seconds",
        "gpushare_accounting_events_applied",
    }
    for family in families:
        assert family.name.startswith("gpushare_"), family.name
        for sample in family.samples:
            assert set(sample.labels) <= allowed, (family.name, sample.labels)
