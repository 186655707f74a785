"""The ResourceClaimTemplates gpushare admission wrote, deleted once no workload has used them for a while.

gpushare admission names a template after the demand it asks (`gpushare-<hash>`) and writes it in the pod's
namespace; every pod of a workload, and every workload with the same demand, uses it. Nothing else deletes them, so
without this a namespace would keep one template per demand it ever asked. The binder's pod watch (the leader's)
tells which templates live pods reference (`spec.resourceClaims[].resourceClaimTemplateName`); every
`interval_s` the sweeper lists the templates labelled `app.kubernetes.io/managed-by=gpushare-admission` and deletes
those no live pod has referenced for `grace_s` (and not created within it), with the template's resourceVersion as
a precondition (one written again meanwhile stays).

A pod admitted just before a deletion may still name the deleted template (admission trusts a template it saw for
30 s, `TEMPLATE_TRUSTED_S`, and a pod is created a moment after its admission): the resourceclaim controller could
then not make its claim. So the sweeper remembers what it deleted for `REMEMBER_S`, and when the pod watch shows a
pod naming one of those templates, writes it again (the same spec; the controller retries the pod's claim). Only
the templates gpushare wrote are ever touched. Pods are followed only while the watch is synced; the first pass
waits for it, so a template a listed pod uses is never taken for unused.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from shared.dra.admission import MANAGED_BY, MANAGED_BY_LABEL, TEMPLATE_PREFIX
from shared.kube import pods
from shared.kube.raw import DEFAULT_TIMEOUT_S, read_json
from shared.kube.watching import DELETED

log = logging.getLogger(__name__)

REMEMBER_S = 3600.0
Key = tuple[str, str]  # (namespace, template name)


def templates_of(pod: dict[str, Any]) -> set[str]:
    """The gpushare templates a pod's claims are made from (pure)."""
    entries = (pod.get("spec") or {}).get("resourceClaims") or []
    names = {str(e.get("resourceClaimTemplateName") or "") for e in entries}
    return {n for n in names if n.startswith(TEMPLATE_PREFIX)}


def removable(body: dict[str, Any]) -> dict[str, Any]:
    """A template as it can be written again: its spec and gpushare's labels, nothing the API server set (pure)."""
    meta = body.get("metadata") or {}
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaimTemplate",
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "labels": meta.get("labels") or {}},
        "spec": body.get("spec") or {},
    }


