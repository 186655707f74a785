"""Fixtures for the deployment checks: kubectl, the rendered kustomizations, real control planes (current, 1.20)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from devstack.cluster import ControlPlane, Paths
from tests.deploy.tools import KUSTOMIZATIONS, ensure_kubectl, render
from tests.system_tools import compat_binaries, control_plane_binaries, running_control_plane


@pytest.fixture(scope="session")
def kubectl() -> str:
    """Path of kubectl (installed from Debian's kubernetes-client when missing)."""
    return ensure_kubectl()


@pytest.fixture(scope="session")
def rendered(kubectl: str) -> dict[str, list[dict[str, Any]]]:
    """Every kustomization rendered once: name -> objects."""
    return {name: render(kubectl, name) for name in KUSTOMIZATIONS}


@pytest.fixture(scope="session")
def k8s_binaries() -> Paths:
    """etcd and the current Kubernetes release's binaries (built and cached on first use)."""
    return control_plane_binaries()


@pytest.fixture(scope="session")
def k8s_1_20_binaries() -> Paths:
    """etcd and the Kubernetes 1.20 binaries of the compatibility run."""
    return compat_binaries()


@pytest.fixture(scope="session")
def apiserver(k8s_binaries: Paths) -> Iterator[ControlPlane]:
    """A real current kube-apiserver (with scheduler and controller-manager) for server-side dry runs."""
    with running_control_plane(k8s_binaries, keep=os.environ.get("GPUSHARE_KEEP_CLUSTER") == "1") as cp:
        yield cp


@pytest.fixture(scope="session")
def apiserver_1_20(k8s_1_20_binaries: Paths) -> Iterator[ControlPlane]:
    """A real kube-apiserver 1.20 (with scheduler and controller-manager) for the compatibility checks."""
    with running_control_plane(k8s_1_20_binaries) as cp:
        yield cp
