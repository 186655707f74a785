"""Fixtures of the reliability tests (the shared PostgreSQL / NATS fixtures come from tests/conftest.py)."""

from __future__ import annotations

import os

import pytest

from shared.devcluster import ControlPlaneUnavailable, Paths, ensure_binaries


@pytest.fixture(scope="session")
def control_plane_binaries() -> Paths:
    """Paths of etcd and the kube binaries; skip (fail under CI=true) with the reason when unavailable."""
    try:
        return ensure_binaries()
    except ControlPlaneUnavailable as exc:
        msg = f"Kubernetes control plane unavailable: {exc.reason}"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(msg)
        pytest.skip(msg)
