"""Backpressure: a slow, throttling kube-apiserver during a burst of GPU pods.

The `gpushare up` stack runs on the real control plane; the binder is restarted with a kubeconfig that points it
at `ThrottleProxy`, a TLS-terminating reverse proxy in front of the real kube-apiserver (kube-scheduler, the
node agents and the test itself keep talking to the apiserver directly). While the pressure is on, every request
of the binder waits 300-500 ms and 30 % of its short requests are answered 429 with `Retry-After: 1`, as an
overloaded apiserver's in-flight limiter does; its watches stream through. A seeded burst of pods (15 % of them
deleted again on the way) arrives meanwhile. While throttled: the binder's resident memory stays flat, its
in-flight work stays within its `--concurrency` (the JetStream consumer's unacked messages; the rest waits in
JetStream), and it retries the 429s (its `gpushare_binder_kube_retries_total` rises) without parking or failing
any reservation for them. After the pressure ends the system catches up: every pod is bound within a deadline,
the invariants hold (including the container environments), the consumer's backlog is gone, and the ledger
equals a replay of the stream."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import random
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from shared.ledger.db import make_engine
from shared.ledger.replay import wait_for_quiet
from tests.reliability.harness import check_invariants, ledger_rebuild
from tests.reliability.profile import PROFILE
from tests.reliability.test_backpressure import error_lines, rss_kib
from tests.reliability.test_crash import _record, drained_backlog
from tests.reliability.throttle_proxy import Pressure, ThrottleProxy

pytestmark = pytest.mark.e2e

BINDER_CONCURRENCY = 2  # small, so that the burst queues in JetStream (not in the binder) and outlasts the pressure
PRESSURE = Pressure(delay_s=(0.3, 0.5), reject_fraction=0.3, retry_after_s=1)
RSS_GROWTH_LIMIT_KIB = 20 * 1024
ERROR_LINES_LIMIT = 0
DELETE_FRACTION = 0.15


def nak_lines(path: Path, start: int) -> int:
    """How many reservations the binder gave back to JetStream for a later redelivery (its retries of a call
    were all throttled): such a message stays unacked until redelivered, next to `--concurrency` running ones."""
    with open(path, "rb") as f:
        f.seek(start)
        return f.read().decode(errors="replace").count("consumer binder: handling reserved")


def proxied_kubeconfig(kubeconfig: Path, server: str, out: Path) -> Path:
    """A copy of the cluster's kubeconfig (same token, TLS verification skipped) whose server is `server`."""
    config = json.loads(kubeconfig.read_text())
    for cluster in config["clusters"]:
        cluster["cluster"]["server"] = server
    out.write_text(json.dumps(config, indent=2))
    out.chmod(0o600)
    return out


async def restart_binder(stack, kubeconfig: Path, concurrency: int) -> None:  # type: ignore[no-untyped-def]
    """Stop the stack's binder and start it again with `--kubeconfig kubeconfig --concurrency N`, ready."""
    binder = stack.processes["binder"]
    argv = list(binder.command.argv)
    argv[argv.index("--kubeconfig") + 1] = str(kubeconfig)
    binder.command = dataclasses.replace(binder.command, argv=[*argv, "--concurrency", str(concurrency)])
    await asyncio.to_thread(binder.stop)
    binder.start()
    await binder.wait_ready(60)


