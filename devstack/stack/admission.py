"""The admission policies of k8s/base on the local control plane, so `gpushare up` refuses what a cluster with
gpushare refuses (a pod or workload setting NVIDIA_VISIBLE_DEVICES, ...) with the same message.

The objects are read from k8s/base's policy files themselves (device environment, gpushare's own annotations),
never copied. kube-apiserver serves
`admissionregistration.k8s.io/v1` ValidatingAdmissionPolicies from 1.30; on an older release (1.20) there is
nothing to apply, and `apply_policies` says so. A cluster named by KUBECONFIG is never touched.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

BASE = Path(__file__).resolve().parents[2] / "k8s" / "base"
POLICY_FILES = (BASE / "device-env-policy.yaml", BASE / "annotation-policy.yaml")
FIRST_MINOR = 30  # admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy is GA (and on by default)


def policy_objects(paths: tuple[Path, ...] = POLICY_FILES) -> list[dict[str, Any]]:
    """The ValidatingAdmissionPolicies and their bindings k8s/base ships (pure)."""
    return [o for path in paths for o in yaml.safe_load_all(path.read_text()) if o]


async def apply_policies(api: client.ApiClient, minor: int, paths: tuple[Path, ...] = POLICY_FILES) -> list[str]:
    """Create (or replace) the policies and bindings; returns the policies' names ([] before 1.30)."""
    if minor < FIRST_MINOR:
        return []
    admission = client.AdmissionregistrationV1Api(api)
    names = []
    for obj in policy_objects(paths):
        kind, name = obj["kind"], obj["metadata"]["name"]
        create, replace = {
            "ValidatingAdmissionPolicy": (
                admission.create_validating_admission_policy,
                admission.replace_validating_admission_policy,
            ),
            "ValidatingAdmissionPolicyBinding": (
                admission.create_validating_admission_policy_binding,
                admission.replace_validating_admission_policy_binding,
            ),
        }[kind]
        try:
            await create(obj)
        except ApiException as exc:
            if exc.status != 409:
                raise
            current = await (
                admission.read_validating_admission_policy(name)
                if kind == "ValidatingAdmissionPolicy"
                else admission.read_validating_admission_policy_binding(name)
            )
            obj = {**obj, "metadata": {**obj["metadata"], "resourceVersion": current.metadata.resource_version}}
            await replace(name, obj)
        if kind == "ValidatingAdmissionPolicy":
            names.append(name)
    return names


PROBE_ENV = [{"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"}]
PROBE_POD = {"containers": [{"name": "probe", "image": "x", "env": PROBE_ENV}]}


async def wait_enforced(api: client.ApiClient, namespace: str, timeout_s: float = 60.0) -> bool:
    """Until kube-apiserver enforces both policies (it compiles each from an informer, a moment after it is
    created): probed with server-side dry runs of a pod and a Deployment it must refuse. False when time ran
    out."""
    core, apps = client.CoreV1Api(api), client.AppsV1Api(api)
    labels = {"app": "gpushare-admission-probe"}
    probes = {
        "gpushare-device-env": lambda: core.create_namespaced_pod(
            namespace, {"metadata": {"name": "gpushare-admission-probe"}, "spec": PROBE_POD}, dry_run="All"
        ),
        "gpushare-device-env-workloads": lambda: apps.create_namespaced_deployment(
            namespace,
            {
                "metadata": {"name": "gpushare-admission-probe"},
                "spec": {
                    "selector": {"matchLabels": labels},
                    "template": {"metadata": {"labels": labels}, "spec": PROBE_POD},
                },
            },
            dry_run="All",
        ),
    }
    deadline = time.monotonic() + timeout_s
    while probes and time.monotonic() < deadline:
        for name, probe in list(probes.items()):
            try:
                await probe()
            except ApiException as exc:
                if exc.status == 403 and f"'{name}'" in str(exc.body):
                    del probes[name]
                elif exc.status not in (403, 404):
                    raise
        if probes:
            await asyncio.sleep(0.5)
    return not probes
