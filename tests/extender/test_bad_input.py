"""Bad input: a clear 4xx JSON reason or the protocol's Error field, never a 500, never a partial reservation."""

from __future__ import annotations

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.service import ExtenderService
from shared.ledger.ledger import Ledger
from shared.ledger.models import allocations, gpus
from tests.extender.conftest import PREFIX, add_node, bind_args, gpu_pod, names_args


async def assert_nothing_reserved(engine: AsyncEngine) -> None:
    async with engine.connect() as conn:
        assert (await conn.execute(select(allocations))).first() is None
        assert all(r.allocated_memory_mib == 0 for r in (await conn.execute(select(gpus))).all())


BAD_BODIES = [b"{not json", b"[1, 2]", b'"text"', b"", b'{"Pod": 5}', b'{"Pod": {"metadata": null}}', b"\xff\xfe"]


async def test_malformed_bodies_get_400_json(client: httpx.AsyncClient) -> None:
    for verb in ("filter", "prioritize", "bind", "preempt"):
        for body in BAD_BODIES:
            r = await client.post(f"{PREFIX}/{verb}", content=body, headers={"content-type": "application/json"})
            assert r.status_code == 400, (verb, body, r.text)
            assert r.json()["error"]


async def test_wrong_types_are_rejected(client: httpx.AsyncClient) -> None:
    pod = gpu_pod("p", 1)
    r = await client.post(f"{PREFIX}/filter", json={"Pod": pod, "NodeNames": "n1", "Nodes": None})
    assert r.status_code == 400 and "NodeNames" in r.json()["Error"]
    r = await client.post(f"{PREFIX}/filter", json={"Pod": pod, "NodeNames": None, "Nodes": {"items": [{}]}})
    assert r.status_code == 400
    r = await client.post(f"{PREFIX}/bind", json={"PodName": "p", "PodNamespace": "d", "PodUID": 7, "Node": "n"})
    assert r.status_code == 400 and "PodUID" in r.json()["Error"]
    r = await client.post(
        f"{PREFIX}/preempt", json={"Pod": pod, "NodeNameToMetaVictims": {"n1": {"Pods": [{"UID": None}]}}}
    )
    assert r.status_code == 400


@pytest.mark.parametrize("mem", ["-2", "1.5", "lots", "999999999999"])
async def test_negative_or_absurd_requests_are_an_error_and_reserve_nothing(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, engine: AsyncEngine, mem: str
) -> None:
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    pod = gpu_pod("p", mem)
    r = await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    assert r.status_code == 200
    assert r.json()["Error"].startswith("invalid GPU request") and r.json()["NodeNames"] == []
    r = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert r.status_code == 200 and "invalid GPU request" in r.json()["Error"]
    await assert_nothing_reserved(engine)


async def test_uneven_split_and_bad_annotations_are_explained(client: httpx.AsyncClient) -> None:
    pod = gpu_pod("p", 3, limits={"aliyun.com/gpu-count": "2"})
    assert "evenly" in (await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()["Error"]
    pod = gpu_pod("p", 1, annotations={"gpushare.io/policy": "chaos"})
    assert "binpack or spread" in (await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))).json()["Error"]


async def test_bind_to_an_unknown_or_too_small_node_reserves_nothing(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, engine: AsyncEngine
) -> None:
    await add_node(ledger, "n1", [4])
    await service.resync("test")
    pod = gpu_pod("p", 8)
    await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    assert "inventory" in (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "ghost"))).json()["Error"]
    assert "8192 MiB" in (await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))).json()["Error"]
    await assert_nothing_reserved(engine)


async def test_oversized_bodies_get_413(client: httpx.AsyncClient) -> None:
    r = await client.post(f"{PREFIX}/filter", content=b"x" * (300 * 1024), headers={"content-type": "application/json"})
    assert r.status_code == 413 and "larger" in r.json()["error"]


async def test_both_node_fields_null_means_no_node(client: httpx.AsyncClient) -> None:
    r = await client.post(f"{PREFIX}/filter", json={"Pod": gpu_pod("p", 1), "Nodes": None, "NodeNames": None})
    assert r.status_code == 200 and r.json()["NodeNames"] == []


@pytest.mark.parametrize("mem", ["\u00b2", "\uff11\uff12", "\u0663", "1\u00b2"])  # ², full-width 12, Arabic 3
async def test_non_ascii_digits_are_refused_with_a_reason_never_a_500(
    client: httpx.AsyncClient, ledger: Ledger, service: ExtenderService, engine: AsyncEngine, mem: str
) -> None:
    """Unicode digits (superscript two made int() fail: a 500; full-width "12" was read as 12) are refused,
    naming ASCII digits."""
    await add_node(ledger, "n1", [16])
    await service.resync("test")
    pod = gpu_pod("p", mem)
    r = await client.post(f"{PREFIX}/filter", json=names_args(pod, ["n1"]))
    assert r.status_code == 200, r.text
    assert r.json()["NodeNames"] == [] and "ASCII digits" in r.json()["Error"], r.json()
    r = await client.post(f"{PREFIX}/prioritize", json=names_args(pod, ["n1"]))
    assert r.status_code == 200, r.text
    assert all(entry["Score"] == 0 for entry in r.json())
    r = await client.post(f"{PREFIX}/bind", json=bind_args(pod, "n1"))
    assert r.status_code == 200 and "ASCII digits" in r.json()["Error"]
    await assert_nothing_reserved(engine)
