"""The pod spec bind reserves for: read from the Kubernetes API, never taken from whoever called filter.

Filter calls are unauthenticated in the usual set-up (plain HTTP, as kube-scheduler's extender protocol is
often run), so a pod described by a filter call is a claim, not a fact: a forged filter call with a real pod's
UID and other resources would otherwise steer that pod's reservation. With the API configured (the default:
`--kubeconfig`, `$KUBECONFIG` or in-cluster), bind takes the pod from the API server and refuses when its
UID is not the one kube-scheduler asked to bind; the resources, annotations and owner it reserves for are the
API server's.

Where from: a list-then-watch of unbound pods (`spec.nodeName=`) keeps the GPU pods among them, so most binds
need no request of their own; a pod the watch has not shown yet (it may trail kube-scheduler's informer by
milliseconds), or shows under another UID, is read with a GET as before. The watch needs `list` and `watch`
on pods; without them it retries in the background and every bind reads its pod.

Only `--trust-filter-pods` (local development and benchmarks without an API server) makes bind use what
filter saw: an LRU bounded by entries and by bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections import OrderedDict
from typing import Any

from services.extender.metrics import BIND_POD_READS
from services.extender.wire import BindingArgs
from shared.http import dump_json
from shared.kube import pods
from shared.kube.pod_index import PodIndex
from shared.kube.pods import Pod
from shared.kube.watching import SYNCED, watch_objects

log = logging.getLogger(__name__)

FROM_WATCH = BIND_POD_READS.labels(source="watch")
FROM_API = BIND_POD_READS.labels(source="api")
DEFAULT_MAX_ENTRIES = 10_000
DEFAULT_MAX_BYTES = 64 * 1024 * 1024  # a pod object may be ~1.5 MiB (etcd's request limit): entries alone are no bound


class PodUnavailable(Exception):
    """The pod could not be verified (not in the API, another UID, or no trusted source configured)."""


class FilterPods:
    """Pods by UID as filter calls described them (untrusted): an LRU bounded by entries and by bytes."""

    def __init__(self, *, max_entries: int = DEFAULT_MAX_ENTRIES, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self.max_entries = max_entries
        self.max_bytes = max_bytes
        self.bytes = 0
        self._pods: OrderedDict[str, tuple[dict[str, Any], int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._pods)

    def remember(self, pod: dict[str, Any]) -> None:
        """Keep a pod spec by UID; the oldest go first when either bound is passed (a pod larger than the byte
        bound is not kept at all)."""
        uid = (pod.get("metadata") or {}).get("uid")
        if not isinstance(uid, str) or not uid:
            return
        size = len(dump_json(pod))
        self.forget(uid)
        if size > self.max_bytes:
            return
        self._pods[uid] = (pod, size)
        self.bytes += size
        while len(self._pods) > self.max_entries or self.bytes > self.max_bytes:
            _, (_, dropped) = self._pods.popitem(last=False)
            self.bytes -= dropped

    def forget(self, uid: str) -> None:
        """Drop one pod."""
        found = self._pods.pop(uid, None)
        if found is not None:
            self.bytes -= found[1]

    def get(self, uid: str) -> dict[str, Any] | None:
        """The pod filter saw under this UID, if still kept."""
        found = self._pods.get(uid)
        if found is None:
            return None
        self._pods.move_to_end(uid)
        return found[0]


def unbound_gpu_pod(pod: Pod) -> Pod | None:
    """What the extender's pod watch keeps: an unbound pod that asks for gpushare's resources (pure)."""
    return pod if not pods.node_name(pod) and pods.requests_resource_prefix(pod) else None


class PodCache:
    """Where bind gets its pod: the Kubernetes API (verified by UID), or, only with `trust_filter`, filter's LRU."""

    def __init__(
        self,
        *,
        size: int = DEFAULT_MAX_ENTRIES,
        max_bytes: int = DEFAULT_MAX_BYTES,
        kubeconfig: str | None = None,
        kube_enabled: bool = True,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.kube_enabled = kube_enabled
        self.trust_filter = not kube_enabled
        self.filtered = FilterPods(max_entries=size, max_bytes=max_bytes)
        self.watched = PodIndex(unbound_gpu_pod, max_entries=size)
        self._kube: Any = None
        self._opening = asyncio.Lock()

    async def api(self) -> Any:
        """The Kubernetes API client (opened on first use)."""
        return await self._api()

    async def _api(self) -> Any:
        from shared.kube.client import api_client

        async with self._opening:  # the watch and the first binds may ask at once: one client
            if self._kube is None:
                self._kube = await api_client(self.kubeconfig)
        return self._kube

    async def watch(self, *, retry_s: float = 5.0) -> None:
        """Feed `watched` from a list-then-watch of unbound pods, until cancelled (nothing to do when bind
        trusts filter)."""
        if self.trust_filter:
            return
        from kubernetes_asyncio import client

        while True:
            try:
                core = client.CoreV1Api(await self._api())
                break
            except Exception as exc:
                log.warning("no Kubernetes API for the pod watch yet (%s); bind reads each pod", _short(exc))
                await asyncio.sleep(retry_s)
        async for event in watch_objects(
            core.list_pod_for_all_namespaces, what="unbound pods", field_selector="spec.nodeName="
        ):
            if event.type == SYNCED:
                self.watched.synced()
            else:
                self.watched.update(event.type, event.object)

    def remember(self, pod: dict[str, Any]) -> None:
        """Called for every filter call: kept only when bind trusts filter (nothing is kept otherwise)."""
        if self.trust_filter:
            self.filtered.remember(pod)

    async def spec(self, args: BindingArgs) -> dict[str, Any]:
        """The pod to reserve for (raises PodUnavailable with the reason)."""
        if self.trust_filter:
            pod = self.filtered.get(args.pod_uid)
            if pod is None:
                raise PodUnavailable(
                    f"pod {args.pod_namespace}/{args.pod_name} ({args.pod_uid}) was not seen by this replica's "
                    "filter (--trust-filter-pods: the Kubernetes API is not used)"
                )
            return pod
        watched = self.watched.get(args.pod_namespace, args.pod_name)
        if watched is not None and pods.pod_uid(watched) == args.pod_uid:
            FROM_WATCH.inc()
            return watched
        FROM_API.inc()
        try:
            from kubernetes_asyncio import client

            from shared.kube.raw import DEFAULT_TIMEOUT_S, read_json

            # the pod as the API server's JSON: no model objects built and serialised back on every bind
            pod = await read_json(
                await client.CoreV1Api(await self._api()).read_namespaced_pod(
                    args.pod_name, args.pod_namespace, _preload_content=False, _request_timeout=DEFAULT_TIMEOUT_S
                )
            )
        except Exception as exc:
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} could not be read from the Kubernetes API: {_short(exc)}"
            ) from None
        uid = (pod.get("metadata") or {}).get("uid")
        if uid != args.pod_uid:
            log.warning(
                "bind named a pod UID the API server does not have",
                extra={"pod": f"{args.pod_namespace}/{args.pod_name}", "asked_uid": args.pod_uid, "uid": uid},
            )
            raise PodUnavailable(
                f"pod {args.pod_namespace}/{args.pod_name} has UID {uid}, not {args.pod_uid} (recreated, or the "
                "bind call names a pod that does not exist)"
            )
        node = (pod.get("spec") or {}).get("nodeName")
        if node and node != args.node:
            raise PodUnavailable(f"pod {args.pod_namespace}/{args.pod_name} is already bound to node {node}")
        return pod

    async def close(self) -> None:
        """Close the Kubernetes API client, if one was opened."""
        if self._kube is not None:
            with contextlib.suppress(Exception):
                await self._kube.close()


def _short(exc: Exception) -> str:
    status = getattr(exc, "status", None)
    if status == 404:
        return "not found"
    reason = getattr(exc, "reason", None)
    return f"{status} {reason}" if status else (str(exc)[:300] or type(exc).__name__)
