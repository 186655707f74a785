"""Fixtures for end-to-end tests against a real local Kubernetes control plane."""

from __future__ import annotations

import asyncio
import logging
import os
import uuid
from collections.abc import Iterator

import pytest

from devstack.cluster import ControlPlane, Paths
from devstack.cluster.releases import parse_release
from tests import system_tools

ADMIN_TOKEN = "e2e-admin-token"


@pytest.fixture(scope="session")
def control_plane_binaries() -> Paths:
    """Paths of etcd and the kube binaries (built/cached on first use)."""
    return system_tools.control_plane_binaries()


def storage_consistency_failure(errors: list[str], what: str) -> str:
    """The message when kube-apiserver logged storage consistency errors (`ControlPlane.storage_consistency_errors`)."""
    return f"kube-apiserver of {what} logged {len(errors)} storage consistency errors, e.g. {errors[:3]}"


@pytest.fixture(scope="session")
def control_plane(control_plane_binaries: Paths) -> Iterator[ControlPlane]:
    """A started ControlPlane with no scheduler extender, shared by the session; at teardown the session fails if
    its kube-apiserver logged storage consistency errors."""
    keep = os.environ.get("GPUSHARE_KEEP_CLUSTER") == "1"
    with system_tools.running_control_plane(control_plane_binaries, keep=keep) as cp:
        yield cp
        errors = cp.storage_consistency_errors()
        assert not errors, storage_consistency_failure(errors, f"the shared control plane ({cp.release})")


# ---------------------------------------------------------------------------------------------------------------
# The whole gpushare stack (services as subprocesses, kubelet stand-ins, simulated nodes) on its own control
# plane, one per test module. A module sets STACK_NODES / STACK_GPUS to shape its cluster, STACK_K8S ("1.20")
# to run on another Kubernetes release than the current one, STACK_USAGE_RULES to give the node agents
# simulated usage (the rules go to `<data dir>/usage.rules`, which the test may rewrite; samples every second,
# over-use reported after 2 s), STACK_CONTROLLER_MANAGER for extra kube-controller-manager flags,
# STACK_MONITORING to run Prometheus (scraping each second) and prometheus-adapter beside it, STACK_REPLICAS /
# STACK_SCHEDULERS for replicated services and kube-schedulers, STACK_SCHEDULER_EXTRA for more kube-scheduler
# configuration, STACK_BINDER for more binder flags, STACK_DRA_NODES to make that many of the nodes (the last ones)
# DRA nodes (tests/dra; STACK_DRA_GATED_NODES of them, the last ones, a gated pool), and STACK_NODES_KIND = "real"
# for real kubelets and containerds instead of stand-ins (tests/realnode). The
# scheduler configuration is the shipped one's (k8s/scheduler/): kube-scheduler counts every aliyun.com/* resource
# per node itself.


@pytest.fixture(scope="module")
async def stack(
    request: pytest.FixtureRequest,
    control_plane_binaries: Paths,
    pg_server_url: str,
    nats_url: str,
    tmp_path_factory: pytest.TempPathFactory,
):
    """A started `devstack.stack.Stack` with its own database, stream and control plane (module scope)."""
    from devstack.stack.spec import AgentUsage
    from devstack.stack.stack import MODE_LOCAL, Stack, StackConfig
    from tests.conftest import create_database, drop_database

    release = getattr(request.module, "STACK_K8S", None)
    if release is not None:
        control_plane_binaries = system_tools.control_plane_binaries(parse_release(release))
    tag = uuid.uuid4().hex[:8]
    db_name = f"gpushare_e2e_{tag}"
    database_url = await asyncio.to_thread(create_database, pg_server_url, db_name)
    data_dir = tmp_path_factory.mktemp(f"stack-{request.module.__name__.rsplit('.', 1)[-1]}")
    usage = AgentUsage()
    rules = getattr(request.module, "STACK_USAGE_RULES", None)
    if rules is not None:
        (data_dir / "usage.rules").write_text(rules)
        usage = AgentUsage(f"@{data_dir / 'usage.rules'}", interval_s=1.0, overuse_grace_s=2.0)
    config = StackConfig(
        data_dir=data_dir,
        nodes=getattr(request.module, "STACK_NODES", 1),
        gpus=getattr(request.module, "STACK_GPUS", "1x16GiB:Tesla-T4"),
        node_prefix=f"e2e-{tag[:4]}",
        extender_port=0,
        binder_port=0,
        accounting_port=0,
        bind_timeout=20.0,
        database_url=database_url,
        nats_url=nats_url,
        stream_name=f"GPUSHARE_E{tag}",
        subject_prefix=f"gse{tag}",
        log_format="json",
        log_level="INFO",
        admin_token=ADMIN_TOKEN,
        scheduler_extra={
            "podInitialBackoffSeconds": 1,
            "podMaxBackoffSeconds": 2,
            **getattr(request.module, "STACK_SCHEDULER_EXTRA", {}),
        },
        replicas=getattr(request.module, "STACK_REPLICAS", 1),
        schedulers=getattr(request.module, "STACK_SCHEDULERS", 1),
        control_plane_paths=control_plane_binaries,
        usage=usage,
        controller_manager_extra=list(getattr(request.module, "STACK_CONTROLLER_MANAGER", [])),
        monitoring=getattr(request.module, "STACK_MONITORING", False),
        dra_nodes=getattr(request.module, "STACK_DRA_NODES", 0),
        nodes_kind=getattr(request.module, "STACK_NODES_KIND", "stand-in"),
        dra_gated_nodes=getattr(request.module, "STACK_DRA_GATED_NODES", 0),
        binder_extra=list(getattr(request.module, "STACK_BINDER", [])),
        scrape_interval=1.0,
        progress=lambda m: logging.getLogger("e2e.stack").info(m),
        service_roles=True,  # each service as its own PostgreSQL role: least privilege, end to end
    )
    st = Stack(config)
    try:
        await st.start()
    except BaseException:
        await asyncio.to_thread(drop_database, pg_server_url, db_name)
        raise
    if st.mode != MODE_LOCAL:
        await st.stop()
        msg = f"the stack did not get the local control plane: {st.mode_reason}"
        if system_tools.in_ci():
            pytest.fail(msg)
        pytest.skip(msg)
    try:
        yield st
    finally:
        dead = st.check_alive()
        control_plane = st.control_plane
        errors = control_plane.storage_consistency_errors() if control_plane is not None else []
        await st.stop()
        await asyncio.to_thread(drop_database, pg_server_url, db_name)
        assert not dead, f"service processes died during the tests: {dead}"
        assert not errors, storage_consistency_failure(errors, f"{request.module.__name__}'s stack")


@pytest.fixture
async def api(stack):
    """The stack's kubernetes_asyncio ApiClient."""
    return await stack.api_client()


@pytest.fixture
async def namespace(api, request: pytest.FixtureRequest):
    """A fresh namespace per test; its pods are deleted (and the ledger released) afterwards."""
    from tests.e2e import helpers

    name = f"t-{request.node.name[:30].replace('_', '-').lower().strip('-')}-{uuid.uuid4().hex[:5]}"
    await helpers.create_namespace(api, name)
    yield name
    await helpers.delete_all_pods(api, name)
