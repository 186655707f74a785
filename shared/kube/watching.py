"""List-then-watch streams of Kubernetes objects as JSON dicts, surviving 410 Gone and outages.

The protocol: LIST gives the objects and a resourceVersion; WATCH from that version streams changes,
with BOOKMARK events moving the version forward while nothing of interest changes. A watch ends normally
when the server's timeout expires (reconnect from the last version). `410 Gone` (as an HTTP status or an
ERROR event) means the version was compacted away: that is routine, and the cure is a fresh LIST.
Connection errors and 5xx are retried forever with capped backoff; objects are never deserialised into
models (cheap for cluster-wide pod watches).

    async for event in watch_objects(core.list_pod_for_all_namespaces, what="pods"):
        if event.type == SYNCED: ...        # a (re)list finished: the ADDED events before it are complete
        else: handle(event.type, event.object)
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

from shared.kube.raw import read_json
from shared.kube.retry import is_retryable

log = logging.getLogger(__name__)

ADDED = "ADDED"
MODIFIED = "MODIFIED"
DELETED = "DELETED"
SYNCED = "SYNCED"

ListFunction = Callable[..., Awaitable[Any]]


@dataclass(frozen=True)
class WatchEvent:
    """One change (ADDED / MODIFIED / DELETED), or SYNCED after a complete (re)list."""

    type: str
    object: dict[str, Any] = field(default_factory=dict)


class Gone(Exception):
    """The resourceVersion is too old (410): list again."""


def resource_version(obj: dict[str, Any]) -> str:
    """`metadata.resourceVersion` of an object or list."""
    return str((obj.get("metadata") or {}).get("resourceVersion") or "")


def parse_line(line: bytes) -> WatchEvent | str | None:
    """Pure: a watch stream line -> a WatchEvent, a bookmark's resourceVersion (str), or None (blank).

    Raises `Gone` for a 410 ERROR event and `ApiException` for other ERROR events.
    """
    text = line.strip()
    if not text:
        return None
    raw = json.loads(text)
    kind = raw.get("type")
    obj = raw.get("object") or {}
    if kind == "ERROR":
        code = int(obj.get("code") or 0)
        if code == 410:
            raise Gone(obj.get("message", "resource version too old"))
        raise ApiException(status=code, reason=f"{obj.get('reason')}: {obj.get('message')}")
    if kind == "BOOKMARK":
        return resource_version(obj)
    return WatchEvent(str(kind), obj)


async def _lines(resp: Any) -> AsyncIterator[bytes]:
    """Split a streamed body into lines of any length (aiohttp's readline caps a line at 128 KiB)."""
    buf = bytearray()
    async for chunk in resp.content.iter_any():
        buf.extend(chunk)
        while (end := buf.find(b"\n")) >= 0:
            yield bytes(buf[:end])
            del buf[: end + 1]
    if buf:
        yield bytes(buf)


async def watch_objects(
    list_fn: ListFunction,
    *,
    what: str = "objects",
    timeout_s: int = 300,
    max_backoff_s: float = 10.0,
    stop: asyncio.Event | None = None,
    **params: Any,
) -> AsyncIterator[WatchEvent]:
    """Yield list-then-watch events forever (or until `stop` is set) for a `list_*` API method.

    After every (re)list the listed objects are yielded as ADDED, then one SYNCED event. Objects deleted
    while no watch was open are *not* reported: consumers reconcile against the SYNCED listing if needed.
    """
    version = ""
    backoff = 0.5
    while stop is None or not stop.is_set():
        try:
            if not version:
                body = await read_json(await list_fn(_preload_content=False, _request_timeout=120, **params))
                version = resource_version(body)
                for item in body.get("items") or []:
                    yield WatchEvent(ADDED, item)
                yield WatchEvent(SYNCED)
            resp = await list_fn(
                watch=True,
                resource_version=version,
                **params,  # the list's selectors hold for the watch too
                allow_watch_bookmarks=True,
                timeout_seconds=timeout_s,
                _preload_content=False,
                _request_timeout=aiohttp.ClientTimeout(sock_connect=10, sock_read=timeout_s + 30),
            )
            if resp.status != 200:
                await read_json(resp)  # raises with the status
            async with resp:  # the connection goes back to the pool however the stream ends
                async for line in _lines(resp):
                    parsed = parse_line(line)
                    if parsed is None:
                        continue
                    if isinstance(parsed, str):
                        version = parsed or version
                        continue
                    version = resource_version(parsed.object) or version
                    backoff = 0.5
                    yield parsed
        except asyncio.CancelledError:
            raise
        except Gone:
            # Routine: etcd compacted our version while we were away. Start over from a fresh list.
            log.info("watch of %s: resource version expired (410); listing again", what)
            version = ""
        except Exception as exc:
            if isinstance(exc, ApiException) and exc.status == 410:
                log.info("watch of %s: resource version expired (410); listing again", what)
                version = ""
                continue
            level = logging.WARNING if is_retryable(exc) else logging.ERROR
            log.log(level, "watch of %s failed: %r; reconnecting in %.1fs", what, exc, backoff)
            await asyncio.sleep(backoff)
            backoff = min(max_backoff_s, backoff * 2)
