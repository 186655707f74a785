"""The shared HTTP plumbing: health, metrics, bounded bodies, JSON errors instead of 500s."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import GaugeMetricFamily
from pydantic import BaseModel

from shared.http import BodyLimitMiddleware, exposition, install_common


class Item(BaseModel):
    size: int


def _client(app: object) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t")  # type: ignore[arg-type]


def _limited_app() -> BodyLimitMiddleware:
    app = FastAPI()
    install_common(app, ready=lambda: False)

    @app.post("/items")
    async def create(item: Item) -> dict[str, int]:
        return {"size": item.size}

    return BodyLimitMiddleware(app, max_bytes=1024)


async def test_health_readiness_and_metrics_endpoints() -> None:
    async with _client(_limited_app()) as client:
        assert (await client.get("/healthz")).json() == {"status": "ok", "role": "active"}
        assert (await client.get("/readyz")).status_code == 503
        metrics = await client.get("/metrics")
        assert metrics.status_code == 200 and "python_info" in metrics.text


async def test_invalid_and_oversized_bodies_get_clear_4xx() -> None:
    async with _client(_limited_app()) as client:
        bad = await client.post("/items", json={"size": "big"})
        assert bad.status_code == 422 and bad.json()["details"][0]["field"] == "body.size"
        huge = await client.post("/items", content=b"[" * 5000)
        assert huge.status_code == 413 and "larger than 1024" in huge.json()["error"]


async def test_deeply_nested_json_is_refused_not_crashed() -> None:
    app = FastAPI()
    install_common(app)

    @app.post("/any")
    async def anything(body: dict) -> dict:  # type: ignore[type-arg]
        return body

    async with _client(app) as client:
        deep = await client.post(
            "/any",
            content=b'{"a":' * 100_000 + b"1" + b"}" * 100_000,
            headers={"content-type": "application/json"},
        )
        assert deep.status_code == 400 and deep.json()["error"]


class _Families:
    """A custom collector yielding several families, one of them large."""

    def collect(self) -> object:
        for name, size in (("t_small", 2), ("t_large", 5000), ("t_empty", 0)):
            family = GaugeMetricFamily(name, f"help of {name} with \\ and a\nnewline", labels=["node", "gpu"])
            for i in range(size):
                family.add_metric([f"n-{i}", f'"{i}"'], i * 1.5)
            yield family


async def test_metrics_are_streamed_family_by_family_with_generate_latests_bytes() -> None:
    """/metrics renders one family at a time (accounting's per-GPU families are 40,000 samples each at
    5,000 nodes) and serves exactly what prometheus_client's generate_latest would have."""
    registry = CollectorRegistry()
    Counter("t_requests", "requests", ["verb"], registry=registry).labels("bind").inc(3)
    Histogram("t_seconds", "latency", registry=registry).observe(0.2)
    registry.register(_Families())  # type: ignore[arg-type]
    chunks = [chunk async for chunk in exposition(registry)]
    assert len(chunks) == 5  # counter, histogram, three gauges
    app = FastAPI()
    install_common(app, registry=registry)
    async with _client(app) as client:
        r = await client.get("/metrics")
    expected = generate_latest(registry)
    assert b"".join(chunks) == expected == r.content
    assert r.headers["content-type"] == CONTENT_TYPE_LATEST


async def test_metrics_can_be_filtered_by_family_name() -> None:
    """`/metrics?name[]=...` (Prometheus' convention) serves only the named families: a watcher polling one
    counter need not render 40,000-sample families each time."""
    registry = CollectorRegistry()
    Counter("t_requests", "requests", registry=registry).inc(2)
    Counter("t_other", "other", registry=registry).inc()
    registry.register(_Families())  # type: ignore[arg-type]
    app = FastAPI()
    install_common(app, registry=registry)
    async with _client(app) as client:
        one = (await client.get("/metrics", params={"name[]": "t_requests_total"})).text
        both = (await client.get("/metrics", params=[("name[]", "t_requests_total"), ("name[]", "t_other_total")])).text
        everything = (await client.get("/metrics")).text
    assert "t_requests_total 2.0" in one and "t_other" not in one and "t_large" not in one
    assert "t_requests_total 2.0" in both and "t_other_total 1.0" in both and "t_large" not in both
    assert "t_large" in everything and "t_other_total" in everything
