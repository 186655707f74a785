"""Pods of the real-node tier and what their containers received.

Every container runs the nodes' busybox image (never pulled: there is no registry), prints its whole environment
between two markers, then does what the test asks (sleep, exit, crash once). The environment is read back from the
container's output through kube-apiserver and the node's real kubelet, as `kubectl logs` reads it.
"""

from __future__ import annotations

import asyncio
from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.waits import poll
from shared.annotations import RESOURCE_COUNT, RESOURCE_MEM

BEGIN, END = "=== environment ===", "=== end of environment ==="
SLEEP = "exec sleep 3600"
GPU_KEYS = (
    "NVIDIA_VISIBLE_DEVICES",
    "ALIYUN_COM_GPU_MEM_IDX",
    "ALIYUN_COM_GPU_MEM_CONTAINER",
    "GPUSHARE_GPU_MEMORY_MIB",
)


def printing(then: str = SLEEP) -> list[str]:
    """A command printing the environment, then running `then` (a shell snippet)."""
    return ["sh", "-c", f"echo '{BEGIN}'; env; echo '{END}'; {then}"]


def container(
    name: str, image: str, *, mem: int | None = None, count: int | None = None, then: str = SLEEP, **extra: Any
) -> dict[str, Any]:
    """A busybox container printing its environment; `mem` GiB of `aliyun.com/gpu-mem` (and `count` GPUs)."""
    limits = {}
    if mem is not None:
        limits[RESOURCE_MEM] = str(mem)
    if count is not None:
        limits[RESOURCE_COUNT] = str(count)
    body = {"name": name, "image": image, "imagePullPolicy": "Never", "command": printing(then), **extra}
    if limits:
        body["resources"] = {"limits": limits}
    return body


def pod(
    name: str,
    containers: list[dict[str, Any]],
    *,
    init: list[dict[str, Any]] | None = None,
    node: str | None = None,
    grace_s: int = 1,
    **spec: Any,
) -> dict[str, Any]:
    """A pod of those containers (on `node` through a node selector, when given)."""
    body: dict[str, Any] = {"containers": containers, "terminationGracePeriodSeconds": grace_s, **spec}
    if init:
        body["initContainers"] = init
    if node:
        body["nodeSelector"] = {"kubernetes.io/hostname": node}
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"name": name}, "spec": body}


def parse_environment(log: str) -> dict[str, str] | None:
    """The environment printed between the markers (the last such block), None before it is complete (pure)."""
    end = log.rfind(END)
    begin = log.rfind(BEGIN, 0, end)
    if begin < 0 or end < 0:
        return None
    env = {}
    for line in log[begin + len(BEGIN) : end].strip("\n").splitlines():
        key, sep, value = line.partition("=")
        if sep:
            env[key] = value
    return env


async def printed_env(
    api: client.ApiClient, namespace: str, name: str, container: str, *, previous: bool = False, timeout_s: float = 60
) -> dict[str, str]:
    """The environment a container printed (`previous`: its run before the last restart), through the API server
    and the node's kubelet."""
    core = client.CoreV1Api(api)

    async def read() -> dict[str, str] | None:
        try:
            log = await core.read_namespaced_pod_log(name, namespace, container=container, previous=previous)
        except ApiException as exc:
            if exc.status in (400, 404):  # not started yet (or no previous run yet)
                return None
            raise
        return parse_environment(str(log))

    return await poll(read, timeout_s, interval=0.3, what=f"the environment {namespace}/{name}/{container} printed")


def gpu_view(env: dict[str, str]) -> dict[str, str]:
    """The GPU variables of an environment that the ledger decides."""
    return {k: env[k] for k in GPU_KEYS if k in env}


async def wait_pod(
    api: client.ApiClient, namespace: str, name: str, check: Any, what: str, timeout_s: float = 60
) -> client.V1Pod:
    """The pod once `check(pod)` is true."""
    core = client.CoreV1Api(api)

    async def read() -> client.V1Pod | None:
        p = await core.read_namespaced_pod(name, namespace)
        return p if check(p) else None

    return await poll(read, timeout_s, interval=0.3, what=f"{namespace}/{name}: {what}")


async def wait_running(api: client.ApiClient, namespace: str, name: str, timeout_s: float = 60) -> client.V1Pod:
    """The pod once it is Running with every app container ready."""
    return await wait_pod(
        api,
        namespace,
        name,
        lambda p: p.status.phase == "Running" and all(c.ready for c in p.status.container_statuses or []),
        "Running",
        timeout_s,
    )


async def events_of(api: client.ApiClient, namespace: str, name: str) -> list[str]:
    """`reason: message` of every event about the pod."""
    events = await client.CoreV1Api(api).list_namespaced_event(namespace, field_selector=f"involvedObject.name={name}")
    return [f"{e.reason}: {e.message}" for e in events.items]


async def gone(api: client.ApiClient, namespace: str, name: str, timeout_s: float = 60) -> None:
    """Until the pod object is gone (kubelet confirmed its containers stopped)."""
    core = client.CoreV1Api(api)

    async def absent() -> bool:
        try:
            await core.read_namespaced_pod(name, namespace)
        except ApiException as exc:
            if exc.status == 404:
                return True
            raise
        return False

    await poll(absent, timeout_s, interval=0.3, what=f"{namespace}/{name} to be gone")


async def settle(seconds: float) -> None:
    """Let time pass (only where a test shows something does NOT happen within it)."""
    await asyncio.sleep(seconds)
