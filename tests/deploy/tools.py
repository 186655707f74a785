"""Helpers for the deployment checks: find (or install) kubectl, render kustomizations, load objects.

Tools the checks need are installed here, idempotently: kubectl comes from any `kubectl` on PATH, else
Debian's `kubernetes-client` package (`apt-get install`, root only). When a tool cannot be had the check
skips with the reason, or fails under `CI=true`.
"""

from __future__ import annotations

import subprocess
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.system_tools import ensure_tool, unavailable  # noqa: F401 - unavailable is re-exported

ROOT = Path(__file__).resolve().parents[2]
K8S = ROOT / "k8s"
# Every kustomization an operator may apply (the second scheduler's own directory is applied through its overlay).
KUSTOMIZATIONS = (
    "base",
    "overlays/managed-postgres",
    "overlays/gpushare-compat",
    "overlays/second-scheduler",
    "overlays/before-1.30",
    "overlays/with-components",
    "overlays/extender-mtls",
    "overlays/ha",
    "overlays/dra",
)
NAMESPACE = "gpushare-system"
# The release (pyproject.toml's version): the image's tag, the chart's version, the migration Job's name.
VERSION = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["version"]
MIGRATE_JOB = "gpushare-migrate-" + VERSION.replace(".", "-")


def ensure_kubectl() -> str:
    """Path of a kubectl with `kustomize` (installing Debian's kubernetes-client when none is on PATH)."""
    return ensure_tool(("kubectl",), "kubernetes-client")


def load_all(text: str) -> list[dict[str, Any]]:
    """Every non-empty YAML document in `text`."""
    return [doc for doc in yaml.safe_load_all(text) if doc]


def render(kubectl: str, kustomization: str) -> list[dict[str, Any]]:
    """`kubectl kustomize k8s/<kustomization>` as a list of objects (fails the test with kubectl's error)."""
    proc = subprocess.run(
        [kubectl, "kustomize", str(K8S / kustomization)], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        pytest.fail(f"kubectl kustomize k8s/{kustomization} failed:\n{proc.stderr}")
    return load_all(proc.stdout)


def key(obj: dict[str, Any]) -> tuple[str, str]:
    """`(kind, name)` of an object."""
    return obj["kind"], obj["metadata"]["name"]


def find(objects: list[dict[str, Any]], kind: str, name: str) -> dict[str, Any]:
    """The object of that kind and name (fails the test when absent)."""
    for obj in objects:
        if key(obj) == (kind, name):
            return obj
    pytest.fail(f"{kind}/{name} not rendered; have {sorted(key(o) for o in objects)}")


def pod_spec(obj: dict[str, Any]) -> dict[str, Any] | None:
    """The pod template's spec of a workload, or None for other kinds."""
    if obj["kind"] in {"Deployment", "StatefulSet", "DaemonSet", "Job"}:
        return obj["spec"]["template"]["spec"]
    return None


def runs_on(spec: dict[str, Any], labels: dict[str, str]) -> bool:
    """Whether a pod with this spec may run on a node with these labels: its nodeSelector and its required node
    affinity, as kube-scheduler and the DaemonSet controller decide it (`RequiredNodeAffinity.Match`,
    k8s.io/component-helpers/scheduling/corev1/nodeaffinity/nodeaffinity.go, v0.37.2: every nodeSelector pair, and
    one of the nodeSelectorTerms whose matchExpressions all hold; `NotIn` holds for a node without the label,
    `labels.Requirement.Matches` in k8s.io/apimachinery/pkg/labels/selector.go)."""
    if any(labels.get(k) != v for k, v in (spec.get("nodeSelector") or {}).items()):
        return False
    required = (
        (spec.get("affinity") or {}).get("nodeAffinity", {}).get("requiredDuringSchedulingIgnoredDuringExecution")
    )
    if not required:
        return True

    def holds(expr: dict[str, Any]) -> bool:
        present, value = expr["key"] in labels, labels.get(expr["key"])
        match expr["operator"]:
            case "In":
                return present and value in expr["values"]
            case "NotIn":
                return not present or value not in expr["values"]
            case "Exists":
                return present
            case "DoesNotExist":
                return not present
        raise ValueError(f"node affinity operator {expr['operator']} is not used by gpushare's manifests")

    terms = required["nodeSelectorTerms"]  # a term without expressions matches no node
    return any(term.get("matchExpressions") and all(holds(e) for e in term["matchExpressions"]) for term in terms)


def assert_serving_certificate(ca: Path, cert: Path) -> None:
    """`cert` is a TLS server certificate that `ca` signed, by openssl's check (kube-apiserver verifies webhooks so)."""
    proc = subprocess.run(
        ["openssl", "verify", "-CAfile", str(ca), "-purpose", "sslserver", str(cert)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
