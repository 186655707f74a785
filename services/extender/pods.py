"""The pod specs bind needs: the ones filter saw (a bounded LRU by UID), else read from the Kubernetes API."""

from __future__ import annotations

import contextlib
from collections import OrderedDict
from typing import Any

from services.extender.wire import BindingArgs


class PodUnavailable(Exception):
    """The pod spec could not be found (not seen by filter, and the Kubernetes API cannot tell)."""


class PodCache:
    """Pods by UID as filter saw them; `spec` falls back to the API (`kubeconfig`, `$KUBECONFIG`, in-cluster)."""

    def __init__(self, *, size: int = 10_000, kubeconfig: str | None = None, kube_enabled: bool = True) -> None:
        self.size = size
        self.kubeconfig = kubeconfig
        self.kube_enabled = kube_enabled
        self._pods: OrderedDict[str, dict[str, Any]] = OrderedDict()
        self._kube: Any = None

    def remember(self, pod: dict[str, Any]) -> None:
        """Keep a pod spec by UID for bind (bounded LRU)."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        self._pods[uid] = pod
        self._pods.move_to_end(uid)
        while len(self._pods) > self.size:
            self._pods.popitem(last=False)

    async def spec(self, args: BindingArgs) -> dict[str, Any]:
        """The pod filter saw, or the pod read from the Kubernetes API (raises PodUnavailable)."""
        pod = self._pods.get(args.pod_uid)
        if pod is not None:
            return pod
        if not self.kube_enabled:
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} ({args.pod_uid}) was not seen by this replica's filter "
                "and the Kubernetes API is not configured"
            )
        try:
            from kubernetes_asyncio import client

            from shared.kube.client import api_client

            if self._kube is None:
                self._kube = await api_client(self.kubeconfig)
            found = await client.CoreV1Api(self._kube).read_namespaced_pod(args.pod_name, args.pod_namespace)
            pod = self._kube.sanitize_for_serialization(found)
        except Exception as exc:
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} was not seen by this replica's filter and could not be "
                f"read from the Kubernetes API: {exc}"
            ) from None
        if (pod.get("metadata") or {}).get("uid") != args.pod_uid:
            raise PodUnavailable(f"pod {args.pod_namespace}/{args.pod_name} now has another UID (it was recreated)")
        self.remember(pod)
        return pod

    async def close(self) -> None:
        """Close the Kubernetes API client, if one was opened."""
        if self._kube is not None:
            with contextlib.suppress(Exception):
                await self._kube.close()
