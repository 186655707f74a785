"""Fixtures for end-to-end tests against a real local Kubernetes control plane."""

from __future__ import annotations

import os
from collections.abc import Iterator

import pytest

from shared.devcluster import ControlPlane, ControlPlaneUnavailable, Paths, ensure_binaries


def _binaries_or_skip() -> Paths:
    """Obtain binaries; fail under CI=true, otherwise skip with the exact reason."""
    try:
        return ensure_binaries()
    except ControlPlaneUnavailable as exc:
        msg = f"Kubernetes control plane unavailable: {exc.reason}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)


@pytest.fixture(scope="session")
def control_plane_binaries() -> Paths:
    """Paths of etcd and the kube binaries (built/cached on first use)."""
    return _binaries_or_skip()


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries: Paths) -> Iterator[ControlPlane]:
    """A started ControlPlane with no scheduler extender, shared by the session."""
    cp = ControlPlane(paths=control_plane_binaries, keep=os.environ.get("GPUSHARE_KEEP_CLUSTER") == "1")
    try:
        cp.start()
    except ControlPlaneUnavailable as exc:
        msg = f"Kubernetes control plane failed to start: {exc.reason}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield cp
    finally:
        cp.stop()
