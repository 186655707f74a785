"""The demo workload, shaped like the classic gpushare example: BERT training (4 GiB) and ResNet inference (2 GiB),
and, with the MiB unit, the gpushare guide's 0.5 GB development pods (`gpushare up --memory-unit MiB --dev-pods N`:
`aliyun.com/gpu-mem: 512`; a whole number of GiB cannot say half of one)."""

from __future__ import annotations

from typing import Any

from kubernetes_asyncio import client
from kubernetes_asyncio.client import ApiClient
from kubernetes_asyncio.client.exceptions import ApiException

from shared.annotations import RESOURCE_MEM

DEMO_NAMESPACE = "gpushare-demo"

DEMO_USAGE_RULES = """\
# Simulated GPU usage of `gpushare up` (node agents' --simulate-usage). Edit this file while the stack runs:
# the node agents read it again within seconds. One rule per line, the first that matches a pod wins:
#   NAMESPACE/POD-GLOB=SHAPE   with SHAPE one of (F: a fraction of the pod's share, above 1 is over-use)
#   steady:F   ramp:F1:F2:SECONDS   spike:F1:F2:EVERY:FOR   idle
# BERT training: 80 % of its 4 GiB, and 110 % (over its share) for 40 s every 2 minutes
gpushare-demo/bert-training-*=spike:0.8:1.1:120:40
# ResNet inference: 0.9 GiB of its 2 GiB, steadily (right-sizing will suggest 1 GiB)
gpushare-demo/resnet-inference-*=steady:0.45
# development notebooks (--dev-pods): 30 % of their 512 MiB, their SMs idle (right-sizing says so)
gpushare-demo/dev-notebook-*=steady:0.3,sm:0
# everything else (your own pods): half of the share
*=steady:0.5
"""
"""The demo's usage profile: right-sizing, over-use and the HPA metric have something to show."""


def deployment(name: str, *, replicas: int, gpu_mem: int, image: str, command: list[str]) -> dict[str, Any]:
    """A Deployment whose pods each ask for `gpu_mem` units of `aliyun.com/gpu-mem`."""
    labels = {"app": name, "gpushare.io/demo": "true"}
    return {
        "apiVersion": "apps/v1",
        "kind": "Deployment",
        "metadata": {"name": name, "labels": labels},
        "spec": {
            "replicas": replicas,
            "selector": {"matchLabels": {"app": name}},
            "template": {
                "metadata": {"labels": labels},
                "spec": {
                    # nothing runs to stop: a scaled-down replica goes at once (no kubelet ends a grace period)
                    "terminationGracePeriodSeconds": 0,
                    "containers": [
                        {
                            "name": name,
                            "image": image,
                            "command": command,
                            "resources": {"limits": {RESOURCE_MEM: str(gpu_mem)}},
                        }
                    ],
                },
            },
        },
    }


DEV_POD_MIB = 512
"""The guide's 0.5 GB development pod."""


class DemoError(ValueError):
    """Demo options that cannot be honoured; the message says what to pass instead."""


def demo_deployments(
    training_replicas: int = 2, inference_replicas: int = 4, *, unit_mib: int = 1024, dev_pods: int = 0
) -> list[dict[str, Any]]:
    """BERT training with 4 GiB pods, ResNet inference with 2 GiB pods, and `dev_pods` development notebooks of
    512 MiB, their amounts in the cluster's `aliyun.com/gpu-mem` unit (`unit_mib`: 1024 for GiB, 1 for MiB)."""
    if dev_pods and DEV_POD_MIB % unit_mib:
        raise DemoError(
            f"--dev-pods: a {DEV_POD_MIB} MiB pod is not a whole number of GiB; add --memory-unit MiB "
            "(GPUSHARE_RESOURCE_MEMORY_UNIT=MiB): aliyun.com/gpu-mem then counts MiB"
        )
    out = [
        deployment(
            "bert-training",
            replicas=training_replicas,
            gpu_mem=4 * 1024 // unit_mib,
            image="nvcr.io/nvidia/pytorch:23.10-py3",
            command=["python", "run_squad.py", "--model", "bert-base-uncased"],
        ),
        deployment(
            "resnet-inference",
            replicas=inference_replicas,
            gpu_mem=2 * 1024 // unit_mib,
            image="nvcr.io/nvidia/tritonserver:23.10-py3",
            command=["tritonserver", "--model-repository=/models/resnet50"],
        ),
    ]
    if dev_pods:
        out.append(
            deployment(
                "dev-notebook",
                replicas=dev_pods,
                gpu_mem=DEV_POD_MIB // unit_mib,
                image="jupyter/tensorflow-notebook:latest",
                command=["start-notebook.sh"],
            )
        )
    return out


def demo_pod_count(deployments: list[dict[str, Any]]) -> int:
    """How many pods the demo Deployments ask for."""
    return sum(int(d["spec"]["replicas"]) for d in deployments)


async def ensure_namespace(api: ApiClient, name: str) -> None:
    """Create the namespace unless it exists."""
    try:
        await client.CoreV1Api(api).create_namespace(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": name}}
        )
    except ApiException as exc:
        if exc.status != 409:
            raise


async def submit_demo(
    api: ApiClient,
    namespace: str = DEMO_NAMESPACE,
    *,
    unit_mib: int = 1024,
    dev_pods: int = 0,
    dra: bool = False,
    image: str | None = None,
) -> list[dict[str, Any]]:
    """Create (or replace) the demo Deployments (`demo_deployments`' options); returns them. `dra`: the namespace
    opts in to DRA (`gpushare.io/allocator=dra`), and gpushare admission rewrites the unchanged pods into claims.
    `image`: real nodes run the pods, each container that local image printing the environment it received
    (`demo_containers.printing_environment`)."""
    if dra:
        from devstack.stack.webhook import opt_in

        await opt_in(api, namespace)
    else:
        await ensure_namespace(api, namespace)
    apps = client.AppsV1Api(api)
    deployments = demo_deployments(unit_mib=unit_mib, dev_pods=dev_pods)
    if image is not None:
        from devstack.stack.demo_containers import printing_environment

        deployments = printing_environment(deployments, image)
    for dep in deployments:
        await apply_deployment(apps, namespace, dep)
    return deployments


async def apply_deployment(apps: client.AppsV1Api, namespace: str, dep: dict[str, Any]) -> None:
    """Create a Deployment, or replace the one of that name."""
    try:
        await apps.create_namespaced_deployment(namespace, dep)
    except ApiException as exc:
        if exc.status != 409:
            raise
        await apps.replace_namespaced_deployment(dep["metadata"]["name"], namespace, dep)
