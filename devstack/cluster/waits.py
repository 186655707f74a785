"""Bounded polling helpers for tests against the dev control plane."""

from __future__ import annotations

import asyncio
import contextlib
import inspect
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient

T = TypeVar("T")


async def poll(
    fn: Callable[[], Awaitable[T | None] | T | None],
    timeout_s: float = 30.0,
    interval: float = 0.25,
    what: str = "condition",
) -> T:
    """Call ``fn()`` (plain or async) until it returns a truthy value, and return it; TimeoutError naming ``what``
    after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while True:
        value = fn()
        if inspect.isawaitable(value):
            value = await value
        if value:
            return value
        if time.monotonic() >= deadline:
            raise TimeoutError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        await asyncio.sleep(interval)


async def wait_for_pod_node(api_client: ApiClient, namespace: str, name: str, timeout_s: float = 30.0) -> str:
    """Wait until a pod has ``spec.nodeName``; return it."""
    core = client.CoreV1Api(api_client)

    async def bound() -> str | None:
        pod = await core.read_namespaced_pod(name, namespace)
        return pod.spec.node_name

    return await poll(bound, timeout_s, what=f"pod {namespace}/{name} to be bound")


async def wait_for_pods_bound(
    api_client: ApiClient, namespace: str, label_selector: str, count: int, timeout_s: float = 30.0
) -> list[client.V1Pod]:
    """Wait until at least ``count`` pods matching the selector are bound to nodes."""
    core = client.CoreV1Api(api_client)

    async def bound() -> list[client.V1Pod] | None:
        pods = await core.list_namespaced_pod(namespace, label_selector=label_selector)
        done = [p for p in pods.items if p.spec.node_name]
        return done if len(done) >= count else None

    return await poll(bound, timeout_s, what=f"{count} pods ({label_selector}) in {namespace} to be bound")


async def cancelled(task: asyncio.Task[Any] | None) -> None:
    """Cancel a background task and wait until it has stopped (None: nothing to do)."""
    if task is not None:
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task
