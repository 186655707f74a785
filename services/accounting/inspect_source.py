"""Where `gpushare inspect` / `kubectl inspect gpushare` reads its nodes from, in this order:

1. `--accounting-url` / `GPUSHARE_ACCOUNTING_URL`, when set: accounting's REST API at that URL, nothing else.
2. A Kubernetes configuration (`--kubeconfig`, `$KUBECONFIG`, `~/.kube/config`, in-cluster; `--context`):
   accounting through the API server's service proxy,
   `/api/v1/namespaces/<-n>/services/gpushare-accounting:http/proxy/v1/...`, so the user's credentials and RBAC
   (`get` on `services/proxy`) decide who may look. When that fails (no such Service, no ready endpoint,
   forbidden, a timeout), what the API server alone shows (`inspect_cluster`: node capacity, the gpushare
   ResourceSlices of DRA nodes and the pods' gpushare annotations), with a note saying why.
3. Neither: accounting at `http://127.0.0.1:8080` (on accounting's own pod, or behind a port-forward).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any

import aiohttp
import httpx
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException
from kubernetes_asyncio.config.config_exception import ConfigException

from shared.dra import DRIVER
from shared.kube.client import api_client, kubeconfig_exists, user_kubeconfig
from shared.kube.raw import read_json, status_message
from shared.settings import MemoryUnit, Settings

from .inspect_cluster import nodes_from_cluster

NAMESPACE = "gpushare-system"  # where the manifests install accounting
SERVICE = "gpushare-accounting"
PORT_NAME = "http"  # the Service port accounting's API is on
FROM_ACCOUNTING = "accounting"
FROM_KUBERNETES = "kubernetes"
PAGE = 500  # pods per list call when reading the API server alone
PARALLEL = 8  # node details fetched at once

Get = Callable[[str], Awaitable[Any]]


class Unavailable(Exception):
    """A source could not answer; the message says which and why."""


class NotFound(LookupError):
    """The node asked for is not there."""


@dataclass
class Reading:
    """What `inspect` shows: API-shaped nodes, their memory unit, where they came from and a note about it."""

    nodes: list[dict[str, Any]]
    unit: str
    source: str
    note: str = ""


@dataclass
class Request:
    """What the user asked for and where to look."""

    node: str | None = None
    detail: bool = False
    kubeconfig: str | None = None
    context: str | None = None
    namespace: str = NAMESPACE
    timeout_s: float = 10.0


async def fetch(get: Get, request: Request) -> tuple[list[dict[str, Any]], str]:
    """Nodes from accounting's API (with allocations when `detail` or a node is named) and the memory unit."""
    if request.node:
        one = await get(f"/v1/nodes/{request.node}")
        if not isinstance(one, dict) or "gpus" not in one:
            raise Unavailable(f"the answer to /v1/nodes/{request.node} is not accounting's (no `gpus`)")
        return [one], one.get("memory_unit", "GiB")
    listing = await get("/v1/nodes")
    if not isinstance(listing, dict) or not isinstance(listing.get("items"), list):
        raise Unavailable("the answer to /v1/nodes is not accounting's (no `items` list)")
    nodes = listing["items"]
    if request.detail:
        gate = asyncio.Semaphore(PARALLEL)

        async def detail(name: str) -> Any:
            async with gate:
                return await get(f"/v1/nodes/{name}")

        nodes = list(await asyncio.gather(*(detail(n["name"]) for n in nodes)))
    return nodes, listing.get("memory_unit", "GiB")


def _answer(status: int, body: bytes, where: str) -> Any:
    """Accounting's JSON answer, NotFound for its 404, Unavailable for any other error."""
    if status == 404:
        try:
            message = json.loads(body).get("error", "not found")
        except (ValueError, AttributeError):
            message = "not found"
        raise NotFound(message)
    if status >= 400:
        raise Unavailable(f"accounting answered {status} for {where}: {body[:300].decode(errors='replace')}")
    return json.loads(body)


