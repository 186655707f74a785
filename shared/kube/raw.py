"""Calling the Kubernetes API without the client's model layer: JSON dicts in and out.

kubernetes_asyncio parses every reply into generated models, which is slow for large lists and wrong for
some endpoints (the Binding reply is a `Status`, see `binding.py`). With `_preload_content=False` the
client returns the raw aiohttp response and raises nothing for error statuses, so `read_json` does both:
it reads the body and raises `ApiException` (with `status`, `body` and `headers`) for anything but 2xx.
"""

from __future__ import annotations

import json
from typing import Any

from kubernetes_asyncio.client.exceptions import ApiException

DEFAULT_TIMEOUT_S = 15.0


async def read_json(resp: Any) -> dict[str, Any]:
    """Read an aiohttp response from a `_preload_content=False` call; raise `ApiException` unless 2xx."""
    async with resp:  # hands the connection back to the pool, also when reading fails
        body = await resp.read()
    if not 200 <= resp.status <= 299:
        exc = ApiException(status=resp.status, reason=resp.reason)
        exc.body = body.decode(errors="replace")
        exc.headers = dict(resp.headers)  # type: ignore[assignment]  # what kubernetes_asyncio's own errors carry
        raise exc
    if not body:
        return {}
    value = json.loads(body)
    return value if isinstance(value, dict) else {"value": value}


def status_message(exc: ApiException) -> str:
    """The `message` of a Kubernetes `Status` error body, or the HTTP reason."""
    try:
        return str(json.loads(exc.body or "{}").get("message") or exc.reason or "")
    except (ValueError, AttributeError):
        return str(exc.reason or "")
