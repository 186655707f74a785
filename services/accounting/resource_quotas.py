"""Kubernetes ResourceQuotas on gpushare's resources, shown beside the ledger's quotas in `/v1/quotas`.

A ResourceQuota with `requests.aliyun.com/gpu-mem` (or gpu-core, gpu-count) is kube-apiserver's admission cap;
the ledger quota is gpushare's queueing budget (docs/accounting.md compares them). On DRA, Kubernetes counts the
devices a namespace's claims ask of a class, `gpushare-gpu.deviceclass.resource.k8s.io/devices` (one per share:
`V1ResourceByDeviceClass`, pkg/quota/v1/evaluator/core/resource_claims.go), never their memory; those quotas are
shown too, and GiB stay the ledger's (docs/dra.md). Accounting reads the
ResourceQuotas' `status.hard` / `status.used` with a read-only `list resourcequotas` permission, at most once
per `ttl_s`; without Kubernetes access it serves the ledger quotas alone and says why in the answer.
"""

from __future__ import annotations

import asyncio
import logging
import re
import time
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from shared.annotations import RESOURCES
from shared.dra import DEVICE_CLASS
from shared.kube.client import api_client
from shared.kube.raw import read_json, status_message

log = logging.getLogger(__name__)

DRA_DEVICES = f"{DEVICE_CLASS}.deviceclass.resource.k8s.io/devices"
QUOTA_KEYS = {f"requests.{r}": r for r in RESOURCES} | {r: r for r in RESOURCES} | {DRA_DEVICES: DRA_DEVICES}
"""A quota's keys on gpushare's resources (extended resources are quota'd as `requests.<name>`; DRA claims of the
gpushare class as the class's devices) -> resource."""
_SUFFIXES = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30}
_QUANTITY = re.compile(r"^\s*(\d+)(|k|M|G|T|Ki|Mi|Gi)\s*$")


def quantity(text: Any) -> int | None:
    """A whole Kubernetes quantity (`16`, `2k`, `1Gi`), or None when it is not one (extended resources are whole)."""
    match = _QUANTITY.match(str(text))
    return int(match.group(1)) * _SUFFIXES[match.group(2)] if match else None


def gpu_quota_rows(items: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per ResourceQuota and gpushare resource it limits (pure): namespace, name, key, resource, hard,
    used (in the resource's unit; `used` 0 until the quota controller has counted)."""
    rows = []
    for item in items:
        meta = item.get("metadata") or {}
        status = item.get("status") or {}
        hard = status.get("hard") or (item.get("spec") or {}).get("hard") or {}
        used = status.get("used") or {}
        for key in sorted(hard):
            if key not in QUOTA_KEYS or quantity(hard[key]) is None:
                continue
            rows.append(
                {
                    "namespace": str(meta.get("namespace") or ""),
                    "name": str(meta.get("name") or ""),
                    "key": key,
                    "resource": QUOTA_KEYS[key],
                    "hard": quantity(hard[key]),
                    "used": quantity(used.get(key, 0)) or 0,
                }
            )
    return sorted(rows, key=lambda r: (r["namespace"], r["name"], r["key"]))


class ResourceQuotas:
    """Reads the cluster's ResourceQuotas on gpushare's resources (cached `ttl_s`); never raises."""

    def __init__(self, kubeconfig: str | None = None, *, ttl_s: float = 5.0, timeout_s: float = 5.0) -> None:
        self.kubeconfig = kubeconfig
        self.ttl_s = ttl_s
        self.timeout_s = timeout_s
        self._api: client.ApiClient | None = None
        self._lock = asyncio.Lock()
        self._read_at = float("-inf")
        self._last: tuple[list[dict[str, Any]], str | None] = ([], "not read yet")

    async def read(self) -> tuple[list[dict[str, Any]], str | None]:
        """(rows, None), or ([], why they cannot be shown)."""
        async with self._lock:
            if time.monotonic() - self._read_at >= self.ttl_s:
                self._last = await self._read()
                self._read_at = time.monotonic()
                if self._last[1] is not None:  # read the configuration again next time (a new token, a new server)
                    await self.close()
            return self._last

    async def _read(self) -> tuple[list[dict[str, Any]], str | None]:
        try:
            if self._api is None:
                self._api = await api_client(self.kubeconfig)
            core = client.CoreV1Api(self._api)
            body = await read_json(
                await core.list_resource_quota_for_all_namespaces(
                    _preload_content=False, _request_timeout=self.timeout_s
                )
            )
        except ConfigException as exc:
            return [], f"accounting has no Kubernetes access ({exc})"
        except ApiException as exc:
            why = f"the API server refused to list ResourceQuotas: {exc.status} {status_message(exc)}"
            log.warning(why)
            return [], why
        except Exception as exc:  # an unreachable API server must not fail /v1/quotas
            why = f"cannot read ResourceQuotas from the API server ({exc.__class__.__name__}: {exc})"
            log.warning(why)
            return [], why
        return gpu_quota_rows(list(body.get("items") or [])), None

    async def close(self) -> None:
        """Close the API client."""
        if self._api is not None:
            await self._api.close()
            self._api = None