async def from_url(base_url: str, request: Request) -> Reading:
    """Accounting's REST API at `base_url`."""
    async with httpx.AsyncClient(base_url=base_url, timeout=request.timeout_s) as http:

        async def get(path: str) -> Any:
            try:
                response = await http.get(path)
            except httpx.HTTPError as exc:
                raise Unavailable(
                    f"cannot reach accounting at {base_url} ({exc.__class__.__name__}: {exc}); "
                    "set --accounting-url or GPUSHARE_ACCOUNTING_URL"
                ) from None
            return _answer(response.status_code, response.content, path)

        nodes, unit = await fetch(get, request)
    return Reading(nodes, unit, FROM_ACCOUNTING)


class ApiServerUnreachable(Unavailable):
    """The API server itself did not answer (so nothing can be read through it)."""


async def _kube_json(host: str, call: Callable[[], Awaitable[Any]]) -> dict[str, Any]:
    """The JSON body of one API call made with `_preload_content=False` (ApiException for non-2xx answers).

    A connection that fails is ApiServerUnreachable; a timeout stays a TimeoutError for the caller to judge (the
    service proxy may be the one waiting, on an endpoint that does not answer).
    """
    try:
        return await read_json(await call())
    except TimeoutError:
        raise
    except (aiohttp.ClientError, OSError) as exc:
        why = f"{exc.__class__.__name__}: {exc}" if str(exc) else exc.__class__.__name__
        raise ApiServerUnreachable(f"cannot reach the API server at {host} ({why})") from None


async def through_apiserver(api: client.ApiClient, request: Request) -> Reading:
    """Accounting through the API server's service proxy (Unavailable when the proxy cannot reach it)."""
    core = client.CoreV1Api(api)
    host = api.configuration.host
    where = f"service {request.namespace}/{SERVICE} through the API server at {host}"

    async def get(path: str) -> Any:
        try:
            return await _kube_json(
                host,
                lambda: core.connect_get_namespaced_service_proxy_with_path(
                    f"{SERVICE}:{PORT_NAME}",
                    request.namespace,
                    path.lstrip("/"),
                    _preload_content=False,
                    _request_timeout=request.timeout_s,
                ),
            )
        except ApiException as exc:
            try:
                body = json.loads(exc.body or "{}")
            except ValueError:
                body = {}
            kubernetes_status = isinstance(body, dict) and body.get("kind") == "Status"
            if exc.status == 404 and not kubernetes_status:
                raise NotFound(body.get("error", "not found") if isinstance(body, dict) else "not found") from None
            raw = exc.body.decode(errors="replace") if isinstance(exc.body, bytes) else exc.body
            detail = status_message(exc) if kubernetes_status else (raw or exc.reason or "")[:300]
            raise Unavailable(f"{where}: {exc.status} {detail}".rstrip()) from None
        except ValueError as exc:
            raise Unavailable(f"{where}: the answer is not accounting's JSON ({exc})") from None

    # Paths are sent as they are: `/` and `:` must not be escaped inside the proxied path and the service name.
    api.configuration.safe_chars_for_path_param = "/:"
    try:
        nodes, unit = await fetch(get, request)
    except TimeoutError:
        raise Unavailable(f"{where}: no answer within {request.timeout_s:g} s") from None
    return Reading(nodes, unit, FROM_ACCOUNTING)


