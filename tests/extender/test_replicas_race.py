"""Three `gpushare extender` processes bind many pods onto the same two GPUs: zero overcommit, truthful answers."""

from __future__ import annotations

import asyncio
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import httpx
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from devstack.embedded import free_port
from shared.events.bus import EventBus
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocation_parts, allocations, gpus
from shared.ledger.rules import gpu_charges
from tests.extender.conftest import PREFIX, StandInBinder, add_node, bind_args, gpu_pod, names_args

REPLICAS, PODS = 3, 30


def tail(log: Path) -> str:
    return log.read_text()[-3000:]


def start_extender(cmd: list[str], log: Path, env: dict[str, str]) -> subprocess.Popen:
    return subprocess.Popen(cmd, stdout=log.open("w"), stderr=subprocess.STDOUT, env=env)


async def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + 60
    async with httpx.AsyncClient() as c:
        while time.monotonic() < deadline:
            assert proc.poll() is None, f"extender exited early:\n{tail(log)}"
            try:
                if (await c.get(f"{url}/readyz", timeout=1)).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            await asyncio.sleep(0.3)
    raise AssertionError(f"extender at {url} never became ready:\n{tail(log)}")


async def test_three_replicas_never_overcommit_and_answer_truthfully(
    engine: AsyncEngine, ledger: Ledger, bus: EventBus, database_url: str, nats_url: str, tmp_path: Path
) -> None:
    await add_node(ledger, "race", [16, 16])  # 2 x 16 GiB: at most 10 pods of 3 GiB
    binder = StandInBinder(bus, ledger)
    await binder.start()
    procs, urls, logs = [], [], []
    python = str(Path(sys.prefix) / "bin" / "python")
    try:
        for i in range(REPLICAS):
            port = free_port()
            log = tmp_path / f"extender-{i}.log"
            cmd = [
                python, "-m", "services.cli", "extender", "--host", "127.0.0.1", "--port", str(port),
                "--database-url", database_url, "--nats-url", nats_url,
                "--stream-name", bus.names.stream, "--subject-prefix", bus.names.prefix,
                "--bind-timeout", "15", "--log-format", "text", "--log-level", "WARNING", "--trust-filter-pods",
            ]  # fmt: skip
            env = {**os.environ, "KUBECONFIG": str(tmp_path / "no-kubeconfig")}
            procs.append(start_extender(cmd, log, env))
            urls.append(f"http://127.0.0.1:{port}")
            logs.append(log)
        await asyncio.gather(*(wait_ready(u, p, lg) for u, p, lg in zip(urls, procs, logs, strict=True)))

        pods = [gpu_pod(f"pod-{i}", 3) for i in range(PODS)]
        rng = random.Random(7)
        async with httpx.AsyncClient(timeout=60) as c:
            # every replica sees every pod in filter (kube-scheduler may reach any replica)
            await asyncio.gather(
                *(c.post(f"{u}{PREFIX}/filter", json=names_args(p, ["race"])) for u in urls for p in pods)
            )
            calls = [(p, rng.choice(urls)) for p in pods]
            calls += [(p, rng.choice(urls)) for p in pods[:5]]  # retried binds, racing the first ones
            rng.shuffle(calls)
            answers = await asyncio.gather(*(c.post(f"{u}{PREFIX}/bind", json=bind_args(p, "race")) for p, u in calls))
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                p.kill()
        await binder.stop()

    results: dict[str, set[str]] = {}
    for (pod, _), r in zip(calls, answers, strict=True):
        assert r.status_code == 200, r.text
        results.setdefault(pod["metadata"]["uid"], set()).add(r.json()["Error"])
    async with engine.connect() as conn:
        rows = (await conn.execute(select(allocations))).all()
        live = {r.pod_uid: r for r in rows if r.state in ("reserved", "bound", "assigned")}
        for gpu in (await conn.execute(select(gpus))).all():
            assert 0 <= gpu.allocated_memory_mib <= gpu.memory_mib
            parts = (
                await conn.execute(
                    select(allocation_parts)
                    .join(allocations, allocations.c.id == allocation_parts.c.allocation_id)
                    .where(allocations.c.state.in_(("reserved", "bound", "assigned")))
                )
            ).all()
            held = sum(m for u, (m, _) in gpu_charges(parts).items() if u == gpu.uuid)
            assert held == gpu.allocated_memory_mib
    successes = {uid for uid, errs in results.items() if errs == {""}}
    failures = {uid for uid, errs in results.items() if "" not in errs}
    assert successes | failures == set(results), "a pod got both a success and an error"
    for uid in successes:
        assert uid in live and live[uid].state == "bound", uid
    for uid in failures:
        assert uid not in live, uid
    print(f"{len(successes)} bound, {len(failures)} refused", {e[:60] for errs in results.values() for e in errs})
    assert 6 <= len(successes) <= 10, (len(successes), results)
    assert len(live) == len(successes)
