"""The real-node tier: gpushare on real kubelets v1.37.2, containerd and runc, with real containers.

Each module gets its own stack (`tests/e2e/conftest.py`'s `stack` fixture with `STACK_NODES_KIND = "real"`): one
control plane and its real nodes for the whole module. Where the machine cannot run containers (not root, no
cgroups, no overlayfs) or the node binaries cannot be built, every test of the tier is skipped with the reason (never
reported as passed); `GPUSHARE_REQUIRE_REAL_NODES=1` makes that a failure instead (a CI that must run them).
"""

from __future__ import annotations

import os

import pytest

from devstack.cluster import Paths
from devstack.cluster.buildtools import ControlPlaneUnavailable
from tests import system_tools
from tests.e2e.conftest import api, namespace, stack  # noqa: F401  (the e2e tier's module-scoped stack)
from tests.e2e.test_up import up_database  # noqa: F401  (a database for `gpushare up`)

REQUIRE_ENV = "GPUSHARE_REQUIRE_REAL_NODES"


def real_nodes_unavailable(reason: str) -> None:
    """Skip the test with `reason` (or fail, when real nodes are required here)."""
    message = f"real nodes cannot run here: {reason}"
    if os.environ.get(REQUIRE_ENV) == "1":
        pytest.fail(message)
    pytest.skip(message)


@pytest.fixture(scope="session")
def real_node_reason() -> str:
    """'' when real nodes can run here (their binaries built and cached on first use), else why not."""
    from devstack.cluster.node_build import ensure_node_binaries
    from devstack.cluster.realnode import can_run_real_nodes

    why = can_run_real_nodes()
    if why:
        return why
    try:
        ensure_node_binaries()
    except ControlPlaneUnavailable as exc:
        return f"the node binaries cannot be built: {exc.reason}"
    return ""


@pytest.fixture(scope="session")
def control_plane_binaries(real_node_reason: str) -> Paths:
    """The control plane's binaries, once real nodes are known to be possible (the e2e `stack` fixture asks for
    this first, so a machine without them skips before any stack starts)."""
    if real_node_reason:
        real_nodes_unavailable(real_node_reason)
    return system_tools.control_plane_binaries()