async def from_apiserver(api: client.ApiClient, request: Request, unit: MemoryUnit) -> list[dict[str, Any]]:
    """Nodes as the API server alone shows them: capacity and the pods' gpushare annotations."""
    core = client.CoreV1Api(api)
    host = api.configuration.host
    node_selector = {"field_selector": f"metadata.name={request.node}"} if request.node else {}
    try:
        listed = await _kube_json(
            host, lambda: core.list_node(_preload_content=False, _request_timeout=request.timeout_s, **node_selector)
        )
        nodes = listed.get("items") or []
        fields = "status.phase!=Succeeded,status.phase!=Failed," + (
            f"spec.nodeName={request.node}" if request.node else "spec.nodeName!="
        )
        pod_list: list[dict[str, Any]] = []
        token: str | None = None
        while True:
            page = {"_continue": token} if token else {}
            body = await _kube_json(
                host,
                lambda page=page: core.list_pod_for_all_namespaces(  # type: ignore[misc]
                    field_selector=fields,
                    limit=PAGE,
                    _preload_content=False,
                    _request_timeout=request.timeout_s,
                    **page,
                ),
            )
            pod_list += body.get("items") or []
            token = (body.get("metadata") or {}).get("continue")
            if not token:
                break
    except ApiException as exc:
        raise Unavailable(
            f"the API server at {host} refused to list nodes and pods: {exc.status} {status_message(exc)}"
        ) from None
    except TimeoutError:
        raise ApiServerUnreachable(f"the API server at {host} did not answer within {request.timeout_s:g} s") from None
    shown = nodes_from_cluster(nodes, pod_list, unit, await _gpushare_slices(api, request))
    if request.node and not shown:
        raise NotFound(
            f"no GPU-sharing node {request.node!r} in the cluster (no {unit.value} of aliyun.com/gpu-mem, no gpushare "
            "ResourceSlice)"
        )
    return shown


async def _gpushare_slices(api: client.ApiClient, request: Request) -> list[dict[str, Any]]:
    """The gpushare driver's ResourceSlices (the GPUs of DRA nodes); [] where the cluster serves no
    resource.k8s.io/v1 (before 1.34) or the user may not list them (then DRA nodes are not shown)."""
    fields = f"spec.driver={DRIVER}" + (f",spec.nodeName={request.node}" if request.node else "")
    try:
        body = await _kube_json(
            api.configuration.host,
            lambda: client.ResourceV1Api(api).list_resource_slice(
                field_selector=fields, _preload_content=False, _request_timeout=request.timeout_s
            ),
        )
    except (ApiException, TimeoutError):
        return []
    return list(body.get("items") or [])


async def read(settings: Settings, request: Request) -> Reading:
    """The nodes to show, from the first source that answers (see the module's docstring)."""
    if "accounting_url" in settings.model_fields_set:
        return await from_url(settings.accounting_url, request)
    path = user_kubeconfig(request.kubeconfig)
    if path and not kubeconfig_exists(path):
        raise Unavailable(f"kubeconfig {path} does not exist")
    try:
        api = await api_client(path, context=request.context)
    except Exception as exc:  # a user's kubeconfig fails in many ways (YAML, shape, an exec plugin): say which
        if path or request.context or not isinstance(exc, ConfigException | OSError):
            why = f"{exc.__class__.__name__}: {exc}".replace("\n", " ")
            raise Unavailable(f"cannot use the Kubernetes configuration {path or ''}: {why}") from None
        try:
            return await from_url(settings.accounting_url, request)
        except Unavailable as unreachable:
            raise Unavailable(
                f"no Kubernetes configuration (--kubeconfig, KUBECONFIG, ~/.kube/config, in-cluster), and {unreachable}"
            ) from None
    try:
        try:
            return await through_apiserver(api, request)
        except ApiServerUnreachable:
            raise
        except Unavailable as exc:
            reason = str(exc)
        try:
            nodes = await from_apiserver(api, request, settings.resource_memory_unit)
        except ApiServerUnreachable:
            raise
        except Unavailable as exc:
            raise Unavailable(f"accounting is unreachable ({reason}), and {exc}") from None
        note = (
            f"accounting is unreachable ({reason}); showing what the API server alone knows: node capacity and "
            "gpushare pod annotations (no usage, GPU models or UUIDs)"
        )
        return Reading(nodes, settings.resource_memory_unit.value, FROM_KUBERNETES, " ".join(note.split()))
    finally:
        await api.close()
