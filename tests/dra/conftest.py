"""The DRA tests use the end-to-end tier's fixtures (one stack with its own control plane per module); a module
sets STACK_DRA_NODES to make its last nodes DRA nodes. Modules that need a control plane carry `needs_dra`."""

from __future__ import annotations

import pytest

from devstack.cluster.releases import selected_release
from tests.e2e.conftest import api, control_plane, control_plane_binaries, namespace, stack  # noqa: F401 (fixtures)
from tests.node_agent.conftest import gateway  # noqa: F401 (fixture)

MIN_MINOR = 36  # consumable capacity and binding conditions are on by default from 1.36 (docs/dra.md)

needs_dra = pytest.mark.skipif(
    selected_release().minor < MIN_MINOR,
    reason=f"DRA with consumable capacity and binding conditions needs Kubernetes 1.{MIN_MINOR}+ "
    f"(this run: {selected_release()}); the device-plugin path is tested instead",
)
