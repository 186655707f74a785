"""Backpressure: a slow consumer (the binder paused with SIGSTOP) during a burst of reservations.

The `gpushare up` stack runs on the real control plane; the binder is frozen, then a seeded burst of GPU pods
arrives. kube-scheduler keeps calling the extender (filter, prioritize, bind), the extender keeps its
reservations and answers bind timeouts, and the `reserved` events wait in JetStream. While frozen: the binder's
durable consumer has a backlog (JetStream keeps the messages), the extender's resident memory (VmRSS from
/proc) stays flat, and its log has no storm of errors. After SIGCONT the system catches up: every pod is
bound, the invariants hold (including the container environments), the consumer's backlog is gone, and
the ledger equals a replay of the stream."""

from __future__ import annotations

import asyncio
import os
import random
import signal
import time
import uuid
from pathlib import Path

import pytest

from shared.ledger.db import make_engine
from shared.ledger.replay import wait_for_quiet
from tests.reliability.harness import check_invariants, ledger_rebuild
from tests.reliability.profile import PROFILE
from tests.reliability.test_crash import _record, consumer_backlog, drained_backlog

pytestmark = pytest.mark.e2e

RSS_GROWTH_LIMIT_KIB = 50 * 1024
ERROR_LINES_LIMIT = 20


def rss_kib(pid: int) -> int:
    """Resident memory of a process in KiB (VmRSS in /proc/<pid>/status)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise AssertionError(f"no VmRSS for pid {pid}")


def error_lines(path: Path, start: int) -> list[str]:
    """Log lines at ERROR / CRITICAL level or with a traceback, after byte offset `start`."""
    with open(path, "rb") as f:
        f.seek(start)
        text = f.read().decode(errors="replace")
    bad = ('"level": "error"', '"level": "critical"', "Traceback")
    return [ln for ln in text.splitlines() if any(b in ln for b in bad)]


async def test_paused_binder_backlog_flat_memory_and_catch_up(crash_stack) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e import helpers as h

    stack, _nats = crash_stack
    rng = random.Random(PROFILE.seed + 1)
    api = await stack.api_client()
    namespace = f"bp-{uuid.uuid4().hex[:5]}"
    await h.create_namespace(api, namespace)
    binder, extender = stack.processes["binder"], stack.processes["extender"]
    stream = stack.config.stream_name
    pods = 45 if PROFILE.soak else 30  # 1-2 GiB each: about what the stack's 64 GiB hold (all must bind)
    pause_s = 120.0 if PROFILE.soak else 25.0
    log_start = extender.log_path.stat().st_size
    rss = [rss_kib(extender.popen.pid)]
    backlog: list[tuple[int, int]] = []

    os.kill(binder.popen.pid, signal.SIGSTOP)
    started = time.monotonic()
    try:
        for i in range(pods):  # 1 or 2 GiB each: all of them fit on the 64 GiB of the two nodes
            await h.create_pod(api, namespace, h.gpu_pod(f"bp-{i}", [rng.choice([1, 1, 2])]))
        while time.monotonic() - started < pause_s:
            await asyncio.sleep(pause_s / 8)
            rss.append(rss_kib(extender.popen.pid))
            backlog.append(await consumer_backlog(stack.nats_url, stream, "binder"))
    finally:
        os.kill(binder.popen.pid, signal.SIGCONT)
    paused_s = time.monotonic() - started
    errors_while_paused = error_lines(extender.log_path, log_start)

    engine = make_engine(stack.database_url, pool_size=2)
    try:
        deadline = time.monotonic() + (300 if PROFILE.soak else 90)
        while True:
            report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
            if (report.settled and report.pending_pods == 0) or time.monotonic() > deadline:
                break
            await asyncio.sleep(2)
        caught_up_s = time.monotonic() - started - paused_s
        await wait_for_quiet(engine, timeout_s=60)
        after = await drained_backlog(stack.nats_url, stream, "binder")
    finally:
        await engine.dispose()
    rebuild = await ledger_rebuild(stack, stream)
    growth = max(rss) - rss[0]
    peak_backlog = max(p + a for p, a in backlog)
    _record(
        "backpressure-binder-paused",
        seed=PROFILE.seed + 1,
        pods_created=pods,
        paused_s=round(paused_s, 1),
        caught_up_s=round(caught_up_s, 1),
        extender_rss_kib=rss,
        binder_backlog=backlog,
        backlog_after=after,
        extender_error_lines=len(errors_while_paused),
        **report.figures(),
        rebuild_exit=rebuild.returncode,
        dead_services=stack.check_alive(),
    )
    assert peak_backlog > 0, f"JetStream held no messages for the paused binder: {backlog}"
    assert growth < RSS_GROWTH_LIMIT_KIB, f"extender RSS grew {growth} KiB while the binder was paused: {rss}"
    assert len(errors_while_paused) <= ERROR_LINES_LIMIT, "error storm:\n" + "\n".join(errors_while_paused[:20])
    assert not stack.check_alive(), f"services died: {stack.check_alive()}"
    assert not report.problems, "invariants broken after the binder resumed:\n" + "\n".join(report.problems[:20])
    assert report.pending_pods == 0 and report.bound_pods >= pods, (
        f"not caught up: {report.bound_pods} bound, {report.pending_pods} pending of {pods}"
    )
    assert report.envs_checked >= pods, f"only {report.envs_checked} of {pods} pods got their devices"
    assert after == (0, 0), f"binder consumer backlog after catching up: {after}"
    assert rebuild.returncode == 0, rebuild.stderr[-3000:]
