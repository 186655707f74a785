"""Fixtures for the deployment checks: kubectl, the rendered kustomizations, a real 1.20 control plane."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from shared.devcluster import ControlPlane, ControlPlaneUnavailable, Paths, ensure_binaries
from tests.deploy.tools import KUSTOMIZATIONS, ensure_kubectl, render, unavailable


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
    """etcd and the Kubernetes 1.20 binaries from shared/devcluster (built and cached on first use)."""
    try:
        return ensure_binaries()
    except ControlPlaneUnavailable as exc:
        unavailable(f"Kubernetes 1.20 binaries unavailable: {exc.reason}")
        raise


@pytest.fixture(scope="session")
def apiserver(k8s_binaries: Paths) -> Iterator[ControlPlane]:
    """A real kube-apiserver 1.20 (with scheduler and controller-manager) for server-side dry runs."""
    cp = ControlPlane(paths=k8s_binaries, keep=os.environ.get("GPUSHARE_KEEP_CLUSTER") == "1")
    try:
        cp.start()
    except ControlPlaneUnavailable as exc:
        unavailable(f"Kubernetes control plane failed to start: {exc.reason}")
    try:
        yield cp
    finally:
        cp.stop()
