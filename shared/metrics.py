"""Prometheus conventions every gpushare service follows (docs/metrics.md): base units (bytes, ratios 0-1),
`_total` on counters, and dcgm-exporter's label names for GPUs, so gpushare's series join with dcgm-exporter's
(`* on (UUID)`, `by (Hostname, gpu)`) on a GPU dashboard.
"""

from __future__ import annotations

BYTES_PER_MIB = 1024 * 1024

NODE_LABELS = ("node", "Hostname")
"""A node's series: `node` (Kubernetes' name) and `Hostname` (dcgm-exporter's name for it; the same value, as
dcgm-exporter reports when it runs with NODE_NAME, the default of its Helm chart)."""

GPU_LABELS = (*NODE_LABELS, "gpu", "UUID", "modelName")
"""A GPU's series, as dcgm-exporter labels them: `gpu` is the index on the node, `UUID` the GPU's UUID (the
join key), `modelName` the model NVML reports."""


def node_labels(node: str) -> tuple[str, str]:
    """Label values of NODE_LABELS."""
    return (node, node)


def gpu_labels(node: str, index: int, uuid: str, model: str) -> tuple[str, ...]:
    """Label values of GPU_LABELS."""
    return (*node_labels(node), str(index), uuid, model)


def mib_to_bytes(mib: float) -> float:
    """The ledger's MiB in bytes, Prometheus' base unit."""
    return mib * BYTES_PER_MIB


def percent_to_ratio(percent: float) -> float:
    """A percentage (NVML's utilisation) as a ratio between 0 and 1."""
    return min(max(percent / 100.0, 0.0), 1.0)