async def binder_metrics(binder_url: str) -> dict[str, float]:
    """The binder's Prometheus samples as {`name{label=value}`: value}."""
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(binder_url + "/metrics")).text
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
            out[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
    return out


async def consumer_state(nats_url: str, stream: str, durable: str) -> dict[str, int]:
    """num_pending, num_ack_pending, num_redelivered and the configured max_ack_pending of a durable."""
    import nats

    nc = await nats.connect(nats_url)
    try:
        info = await nc.jetstream().consumer_info(stream, durable)
        return {
            "pending": info.num_pending,
            "ack_pending": info.num_ack_pending,
            "redelivered": info.num_redelivered,
            "max_ack_pending": info.config.max_ack_pending,
        }
    finally:
        await nc.close()


async def create_burst(
    api: Any, namespace: str, pods: int, seconds: float, rng: random.Random
) -> tuple[list[str], int]:
    """Create `pods` seeded 1-2 GiB GPU pods spread over about `seconds`, deleting an earlier one after ~15 %
    of them; returns the remaining names and how many were deleted."""
    from tests.e2e import helpers as h

    created: list[str] = []
    deleted = 0
    for i in range(pods):
        name = f"slow-{i}"
        await h.create_pod(api, namespace, h.gpu_pod(name, [rng.choice([1, 1, 2])]))
        created.append(name)
        if rng.random() < DELETE_FRACTION:
            await h.delete_pod(api, namespace, created.pop(rng.randrange(len(created))))
            deleted += 1
        await asyncio.sleep(rng.uniform(0, 2 * seconds / pods))
    return created, deleted


async def test_slow_throttling_apiserver_bounded_binder_and_catch_up(crash_stack, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    from tests.e2e import helpers as h

    stack, _nats = crash_stack
    cluster = stack.control_plane
    certs = cluster.work_dir / "certs"
    seed = PROFILE.seed + 2
    rng = random.Random(seed)
    proxy = ThrottleProxy(cluster.server_url, certs / "apiserver.crt", certs / "apiserver.key", seed=seed)
    await proxy.start()
    phases: dict[str, float] = {}
    clock = time.monotonic()
    try:
        kubeconfig = proxied_kubeconfig(cluster.kubeconfig_path, proxy.url, tmp_path / "throttled-kubeconfig")
        await restart_binder(stack, kubeconfig, BINDER_CONCURRENCY)
        phases["binder_restart_s"] = time.monotonic() - clock
        binder = stack.processes["binder"]
        through_proxy_before = proxy.counts["requests"]
        api = await stack.api_client()
        namespace = f"slow-{uuid.uuid4().hex[:5]}"
        await h.create_namespace(api, namespace)
        stream = stack.config.stream_name
        log_start = binder.log_path.stat().st_size
        rss = [rss_kib(binder.popen.pid)]
        samples: list[dict[str, int]] = []

        proxy.pressure = PRESSURE
        started = time.monotonic()
        try:
            burst = asyncio.create_task(
                create_burst(api, namespace, PROFILE.throttle_pods, PROFILE.throttle_seconds / 2, rng)
            )
            while time.monotonic() - started < PROFILE.throttle_seconds:
                await asyncio.sleep(1.0)
                rss.append(rss_kib(binder.popen.pid))
                samples.append(
                    {**await consumer_state(stack.nats_url, stream, "binder"), "proxy_in_flight": proxy.in_flight}
                )
            remaining, deleted = await burst
        finally:
            proxy.pressure = None
        pressure_s = time.monotonic() - started
        counts_under_pressure = dict(proxy.counts)
        metrics_at_end = await binder_metrics(stack.binder_url)
        errors = error_lines(binder.log_path, log_start)
        naks = nak_lines(binder.log_path, log_start)

        engine = make_engine(stack.database_url, pool_size=2)
        try:
            bound_at_end = (await check_invariants(engine, api, stack.node_names)).bound_pods
            deadline = time.monotonic() + (300 if PROFILE.soak else 60)
            while True:
                report = await check_invariants(engine, api, stack.node_names, stack.kubelets)
                if (report.settled and report.pending_pods == 0) or time.monotonic() > deadline:
                    break
                await asyncio.sleep(2)
            caught_up_s = time.monotonic() - started - pressure_s
            clock = time.monotonic()
            await wait_for_quiet(engine, timeout_s=60)
            phases["quiet_s"] = time.monotonic() - clock
            after = await drained_backlog(stack.nats_url, stream, "binder")
        finally:
            await engine.dispose()
        async with httpx.AsyncClient(timeout=5) as http:
            binder_status = (await http.get(stack.binder_url + "/status")).json()
        metrics = await binder_metrics(stack.binder_url)
    finally:
        clock = time.monotonic()
        await proxy.stop()
        phases["proxy_stop_s"] = time.monotonic() - clock
    clock = time.monotonic()
    rebuild = await ledger_rebuild(stack, stream)
    phases["rebuild_s"] = time.monotonic() - clock
    retries = metrics_at_end.get("gpushare_binder_kube_retries_total", 0.0)
    outcomes = {k: v for k, v in metrics.items() if k.startswith("gpushare_binder_bindings_total{")}
    released = {k: v for k, v in metrics.items() if k.startswith("gpushare_binder_released_total{")}
    growth = max(rss) - rss[0]
    peak_ack_pending = max(s["ack_pending"] for s in samples)
    _record(
        "backpressure-slow-apiserver",
        seed=seed,
        pods_created=PROFILE.throttle_pods,
        pods_deleted=deleted,
        pressure_s=round(pressure_s, 1),
        pressure=dataclasses.asdict(PRESSURE),
        binder_concurrency=BINDER_CONCURRENCY,
        proxy=counts_under_pressure,
        proxy_requests_before_pressure=through_proxy_before,
        proxy_peak_in_flight=proxy.peak_in_flight,
        binder_kube_retries=retries,
        binder_outcomes=outcomes,
        binder_released=released,
        binder_naks=naks,
        binder_parked=binder_status.get("parked"),
        binder_rss_kib=rss,
        binder_consumer=samples,
        bound_at_pressure_end=bound_at_end,
        caught_up_s=round(caught_up_s, 1),
        backlog_after=after,
        binder_error_lines=len(errors),
        **report.figures(),
        rebuild_exit=rebuild.returncode,
        dead_services=stack.check_alive(),
        phases_s={k: round(v, 1) for k, v in phases.items()},
    )
    assert through_proxy_before > 0, "the binder did not talk to the apiserver through the proxy"
    assert counts_under_pressure.get("rejected", 0) > 0, f"the proxy throttled nothing: {counts_under_pressure}"
    assert retries > 0, f"the binder never retried a throttled call: {counts_under_pressure}, {metrics_at_end}"
    assert growth < RSS_GROWTH_LIMIT_KIB, f"binder RSS grew {growth} KiB while the apiserver throttled: {rss}"
    assert peak_ack_pending <= BINDER_CONCURRENCY + naks, f"binder held more than its concurrency in flight: {samples}"
    assert all(s["max_ack_pending"] >= s["ack_pending"] for s in samples), samples
    assert binder_status.get("parked") == 0, f"the binder parked reservations: {binder_status}"
    assert not any("failed_refused" in k for k in outcomes), f"a 429 was taken for a refusal: {outcomes}"
    assert len(errors) <= ERROR_LINES_LIMIT, "binder errors while throttled:\n" + "\n".join(errors[:20])
    assert not stack.check_alive(), f"services died: {stack.check_alive()}"
    assert not report.problems, "invariants broken after the pressure:\n" + "\n".join(report.problems[:20])
    assert report.pending_pods == 0 and report.bound_pods >= len(remaining), (
        f"not caught up: {report.bound_pods} bound, {report.pending_pods} pending of {len(remaining)}"
    )
    assert report.envs_checked >= len(remaining), f"only {report.envs_checked} of {len(remaining)} got devices"
    assert after == (0, 0), f"binder consumer backlog after catching up: {after}"
    assert rebuild.returncode == 0, rebuild.stderr[-3000:]
