"""Workloads by the names people gave them: a Deployment's pods belong to the Deployment, not to a ReplicaSet.

The ledger records each pod's controller (its ownerReference with `controller: true`) as the extender saw it. For
a Deployment's pods that is a ReplicaSet named `<deployment>-<pod-template-hash>`, a name that changes with every
rollout. Accounting names such workloads by the ReplicaSet's own controller, read from the ReplicaSet's
ownerReferences (`get replicasets`, cached). Where the API server cannot say (no Kubernetes access, the
ReplicaSet deleted since), the Deployment is derived from the name: kube-controller-manager names a Deployment's
ReplicaSets `<deployment>-<hash>` (pkg/controller/deployment/sync.go, generateReplicaSetName), the hash being
`rand.SafeEncodeString` of a decimal uint32 (pkg/controller/controller_utils.go, ComputeHash), so its characters
are the images of the digits 0-9, `4-9bcdf`, the first never `4` (a leading zero). A name shaped otherwise keeps
its ReplicaSet. StatefulSets and Jobs own their pods directly and keep their names.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from collections import OrderedDict
from collections.abc import Iterable

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from shared.kube.client import api_client
from shared.kube.raw import read_json

log = logging.getLogger(__name__)

Key = tuple[str, str, str]
"""(namespace, owner kind, owner name) as the ledger records a pod's controller."""
Owner = tuple[str, str]
"""(kind, name) of the workload to show."""

REPLICA_SET = "ReplicaSet"
DEPLOYMENT = "Deployment"
POD_TEMPLATE_HASH = re.compile(r"^(?P<name>.+)-(?P<hash>[5-9bcdf][4-9bcdf]{5,9})$")
"""A Deployment's ReplicaSet name: the hash of a uint32 from 100000 up (shorter ones, one in 40,000 of all hashes,
are left alone: too short to tell from a name a person chose)."""


def derived_owner(kind: str, name: str) -> Owner | None:
    """The Deployment a ReplicaSet name says it belongs to, or None when the name is not shaped like one (pure)."""
    if kind != REPLICA_SET:
        return None
    match = POD_TEMPLATE_HASH.match(name)
    return (DEPLOYMENT, match.group("name")) if match else None


def controller_of(replica_set: dict) -> Owner | None:
    """The controller in a ReplicaSet's ownerReferences (None: an orphan, or a ReplicaSet made by hand)."""
    for ref in (replica_set.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("controller") and ref.get("kind") and ref.get("name"):
            return str(ref["kind"]), str(ref["name"])
    return None


class WorkloadNames:
    """Resolves ReplicaSets to their controllers through the API server (at most `max_entries` remembered, a
    fallback to the name's shape for `retry_s`), never raising: without Kubernetes it derives from names alone."""

    def __init__(
        self,
        kubeconfig: str | None = None,
        *,
        kubernetes: bool = True,
        max_entries: int = 10_000,
        retry_s: float = 60.0,
        timeout_s: float = 5.0,
        concurrency: int = 8,
    ) -> None:
        self.kubeconfig = kubeconfig
        self.kubernetes = kubernetes
        self.max_entries = max_entries
        self.retry_s = retry_s
        self.timeout_s = timeout_s
        self._limit = asyncio.Semaphore(concurrency)
        self._api: client.ApiClient | None = None
        self._known: OrderedDict[tuple[str, str], Owner | None] = OrderedDict()  # read from the API server
        self._derived: dict[tuple[str, str], tuple[float, Owner | None]] = {}  # the API could not say, until then

    async def resolve(self, keys: Iterable[Key]) -> dict[Key, Owner]:
        """The workload to show for each recorded owner that should be shown otherwise (ReplicaSets only)."""
        wanted = {k for k in keys if k[1] == REPLICA_SET}
        answers = await asyncio.gather(*(self._owner(ns, name) for ns, _, name in wanted))
        return {key: owner for key, owner in zip(wanted, answers, strict=True) if owner is not None}

    async def _owner(self, namespace: str, name: str) -> Owner | None:
        key = (namespace, name)
        if key in self._known:
            self._known.move_to_end(key)
            return self._known[key]
        until_owner = self._derived.get(key)
        if until_owner is not None and until_owner[0] > time.monotonic():
            return until_owner[1]
        if self.kubernetes:
            async with self._limit:
                read, owner = await self._read(namespace, name)
            if read:
                self._known[key] = owner
                while len(self._known) > self.max_entries:
                    self._known.popitem(last=False)
                return owner
        owner = derived_owner(REPLICA_SET, name)
        if len(self._derived) >= self.max_entries:
            self._derived.clear()
        self._derived[key] = (time.monotonic() + self.retry_s, owner)
        return owner

    async def _read(self, namespace: str, name: str) -> tuple[bool, Owner | None]:
        """(True, its controller) when the API server showed the ReplicaSet; (False, None) when it could not."""
        try:
            if self._api is None:
                self._api = await api_client(self.kubeconfig)
            apps = client.AppsV1Api(self._api)
            body = await read_json(
                await apps.read_namespaced_replica_set(
                    name, namespace, _preload_content=False, _request_timeout=self.timeout_s
                )
            )
        except ConfigException as exc:
            log.info("no Kubernetes access to name ReplicaSets' owners (%s): deriving them from names", exc)
            self.kubernetes = False
            return False, None
        except ApiException as exc:
            if exc.status != 404:
                log.warning("cannot read ReplicaSet %s/%s: %s; deriving its owner from its name", namespace, name, exc)
            return False, None
        except Exception as exc:  # an unreachable API server must not fail a listing
            log.warning("cannot read ReplicaSet %s/%s (%r); deriving its owner from its name", namespace, name, exc)
            await self.close()
            return False, None
        return True, controller_of(body)

    async def close(self) -> None:
        """Close the API client."""
        if self._api is not None:
            await self._api.close()
            self._api = None
