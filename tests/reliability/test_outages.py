"""Outages neither lose data nor kill services: accounting's consumers wait out a PostgreSQL outage instead of
parking the events that arrive meanwhile, and every service started before PostgreSQL and NATS waits for them
(alive, not ready, one log line per attempt) instead of crash-looping."""

from __future__ import annotations

import asyncio
import logging
import time
import uuid
from pathlib import Path

import httpx
import pytest
from sqlalchemy import func, select

from devstack.cluster.kubelet import KubeletStandIn
from devstack.embedded import EmbeddedNats, free_port
from services.accounting.metrics import AccountingMetrics
from services.accounting.service import build_consumers
from services.accounting.tables import pending, timeline, usage_samples
from shared.events.bus import BusNames, EventBus
from shared.events.catalogue import (
    AllocationPart,
    RefusedEvent,
    ReservedEvent,
    UsageEvent,
    UsageSample,
)
from shared.ledger.db import make_engine
from tests.reliability.test_crash import _record
from tests.waiting import eventually

from .compressed import stop_tasks
from .harness import ServiceProcess
from .late_servers import private_postgres

OUTAGE_S = 12.0  # longer than the 7.5 s after which an event used to be parked


def _reserved(node: str = "n") -> ReservedEvent:
    a_id = uuid.uuid4()
    part = AllocationPart(container="c", container_index=0, gpu_uuid="G0", gpu_index=0, memory_mib=1024)
    return ReservedEvent(allocation_id=a_id, pod_uid=str(a_id), namespace="ns", pod_name="p", node=node, parts=[part])


def _usage() -> UsageEvent:
    return UsageEvent(node="n", samples=[UsageSample(gpu_uuid="G0", pod_uid="p", used_memory_mib=100)])


async def test_accounting_waits_out_a_database_outage_and_parks_nothing(
    bus: EventBus, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="shared.events.consumer")
    async with private_postgres() as pg:
        engine = make_engine(pg.url, pool_size=3, max_overflow=0)
        consumers = build_consumers(engine, bus, AccountingMetrics())
        stop = asyncio.Event()
        tasks = [asyncio.create_task(c.run(stop)) for c in consumers]

        async def rows() -> tuple[int, int, int]:
            async with engine.connect() as conn:
                counts = [
                    (await conn.execute(select(func.count()).select_from(t))).scalar_one()
                    for t in (timeline, usage_samples, pending)
                ]
            return counts[0], counts[1], counts[2]

        try:
            await bus.publish(_reserved())
            await bus.publish(_usage())
            await eventually(lambda: all(c.applied for c in consumers), what="both consumers to apply an event")

            await pg.stop()
            during = [_reserved(), _reserved(), _usage(), _usage(), _reserved()]
            during.append(RefusedEvent(pod_uid="waiting", namespace="ns", pod_name="w", summary="no GPU fits"))
            for event in during:
                await bus.publish(event)
            await asyncio.sleep(OUTAGE_S)  # the outage lasts this long (the fault, not a wait for a result)
            assert [c.parked for c in consumers] == [0, 0], "an outage parks nothing"
            await pg.start()
            restarted = time.monotonic()

            await eventually(lambda: _equal(rows, (4, 3, 1)), what="every event applied", within=60)
            caught_up_s = time.monotonic() - restarted
            assert [c.parked for c in consumers] == [0, 0]
            assert (await bus.js.stream_info(bus.names.parked_stream)).state.messages == 0
            waits = [r for r in caplog.records if "waits for the database or the bus" in r.getMessage()]
            # one line per attempt (capped backoff, 0.5 s doubling up to 10 s), not one per try of anything else
            assert 0 < len(waits) <= 2 * 8
            assert all(c.outage_retries for c in consumers)
            _record(
                "database-outage-accounting",
                outage_s=OUTAGE_S,
                events_during=len(during),
                retries=[c.outage_retries for c in consumers],
                log_lines=len(waits),
                parked=[c.parked for c in consumers],
                caught_up_s=round(caught_up_s, 2),
            )
        finally:
            await stop_tasks(stop, tasks, 15)
            await engine.dispose()


async def _equal(fetch, expected: tuple[int, int, int]) -> bool:  # type: ignore[no-untyped-def]
    try:
        return await fetch() == expected
    except Exception:  # the database may still be starting
        return False


def _kubeconfig(path: Path) -> Path:
    """A kubeconfig for an API server nobody runs (the binder starts; its watches wait for it)."""
    server = f"https://127.0.0.1:{free_port()}"
    path.write_text(
        "apiVersion: v1\nkind: Config\ncurrent-context: nowhere\n"
        f"clusters: [{{name: nowhere, cluster: {{server: '{server}', insecure-skip-tls-verify: true}}}}]\n"
        "users: [{name: nobody, user: {token: none}}]\n"
        "contexts: [{name: nowhere, context: {cluster: nowhere, user: nobody}}]\n"
    )
    return path


