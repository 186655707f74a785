"""Kubernetes Events about a pod, as `kubectl describe pod` shows them (core/v1 Event, written once per cause).

An Event's name must be unique in its namespace; kube's own recorders use `<object>.<hex timestamp>`, which is
what `event_body` does. A write that fails is logged and dropped: an Event explains, it never decides anything.
"""

from __future__ import annotations

import logging
import time
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.kube.raw import DEFAULT_TIMEOUT_S, read_json

log = logging.getLogger(__name__)

MAX_MESSAGE = 1024  # kube-apiserver truncates longer messages anyway (event validation allows 1 KiB in events.k8s.io)


def event_body(
    namespace: str, pod_name: str, pod_uid: str, *, reason: str, message: str, component: str, warning: bool = True
) -> dict[str, Any]:
    """A core/v1 Event about one pod (pure)."""
    now = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": f"{pod_name}.{time.time_ns():x}", "namespace": namespace},
        "involvedObject": {"apiVersion": "v1", "kind": "Pod", "namespace": namespace, "name": pod_name, "uid": pod_uid},
        "reason": reason,
        "message": message[:MAX_MESSAGE],
        "type": "Warning" if warning else "Normal",
        "source": {"component": component},
        "firstTimestamp": now,
        "lastTimestamp": now,
        "count": 1,
    }


async def post_pod_event(api: client.ApiClient, body: dict[str, Any]) -> bool:
    """Write an Event (`event_body`); False, logged, when the API server would not take it."""
    namespace = body["metadata"]["namespace"]
    try:
        await read_json(
            await client.CoreV1Api(api).create_namespaced_event(
                namespace, body, _preload_content=False, _request_timeout=DEFAULT_TIMEOUT_S
            )
        )
    except (ApiException, OSError, TimeoutError) as exc:
        log.warning(
            "could not write the %s event about pod %s/%s: %r",
            body.get("reason"),
            namespace,
            body["involvedObject"]["name"],
            exc,
        )
        return False
    return True
