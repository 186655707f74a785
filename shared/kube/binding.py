"""Creating a pod's Binding, annotations included, in one API write.

`POST /api/v1/namespaces/{ns}/pods/{name}/binding` sets `spec.nodeName` and merges the Binding's
`metadata.annotations` into the pod atomically, so annotations never outlive a failed bind (gpushare's
patch-then-bind left stale ones). `metadata.uid` makes the API server refuse the bind (409) when the pod
was replaced by another with the same name, on API servers that check it (1.23, 1.24 and 1.27+; 1.20-1.22
and 1.25-1.26 ignore it, so callers read the pod first there). The reply is a `Status`, which
kubernetes_asyncio would try to parse as a `V1Binding` and raise on *after* the bind succeeded; this module
reads the reply itself.
"""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client

from shared.kube.raw import DEFAULT_TIMEOUT_S, read_json


def binding_body(
    namespace: str, name: str, node: str, *, uid: str | None = None, annotations: dict[str, str] | None = None
) -> dict[str, Any]:
    """The Binding object for `namespace/name` onto `node` (pure)."""
    meta: dict[str, Any] = {"name": name, "namespace": namespace}
    if uid:
        meta["uid"] = uid
    if annotations:
        meta["annotations"] = dict(annotations)
    return {
        "apiVersion": "v1",
        "kind": "Binding",
        "metadata": meta,
        "target": {"apiVersion": "v1", "kind": "Node", "name": node},
    }


async def create_binding(
    api: client.ApiClient,
    namespace: str,
    name: str,
    node: str,
    *,
    uid: str | None = None,
    annotations: dict[str, str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> dict[str, Any]:
    """Bind the pod to `node`, writing `annotations` in the same request; returns the reply `Status`.

    Raises `ApiException`: 409 when the pod is already bound, being deleted, or its UID differs;
    404 when it does not exist; 429/5xx for transient trouble (see `retry.call_with_retry`).
    """
    core = client.CoreV1Api(api)
    resp = await core.create_namespaced_pod_binding(
        name,
        namespace,
        binding_body(namespace, name, node, uid=uid, annotations=annotations),
        _preload_content=False,
        _request_timeout=timeout_s,
    )
    return await read_json(resp)
