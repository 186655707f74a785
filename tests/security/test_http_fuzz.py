"""Hostile bodies against the extender's scheduler verbs and accounting's quota API, on real processes.

Deep nesting (100k levels), huge arrays, wrong types, unicode, negative and overflowing quantities: every
answer is a 4xx (or a well-formed refusal), never a 5xx; the processes stay up; the ledger is unchanged."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import Iterator
from urllib.parse import quote

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shared.ledger.db import make_engine
from shared.ledger.replay import load_state
from tests.reliability.harness import ServiceProcess
from tests.reliability.profile import PROFILE

TOKEN = "fuzz-" + uuid.uuid4().hex
PREFIX = "/gpushare-scheduler"

HOSTILE: list[tuple[str, bytes]] = [
    ("empty", b""),
    ("not-json", b"\x00\xff garbage"),
    ("deep-arrays-100k", b"[" * 100_000 + b"]" * 100_000),
    ("deep-objects-100k", b'{"a":' * 100_000 + b"1" + b"}" * 100_000),
    ("open-100k", b"{" * 100_000),
    ("huge-array", json.dumps({"Pod": {}, "NodeNames": ["n"] * 200_000}).encode()),
    ("wrong-types", json.dumps({"Pod": [], "NodeNames": {"a": 1}, "Nodes": "x"}).encode()),
    ("null", b"null"),
    ("number", b"12345678901234567890123456789"),
    ("unicode", json.dumps({"Pod": {"metadata": {"name": "\u202e\ud83d\ude00\u0000", "uid": "\uffff"}}}).encode()),
    (
        "negative-quantity",
        json.dumps(
            {
                "Pod": {
                    "metadata": {"name": "p", "namespace": "ns", "uid": "u1"},
                    "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "-4"}}}]},
                },
                "NodeNames": ["n1"],
            }
        ).encode(),
    ),
    (
        "overflowing-quantity",
        json.dumps(
            {
                "Pod": {
                    "metadata": {"name": "p", "namespace": "ns", "uid": "u2"},
                    "spec": {"containers": [{"name": "c", "resources": {"limits": {"aliyun.com/gpu-mem": "9" * 400}}}]},
                },
                "NodeNames": ["n1"],
            }
        ).encode(),
    ),
    (
        "bind-hostile",
        json.dumps({"PodName": "x" * 10_000, "PodNamespace": -1, "PodUID": None, "Node": ["n"]}).encode(),
    ),
]


@pytest.fixture(scope="module")
def services(database_url: str, nats_url: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict]:
    tag = uuid.uuid4().hex[:8]
    env = {
        "GPUSHARE_DATABASE_URL": database_url,
        "GPUSHARE_NATS_URL": nats_url,
        "GPUSHARE_ADMIN_TOKEN": TOKEN,
        "GPUSHARE_STREAM_NAME": f"GPUSHARE_FZ{tag}",
        "GPUSHARE_SUBJECT_PREFIX": f"gsfz{tag}",
    }
    logs = tmp_path_factory.mktemp("fuzz-logs")
    procs = {
        "extender": ServiceProcess("extender", ["extender", "--host", "127.0.0.1"], env, logs),
        "accounting": ServiceProcess("accounting", ["accounting", "--host", "127.0.0.1"], env, logs),
    }
    try:
        for proc in procs.values():
            proc.start()
        for proc in procs.values():
            proc.wait_ready("/healthz")
        yield procs
    finally:
        for proc in procs.values():
            proc.stop()


def _ledger(database_url: str):  # type: ignore[no-untyped-def]
    async def load():  # type: ignore[no-untyped-def]
        engine = make_engine(database_url, pool_size=1)
        try:
            async with engine.connect() as conn:
                return (await load_state(conn)).canonical()
        finally:
            await engine.dispose()

    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        return pool.submit(asyncio.run, load()).result()


def _check(reply: httpx.Response, what: str) -> None:
    assert reply.status_code < 500, f"{what}: {reply.status_code} {reply.text[:300]}"
    if reply.status_code >= 400:
        assert reply.headers.get("content-type", "").startswith("application/json"), what
        assert reply.json().get("error"), f"{what}: no error message: {reply.text[:300]}"


@pytest.mark.parametrize("verb", ["filter", "prioritize", "bind", "preempt"])
@pytest.mark.parametrize(("name", "body"), HOSTILE, ids=[n for n, _ in HOSTILE])
def test_extender_verbs_refuse_hostile_bodies(
    services: dict, database_url: str, verb: str, name: str, body: bytes
) -> None:
    ext = services["extender"]
    before = _ledger(database_url)
    reply = httpx.post(
        f"{ext.base_url}{PREFIX}/{verb}", content=body, headers={"content-type": "application/json"}, timeout=30
    )
    _check(reply, f"{verb} {name}")
    assert ext.proc.poll() is None, f"extender died on {verb} {name}:\n{ext.log_tail()}"
    assert _ledger(database_url) == before, f"{verb} {name} changed the ledger"


@pytest.mark.parametrize(("name", "body"), HOSTILE, ids=[n for n, _ in HOSTILE])
def test_accounting_quota_refuses_hostile_bodies(services: dict, database_url: str, name: str, body: bytes) -> None:
    acc = services["accounting"]
    before = _ledger(database_url)
    reply = httpx.put(
        f"{acc.base_url}/v1/quotas/fuzz-ns",
        content=body,
        headers={"content-type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    _check(reply, f"quota {name}")
    assert reply.status_code >= 400
    assert acc.proc.poll() is None, f"accounting died on {name}:\n{acc.log_tail()}"
    assert _ledger(database_url) == before


def _acceptable(value: object, high: int) -> bool:
    """Whether a quota value may be accepted: absent, or a whole number in range (pydantic's lax mode also
    takes 4.0, True or "12" as whole numbers)."""
    if value is None:
        return True
    try:
        number = float(value)  # type: ignore[arg-type]
    except (TypeError, ValueError):
        return False
    return number == number and abs(number) != float("inf") and number == int(number) and 0 <= number <= high


quota_values = st.one_of(
    st.integers(min_value=-(2**80), max_value=2**80),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=20),
    st.none(),
    st.booleans(),
    st.lists(st.integers(), max_size=3),
)


@settings(
    max_examples=max(30, PROFILE.fuzz_examples // 5),
    deadline=None,
    derandomize=not PROFILE.soak,
    database=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(memory=quota_values, compute=quota_values, namespace=st.text(min_size=1, max_size=30))
def test_accounting_quota_values_never_5xx(services: dict, memory: object, compute: object, namespace: str) -> None:
    acc = services["accounting"]
    try:
        body = json.dumps({"memory_mib": memory, "compute": compute})
    except ValueError:
        return
    reply = httpx.put(
        f"{acc.base_url}/v1/quotas/{quote(namespace, safe='')}",
        content=body,
        headers={"content-type": "application/json", "Authorization": f"Bearer {TOKEN}"},
        timeout=30,
    )
    _check(reply, f"quota {namespace!r} {body[:80]}")
    ok_memory = _acceptable(memory, 16 * 1024 * 1024)
    ok_compute = _acceptable(compute, 6400)
    if reply.status_code == 200:
        assert ok_memory and ok_compute and (memory is not None or compute is not None), body
