"""The demo workload, shaped like the classic gpushare example: BERT training (4 GiB) and ResNet inference (2 GiB)."""

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


def demo_deployments(training_replicas: int = 2, inference_replicas: int = 4) -> list[dict[str, Any]]:
    """BERT training with 4 GiB pods and ResNet inference with 2 GiB pods."""
    return [
        deployment(
            "bert-training",
            replicas=training_replicas,
            gpu_mem=4,
            image="nvcr.io/nvidia/pytorch:23.10-py3",
            command=["python", "run_squad.py", "--model", "bert-base-uncased"],
        ),
        deployment(
            "resnet-inference",
            replicas=inference_replicas,
            gpu_mem=2,
            image="nvcr.io/nvidia/tritonserver:23.10-py3",
            command=["tritonserver", "--model-repository=/models/resnet50"],
        ),
    ]


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


async def submit_demo(api: ApiClient, namespace: str = DEMO_NAMESPACE, *, dra: bool = False) -> list[dict[str, Any]]:
    """Create (or replace) the demo Deployments; returns them. `dra`: the namespace opts in to DRA
    (`gpushare.io/allocator=dra`), and gpushare admission rewrites the unchanged pods into claims."""
    if dra:
        from devstack.stack.admission import opt_in

        await opt_in(api, namespace)
    else:
        await ensure_namespace(api, namespace)
    apps = client.AppsV1Api(api)
    deployments = demo_deployments()
    for dep in deployments:
        try:
            await apps.create_namespaced_deployment(namespace, dep)
        except ApiException as exc:
            if exc.status != 409:
                raise
            await apps.replace_namespaced_deployment(dep["metadata"]["name"], namespace, dep)
    return deployments
