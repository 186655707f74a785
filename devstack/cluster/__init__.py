"""A local Kubernetes control plane (the current release, or 1.20) for development and end-to-end tests.

``ControlPlane`` runs etcd, kube-apiserver, kube-controller-manager and
kube-scheduler (optionally with a scheduler extender); ``nodes`` simulates GPU
nodes through the API.  The node helpers need ``kubernetes_asyncio`` and are
imported lazily from their own modules.
"""

from .binaries import ControlPlaneUnavailable, Paths, ensure_binaries
from .controlplane import ControlPlane, ExtenderConfig, scheduler_config, start_control_plane

__all__ = [
    "ControlPlane",
    "ControlPlaneUnavailable",
    "ExtenderConfig",
    "Paths",
    "ensure_binaries",
    "scheduler_config",
    "start_control_plane",
]
