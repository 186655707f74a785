"""The shared HTTP plumbing: health, metrics, bounded bodies, JSON errors instead of 500s."""

from __future__ import annotations

import httpx
from fastapi import FastAPI
from pydantic import BaseModel

from shared.http import BodyLimitMiddleware, install_common


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
        assert (await client.get("/healthz")).json() == {"status": "ok"}
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