async def _status(service: ServiceProcess, path: str) -> int | None:
    try:
        async with httpx.AsyncClient(timeout=2) as client:
            return (await client.get(service.base_url + path)).status_code
    except httpx.HTTPError:
        return None


def _waits(service: ServiceProcess, what: str) -> int:
    return service.log_tail(10**7).count(f"waiting for {what}")


async def test_every_service_waits_for_late_servers_serving_healthz_and_never_crash_loops(
    tmp_path: Path, bus_names: BusNames
) -> None:
    async with private_postgres() as pg:
        await pg.stop()  # PostgreSQL and NATS both start after the services
        nats = EmbeddedNats(tmp_path / "nats", port=free_port())
        kubelet = KubeletStandIn(tmp_path / "dp", tmp_path / "pr.sock")
        await kubelet.start()
        env = {
            "GPUSHARE_DATABASE_URL": pg.url,
            "GPUSHARE_NATS_URL": nats.url,
            "GPUSHARE_STREAM_NAME": bus_names.stream,
            "GPUSHARE_SUBJECT_PREFIX": bus_names.prefix,
            "GPUSHARE_LOG_FORMAT": "text",
            "HOME": str(tmp_path),  # no ~/.kube/config
            "KUBECONFIG": "",
        }
        logs = tmp_path / "logs"
        node_agent_args = ["--node", "late-node", "--fake-gpus", "1x16GiB:Tesla-T4"]
        node_agent_args += ["--device-plugin-dir", str(tmp_path / "dp"), "--pod-resources-socket"]
        services = [
            ServiceProcess("extender", ["extender", "--host", "127.0.0.1"], env, logs),
            ServiceProcess("binder", ["binder", "--kubeconfig", str(_kubeconfig(tmp_path / "kc"))], env, logs),
            ServiceProcess("accounting", ["accounting", "--host", "127.0.0.1"], env, logs),
            ServiceProcess(
                "node-agent",
                ["node-agent", *node_agent_args, str(tmp_path / "pr.sock")],
                env,
                logs,
                port_flag="--metrics-port",
            ),
        ]
        try:
            for service in services:
                service.start()

            async def alive_not_ready() -> bool:
                for s in services:
                    assert s.proc is not None and s.proc.poll() is None, f"{s.name} exited:\n{s.log_tail()}"
                return all(
                    [await _status(s, "/healthz") == 200 and await _status(s, "/readyz") == 503 for s in services]
                )

            await eventually(alive_not_ready, what="every service alive and not ready", within=90, interval=0.5)
            # a few backoff rounds: one line per attempt, the interval doubling (0.5, 1, 2, 4 s ...)
            await eventually(lambda: all(_waits(s, "NATS") >= 4 for s in services), what="four attempts", within=60)
            assert await alive_not_ready()
            for s in services:
                assert _waits(s, "NATS") <= 7, f"{s.name} logs more than one line per attempt:\n{s.log_tail()}"
                assert "NATS client error" not in s.log_tail(10**7)

            await asyncio.to_thread(nats.start)
            with_database = services[:3]
            await eventually(
                lambda: all(_waits(s, "PostgreSQL") >= 2 for s in with_database),
                what="the wait for PostgreSQL",
                within=60,
            )
            assert await alive_not_ready(), (
                "connected to NATS, still waiting for PostgreSQL (or, the node agent, the binder)"
            )
            await pg.start()
            started = time.monotonic()

            async def ready(s: ServiceProcess) -> bool:
                return await _status(s, "/readyz") == 200

            ready_after = {}
            for s in (services[0], services[2], services[3]):  # the binder has no API server: alive, not ready
                await eventually(lambda s=s: ready(s), what=f"{s.name} ready", within=90, interval=0.5)
                ready_after[s.name] = round(time.monotonic() - started, 1)
            assert await _status(services[1], "/healthz") == 200
            assert "binder started" in services[1].log_tail(10**7)
            for s in services:
                assert s.proc is not None and s.proc.poll() is None and s.starts == 1
        finally:
            codes = {s.name: s.stop() for s in services}
            await kubelet.stop()
            await asyncio.to_thread(nats.stop)
        for s in services:
            assert "Traceback" not in s.log_tail(10**7), f"{s.name}:\n{s.log_tail()}"
        assert codes == {s.name: 0 for s in services}
        _record(
            "startup-late-servers",
            nats_waits={s.name: _waits(s, "NATS") for s in services},
            postgres_waits={s.name: _waits(s, "PostgreSQL") for s in services},
            ready_after_postgres_s=ready_after,
            exit_codes=codes,
        )
