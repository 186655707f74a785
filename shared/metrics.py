"""Prometheus conventions every gpushare service follows (docs/metrics.md): base units (bytes, ratios 0-1),
`_total` on counters, and dcgm-exporter's label names for GPUs, so gpushare's series join with dcgm-exporter's
(`* on (UUID)`, `by (Hostname, gpu)`) on a GPU dashboard.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from prometheus_client import Gauge

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


class SeriesSet:
    """A labelled gauge whose series are published as a whole: each `publish` sets the series it is given and
    removes the ones of earlier calls it no longer holds, so a pod that ended leaves no series behind (neither a
    stale value on a dashboard nor a series that lives as long as the process)."""

    def __init__(self, gauge: Gauge) -> None:
        self.gauge = gauge
        self._children: dict[tuple[str, ...], Any] = {}

    def publish(self, values: Mapping[tuple[str, ...], float]) -> None:
        """Make `values` (label values -> value) the gauge's whole set of series."""
        for labels in [k for k in self._children if k not in values]:
            del self._children[labels]
            self.gauge.remove(*labels)
        for labels, value in values.items():
            child = self._children.get(labels)
            if child is None:
                child = self._children[labels] = self.gauge.labels(*labels)
            child.set(value)
