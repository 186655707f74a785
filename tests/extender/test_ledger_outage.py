"""A database that refuses connections ("too many clients") while kube-scheduler binds: the extender retries
with backoff, and what reaches kube-scheduler (and so the pod's condition) is one short sentence, never the
driver's exception text. Real PostgreSQL: the ledger writes as a role allowed a single connection."""

from __future__ import annotations

import asyncpg
import httpx
import pytest
from sqlalchemy.ext.asyncio import AsyncEngine

import services.extender.bind as bind_module
from services.extender.app import create_app
from services.extender.service import ExtenderService
from shared.events.bus import EventBus
from shared.ledger.ledger import Ledger
from shared.settings import MemoryUnit
from tests.extender.conftest import PREFIX, add_node, bind_args, gpu_pod, names_args
from tests.foundation.test_db_retry import one_connection_engine  # noqa: F401  (fixture)


async def test_bind_during_a_connection_outage_answers_briefly_then_recovers(
    engine: AsyncEngine,
    bus: EventBus,
    ledger: Ledger,
    one_connection_engine: tuple[AsyncEngine, str],  # noqa: F811
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    limited, url = one_connection_engine
    monkeypatch.setattr(bind_module, "LEDGER_BUDGET_S", 0.8)
    await add_node(ledger, "n1", [16])
    starved = Ledger(limited, prefix=bus.names.prefix, source="extender")
    service = ExtenderService(
        engine=engine, ledger=starved, bus=bus, unit=MemoryUnit.GIB, bind_timeout_s=1.0, kube_enabled=False, poll_s=0.2
    )
    await service.start()
    app = create_app(service, max_body_bytes=256 * 1024)
    holder = await asyncpg.connect(url.replace("postgresql+asyncpg", "postgresql"))  # the role's only connection
    try:
        async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://x") as http:
            pod = gpu_pod("p", 2)
            assert (await http.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()["NodeNames"] == ["n1"]
            answer = (await http.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json()
            error = answer["Error"]
            assert error.startswith("the GPU ledger is unavailable right now"), error
            assert "retry" in error and "asyncpg" not in error and "too many" not in error.lower()
            assert "Error" not in error and len(error) < 160
            await holder.close()
            # the next try of kube-scheduler goes through (no binder here: the wait for its verdict times out,
            # the reservation is kept)
            answer = (await http.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json()
            assert "unavailable" not in answer["Error"]
            assert "reservation on n1 is kept" in answer["Error"]
    finally:
        if not holder.is_closed():
            await holder.close()
        await service.close()
