"""Fault test: a `gpushare binder` process killed with SIGKILL mid-batch, then restarted.

Every reserved pod must end bound exactly once (one Binding, one `bound` event) or, when its pod was
deleted meanwhile, failed/released, and the ledger must match the cluster.
"""

from __future__ import annotations

import asyncio
import contextlib
import signal
import subprocess
import sys
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from devstack.cluster.controlplane import free_ports
from shared.annotations import ALLOCATION, parse_allocation
from shared.ledger.models import allocations, outbox
from tests.binder.conftest import GIB, allocation, gpu_usage, request_for, state_becomes
from tests.waiting import eventually, stream_events

pytestmark = pytest.mark.e2e

PODS = 30


def _start(env: dict[str, str], port: int, log: Path) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "services.cli", "binder", "--port", str(port), "--concurrency", "1"]
    cmd += ["--reserve-grace", "2", "--reconcile-interval", "2"]
    with log.open("ab") as fh:
        return subprocess.Popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT, cwd=Path(__file__).parents[2])


async def _ready(port: int) -> bool:
    try:
        async with httpx.AsyncClient() as http:
            return (await http.get(f"http://127.0.0.1:{port}/readyz", timeout=2)).status_code == 200
    except httpx.HTTPError:
        return False


async def test_kill_mid_batch_and_restart(cluster, ledger, engine, bus, binder_env, tmp_path) -> None:
    node = await cluster.node(ledger)
    pods = [await cluster.pod(gib=1) for _ in range(PODS)]
    reservations = {
        p.metadata.uid: await ledger.reserve(request_for(p, node, gib=1, gpu=i % 2)) for i, p in enumerate(pods)
    }
    env = binder_env
    log = tmp_path / "binder.log"
    port = free_ports(1)[0]

    async def bound_names() -> set[str]:
        listed = await cluster.core.list_namespaced_pod("default")
        return {p.metadata.name for p in listed.items if p.spec.node_name == node.name}

    first = _start(env, port, log)
    try:
        await eventually(lambda: _at_least(bound_names, 3), what="first bindings", within=60, interval=0.02)
    finally:
        first.send_signal(signal.SIGKILL)
        first.wait(10)
    at_kill = await bound_names()
    assert 3 <= len(at_kill) < PODS, f"kill was not mid-batch ({len(at_kill)} bound)\n{log.read_text()[-3000:]}"

    # while the binder is dead: three waiting pods and one bound pod disappear
    waiting = [p for p in pods if p.metadata.name not in at_kill][:3]
    gone_bound = next(p for p in pods if p.metadata.name in at_kill)
    deleted = {p.metadata.uid for p in [*waiting, gone_bound]}
    for p in [*waiting, gone_bound]:
        await cluster.delete_pod(p.metadata.name, grace=0)

    second = _start(env, port, log)
    try:
        await eventually(lambda: _ready(port), what="restarted binder ready", within=60)
        await eventually(lambda: _settled(engine), what="no reservation left pending", within=60)
        async with httpx.AsyncClient() as http:
            metrics = (await http.get(f"http://127.0.0.1:{port}/metrics", timeout=5)).text
        assert "gpushare_binder_bindings_total" in metrics
        await eventually(lambda: _outbox_empty(engine), what="outbox drained", within=20)
    finally:
        second.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            second.wait(20)
        if second.poll() is None:
            second.kill()
            second.wait(5)
    assert second.returncode == 0, log.read_text()[-3000:]

    async with engine.connect() as conn:
        rows = {r.id: r for r in (await conn.execute(select(allocations))).all()}
    listed = {p.metadata.uid: p for p in (await cluster.core.list_namespaced_pod("default")).items}
    expected_usage = {node.gpus[0]: 0, node.gpus[1]: 0}
    for uid, res in reservations.items():
        row = rows[res.allocation_id]
        if uid in deleted:
            assert row.state in ("failed", "released"), (uid, row.state)
            continue
        assert row.state == "bound", (uid, row.state, row.reason)
        pod = listed[uid]
        assert pod.spec.node_name == node.name
        allocation_id, _, parts = parse_allocation(pod.metadata.annotations[ALLOCATION])
        assert allocation_id == res.allocation_id
        expected_usage[parts[0].gpu_uuid] += GIB
    assert await gpu_usage(engine, node) == expected_usage
    live_uids = {r.pod_uid for r in rows.values() if r.state in ("reserved", "bound", "assigned")}
    assert live_uids == {uid for uid, p in listed.items() if p.spec.node_name == node.name}

    bound_ids = [e.allocation_id for e in await stream_events(bus, "bound")]
    expected_bound = {r.allocation_id for uid, r in reservations.items() if uid not in deleted}
    assert len(bound_ids) == len(set(bound_ids)), "an allocation was marked bound twice"
    assert expected_bound <= set(bound_ids)
    assert set(bound_ids) <= expected_bound | {reservations[gone_bound.metadata.uid].allocation_id}


async def _at_least(fn, n: int):  # type: ignore[no-untyped-def]
    return len(await fn()) >= n


async def _settled(engine) -> bool:  # type: ignore[no-untyped-def]
    async with engine.connect() as conn:
        pending = (await conn.execute(select(func.count()).where(allocations.c.state == "reserved"))).scalar()
    return pending == 0


async def _outbox_empty(engine) -> bool:  # type: ignore[no-untyped-def]
    async with engine.connect() as conn:
        return (await conn.execute(select(func.count()).select_from(outbox))).scalar() == 0


async def test_api_server_outage_loses_nothing(cluster, ledger, engine, start_binder, control_plane) -> None:
    binder = await start_binder()
    node = await cluster.node(ledger)
    pod = await cluster.pod(gib=2)

    await asyncio.to_thread(control_plane.stop_component, "kube-apiserver", 2)
    try:
        res = await ledger.reserve(request_for(pod, node, gib=2))
        await eventually(
            lambda: binder.metrics.value("gpushare_binder_kube_retries_total") >= 2,
            what="the binder retrying against the stopped API server, twice",
        )
        assert (await allocation(engine, res.allocation_id)).state == "reserved"  # waiting, not failed
    finally:
        await asyncio.to_thread(control_plane.start_component, "kube-apiserver")

    await state_becomes(engine, res, "bound", within=60)
    assert (await cluster.read(pod.metadata.name)).spec.node_name == node.name
    # the pod watch reconnects too (on its own backoff, which may trail the bind): once it shows the bound pod, a
    # deletion is seen (a relist does not report pods deleted while it was away; reconciliation would, later)
    await eventually(
        lambda: (
            (seen := binder.pods.get(pod.metadata.namespace, pod.metadata.name)) is not None
            and seen["spec"]["nodeName"] == node.name
        ),
        what="the pod watch back, showing the bound pod",
        within=30,
    )
    await cluster.delete_pod(pod.metadata.name, grace=0)
    row = await state_becomes(engine, res, "released", within=30)
    assert row.reason == "pod deleted"
