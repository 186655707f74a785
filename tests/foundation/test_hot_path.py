"""The lean ASGI path: hot POSTs answered without FastAPI, with the same limits and error answers."""

from __future__ import annotations

import httpx
from fastapi import FastAPI

from shared.hot_path import HotPath
from shared.http import BodyLimitMiddleware, install_common


def _app(handler_error: BaseException | None = None) -> tuple[HotPath, list[str]]:
    seen: list[str] = []
    inner = FastAPI()
    inner.add_middleware(BodyLimitMiddleware, max_bytes=1024)
    install_common(inner)

    @inner.post("/x/verb")
    async def verb_in_fastapi() -> dict[str, str]:
        seen.append("fastapi")
        return {"via": "fastapi"}

    async def handler(body: bytes) -> tuple[int, bytes]:
        seen.append("hot")
        if handler_error is not None:
            raise handler_error
        return 200, b'{"echo":%d}' % len(body)

    return HotPath(inner, {"/x/verb": handler}, max_body_bytes=1024), seen


async def _call(app: HotPath, method: str, path: str, content: bytes | None = None, **kw) -> httpx.Response:  # type: ignore[no-untyped-def]
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        return await client.request(method, path, content=content, **kw)


async def test_a_hot_post_skips_fastapi_and_everything_else_reaches_it() -> None:
    app, seen = _app()
    reply = await _call(app, "POST", "/x/verb", b"12345")
    assert reply.status_code == 200 and reply.json() == {"echo": 5}
    assert reply.headers["content-type"] == "application/json"
    assert seen == ["hot"]
    assert (await _call(app, "GET", "/x/verb")).status_code == 405  # FastAPI's answer for another method
    assert (await _call(app, "GET", "/healthz")).json() == {"status": "ok", "role": "active"}
    assert seen == ["hot"]


async def test_an_oversized_body_is_refused_as_body_limit_middleware_refuses_it() -> None:
    app, seen = _app()
    declared = await _call(app, "POST", "/x/verb", b"x" * 2000)

    async def chunks():  # type: ignore[no-untyped-def]
        for _ in range(4):
            yield b"y" * 400  # no content-length: streamed, refused once past the limit

    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t") as client:
        streamed = await client.post("/x/verb", content=chunks())
    for reply in (declared, streamed):
        assert reply.status_code == 413
        assert reply.json() == {"error": "request body larger than 1024 bytes"}
    assert seen == []


async def test_a_failing_handler_gets_a_json_answer_never_a_traceback() -> None:
    app, _ = _app(RuntimeError("boom"))
    reply = await _call(app, "POST", "/x/verb", b"{}")
    assert reply.status_code == 500 and reply.json() == {"error": "internal error; see the service log"}
    app, _ = _app(RecursionError())
    reply = await _call(app, "POST", "/x/verb", b"[[[[]]]]")
    assert reply.status_code == 400 and reply.json() == {"error": "request body is nested too deeply"}
