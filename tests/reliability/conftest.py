"""Fixtures of the reliability tests (the shared PostgreSQL / NATS fixtures come from tests/conftest.py)."""

from __future__ import annotations

import asyncio
import logging
import uuid
from pathlib import Path

import pytest

from devstack.cluster import Paths
from devstack.embedded import EmbeddedNats
from tests import system_tools
from tests.e2e.conftest import stack as e2e_stack  # noqa: F401  (the e2e module stack, shaped by STACK_* names)
from tests.reliability.harness import burst_stack_config, require_complete


@pytest.fixture(scope="session")
def control_plane_binaries() -> Paths:
    """Paths of etcd and the kube binaries; skip (fail under CI=true) with the reason when unavailable."""
    return system_tools.control_plane_binaries()


log = logging.getLogger("reliability.stack")


@pytest.fixture
async def crash_stack(control_plane_binaries, tmp_path: Path):  # type: ignore[no-untyped-def]
    """The `gpushare up` stack (2 nodes x 2 Tesla-T4 16 GiB, kubelet stand-ins, node agents, extender, binder,
    accounting) on the real control plane, with its own PostgreSQL (restartable) and a NATS server this test
    controls; yields (stack, nats)."""
    from devstack.stack.stack import Stack

    nats = EmbeddedNats(tmp_path / "nats")
    nats_url = await asyncio.to_thread(nats.start)
    tag = uuid.uuid4().hex[:6]
    config = burst_stack_config(
        tmp_path / "stack",
        control_plane_binaries,
        tag=tag,
        letter="r",
        nats_url=nats_url,
        log=log,
        admin_token="reliability",
    )
    stack = Stack(config)
    try:
        await stack.start()
        require_complete(stack)
        yield stack, nats
    finally:
        # Stack.stop() lets an error of the node heartbeat's last update escape after an apiserver restart
        # (and then skips stopping the services); stop the heartbeat here first, tolerating that error.
        heartbeat, stack._heartbeat = stack._heartbeat, None
        if heartbeat is not None:
            try:
                await heartbeat.stop()
            except Exception as exc:
                log.warning("stopping the node heartbeat failed: %r", exc)
        await stack.stop()
        await asyncio.to_thread(nats.stop)