class TemplateSweeper:
    """Follows which gpushare templates live pods use; deletes the ones unused for `grace_s`."""

    def __init__(
        self,
        api: client.ApiClient,
        *,
        grace_s: float = 600.0,
        interval_s: float = 300.0,
        clock: Callable[[], float] = time.monotonic,
        on_outcome: Callable[[str], None] = lambda outcome: None,
    ) -> None:
        self.api = api
        self.on_outcome = on_outcome
        self.resource = client.ResourceV1Api(api)
        self.grace_s = grace_s
        self.interval_s = interval_s
        self.clock = clock
        self.synced = asyncio.Event()  # set by the pod watch once it listed every pod
        self.deleted = 0
        self.rewritten = 0
        self._users: dict[Key, set[str]] = {}  # template -> UIDs of the live pods naming it
        self._pod_templates: dict[str, tuple[str, frozenset[str]]] = {}  # pod UID -> (namespace, templates)
        self._idle_since: dict[Key, float] = {}
        self._gone: dict[Key, tuple[float, dict[str, Any]]] = {}  # templates deleted: when, and what to write again

    # -- the pod watch's hook -----------------------------------------------------------------------------------
    async def on_pod(self, event_type: str, pod: dict[str, Any]) -> None:
        """Follow one pod event (every pod: the hook runs before the binder's GPU filter)."""
        uid = pods.pod_uid(pod)
        if not uid:
            return
        namespace = str(pods.metadata(pod).get("namespace") or "")
        names = frozenset() if event_type == DELETED or pods.is_terminated(pod) else frozenset(templates_of(pod))
        before = self._pod_templates.get(uid)
        if before is not None and before[1] == names:
            return
        for name in before[1] if before is not None else ():
            users = self._users.get((namespace, name), set())
            users.discard(uid)
            if not users:
                self._users.pop((namespace, name), None)
                self._idle_since[(namespace, name)] = self.clock()
        if not names:
            self._pod_templates.pop(uid, None)
            return
        self._pod_templates[uid] = (namespace, names)
        for name in names:
            self._users.setdefault((namespace, name), set()).add(uid)
            self._idle_since.pop((namespace, name), None)
            if (namespace, name) in self._gone:
                await self._write_again((namespace, name))

    def reset(self) -> None:
        """A new term: the pod watch lists again."""
        self.synced.clear()
        self._users.clear()
        self._pod_templates.clear()
        self._idle_since.clear()

    # -- sweeping -----------------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Sweep every `interval_s` once the pod watch has synced, until `stop`."""
        while not stop.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(stop.wait(), self.interval_s)
            if stop.is_set():
                return
            if not self.synced.is_set():
                continue
            try:
                await self.sweep()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the API server is away: the next pass tries again
                log.warning("could not sweep unused gpushare claim templates: %r", exc)

    async def sweep(self) -> int:
        """Delete the gpushare templates no live pod has named for `grace_s`; returns how many were deleted."""
        now = self.clock()
        for key in [k for k, (at, _) in self._gone.items() if now - at > REMEMBER_S]:
            del self._gone[key]
        body = await read_json(
            await self.resource.list_resource_claim_template_for_all_namespaces(
                label_selector=f"{MANAGED_BY_LABEL}={MANAGED_BY}", _preload_content=False, _request_timeout=120
            )
        )
        deleted = 0
        for template in body.get("items") or []:
            meta = template.get("metadata") or {}
            key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
            if key in self._users or not key[1].startswith(TEMPLATE_PREFIX):
                continue
            idle = self._idle_since.setdefault(key, now)  # unused since the watch began, at least
            if now - idle < self.grace_s or _age_s(meta) < self.grace_s:
                continue
            deleted += await self._delete(key, template)
        self.deleted += deleted
        return deleted

    async def _delete(self, key: Key, template: dict[str, Any]) -> int:
        namespace, name = key
        version = (template.get("metadata") or {}).get("resourceVersion")
        try:
            await read_json(
                await self.resource.delete_namespaced_resource_claim_template(
                    name,
                    namespace,
                    body={"preconditions": {"resourceVersion": version}},
                    _preload_content=False,
                    _request_timeout=DEFAULT_TIMEOUT_S,
                )
            )
        except ApiException as exc:
            if exc.status in (404, 409):  # gone, or written again meanwhile
                return 0
            raise
        self._gone[key] = (self.clock(), removable(template))
        self._idle_since.pop(key, None)
        self.on_outcome("deleted")
        log.info(
            "deleted gpushare claim template %s/%s: no pod has used it for %.0f s",
            namespace,
            name,
            self.grace_s,
            extra={"namespace": namespace, "template": name},
        )
        return 1

    async def _write_again(self, key: Key) -> None:
        """A pod names a template this sweeper deleted: write it again, so that its claim can be made."""
        _, body = self._gone.pop(key)
        try:
            await read_json(
                await self.resource.create_namespaced_resource_claim_template(
                    key[0], body, _preload_content=False, _request_timeout=DEFAULT_TIMEOUT_S
                )
            )
        except ApiException as exc:
            if exc.status != 409:  # 409: admission wrote it again first
                log.warning("could not write gpushare claim template %s/%s again: %s", *key, exc.reason)
                self._gone[key] = (self.clock(), body)  # the pod's next event tries again
                return
        self.rewritten += 1
        self.on_outcome("written_again")
        log.info("wrote gpushare claim template %s/%s again: a new pod names it", *key)


def _age_s(meta: dict[str, Any]) -> float:
    """Seconds since the template was created (by the local clock; 0 when unknown)."""
    created = meta.get("creationTimestamp")
    if not created:
        return 0.0
    try:
        at = datetime.fromisoformat(str(created).replace("Z", "+00:00"))
    except ValueError:
        return 0.0
    return max(0.0, (datetime.now(UTC) - at).total_seconds())
