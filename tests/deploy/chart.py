"""The Helm chart (charts/gpushare) for the deployment checks: the helm binary, rendering, and how a rendered
chart is compared with the kustomize tree object by object.

k8s/ stays the kustomize users' tree and the chart renders the same objects: for every kustomization an operator
may apply, `MODES` names the chart values that select the same mode, and `differences` lists, object by object
and field by field, what the two renderings disagree on after `normalise` has removed what only Helm adds
(its own labels and annotations, the generated credentials' values and the webhook CA's, a restart checksum on a pod
template, the `helm test` pods).
"""

from __future__ import annotations

import difflib
import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.cluster.buildtools import ControlPlaneUnavailable
from devstack.cluster.helm import ensure_helm
from tests.deploy.tools import NAMESPACE, ROOT, load_all
from tests.system_tools import unavailable

CHART = ROOT / "charts" / "gpushare"
RELEASE = "gpushare"
# The Prometheus Operator's API, as a cluster with it serves: the kustomize tree always renders the ServiceMonitor.
WITH_SERVICE_MONITOR = ("--api-versions", "monitoring.coreos.com/v1/ServiceMonitor")

# dra.enabled needs the addresses kube-apiserver calls the webhook from: the overlay's placeholder range
DRA_POLICY: dict[str, Any] = {"admission": {"networkPolicy": {"apiServerCIDRs": ["198.51.100.0/24"]}}}

# kustomization -> (chart values, extra `helm template` flags) that render the same mode.
MODES: dict[str, tuple[dict[str, Any], tuple[str, ...]]] = {
    "base": ({}, ()),
    "overlays/managed-postgres": (
        {
            "postgresql": {"enabled": False},
            "database": {"server": "db.example.internal:5432/gpushare?sslmode=verify-full"},
        },
        (),
    ),
    "overlays/gpushare-compat": (
        {"extender": {"gpushareCompat": {"enabled": True, "controlPlaneCIDR": "198.51.100.0/24"}}},
        (),
    ),
    "overlays/second-scheduler": ({"scheduler": {"mode": "second-scheduler"}}, ()),
    # admissionPolicy: auto leaves the policy out below 1.30, as the overlay does
    "overlays/before-1.30": ({}, ("--kube-version", "v1.29.0")),
    "overlays/with-components": (
        {"mps": {"enabled": True}, "monitoring": {"serviceMonitor": {"labels": {"release": "kube-prometheus-stack"}}}},
        (),
    ),
    "overlays/extender-mtls": ({"extender": {"tls": {"enabled": True}}}, ()),
    "overlays/ha": ({"postgresql": {"mode": "cloudnativepg"}}, ()),
    "overlays/dra": ({"dra": {"enabled": True, **DRA_POLICY}}, ()),
}

HELM_LABELS = {
    "app.kubernetes.io/managed-by",
    "app.kubernetes.io/instance",
    "app.kubernetes.io/version",
    "helm.sh/chart",
}
HELM_ANNOTATION_PREFIXES = ("helm.sh/", "meta.helm.sh/")
CREDENTIAL = "<credential>"
CA_BUNDLE = "<the CA of Secret gpushare-admission-tls>"
# Pod template annotations only the chart writes: a checksum that restarts pods when what they read at start changes.
HELM_POD_ANNOTATION_PREFIXES = ("checksum/",)
ORDERED_LISTS = {"containers", "initContainers", "args", "command", "validations", "variables"}


def helm_binary() -> str:
    """Path of helm v4 (built from the helm.sh/helm/v4 module and cached on first use), or skip / fail."""
    try:
        return str(ensure_helm())
    except ControlPlaneUnavailable as exc:
        unavailable(f"helm unavailable: {exc.reason}")
        raise


def run_helm(helm: str, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess[str]:
    """`helm ARGS`; with `check`, fails the test with helm's error when it exits non-zero."""
    proc = subprocess.run([helm, *args], capture_output=True, text=True, timeout=timeout, check=False)
    if check and proc.returncode != 0:
        pytest.fail(f"helm {' '.join(args)} failed:\n{helm_errors(proc.stderr)}")
    return proc


def helm_errors(stderr: str) -> str:
    """helm's stderr without its notes about the chart's symbolic links (files/ links to k8s/)."""
    return "\n".join(line for line in stderr.splitlines() if "found symbolic link in path" not in line)


def values_file(values: dict[str, Any], directory: Path) -> Path:
    """`values` written as a values file in `directory`."""
    path = directory / f"values-{len(list(directory.glob('values-*.yaml')))}.yaml"
    path.write_text(yaml.safe_dump(values))
    return path


def template(
    helm: str, values: dict[str, Any], flags: tuple[str, ...], directory: Path, *, show_only: str | None = None
) -> list[dict[str, Any]]:
    """`helm template` of the chart with `values` and `flags`, as objects."""
    args = ["template", RELEASE, str(CHART), "--namespace", NAMESPACE, "-f", str(values_file(values, directory))]
    if show_only:
        args += ["--show-only", show_only]
    return load_all(run_helm(helm, *args, *flags).stdout)


def render_mode(helm: str, kustomization: str, directory: Path) -> list[dict[str, Any]]:
    """The chart rendered in the mode of `kustomization` (with the ServiceMonitor's API served)."""
    values, flags = MODES[kustomization]
    return template(helm, values, (*WITH_SERVICE_MONITOR, *flags), directory)


def is_helm_test(obj: dict[str, Any]) -> bool:
    """A `helm test` hook (only the chart has them)."""
    return obj["metadata"].get("annotations", {}).get("helm.sh/hook") == "test"


def normalise(obj: dict[str, Any]) -> dict[str, Any]:
    """`obj` without what only one of the two renderings writes: Helm's labels and annotations, the values of
    credentials (generated by the chart, placeholders in k8s/) and the webhook's caBundle (their CA), the chart's
    restart checksums on pod templates, a Service port's default protocol, and list order where Kubernetes ignores
    it."""
    obj = json.loads(json.dumps(obj))
    meta = obj["metadata"]
    labels = {k: v for k, v in meta.get("labels", {}).items() if k not in HELM_LABELS}
    annotations = {k: v for k, v in meta.get("annotations", {}).items() if not k.startswith(HELM_ANNOTATION_PREFIXES)}
    meta.pop("labels", None)
    meta.pop("annotations", None)
    if labels:
        meta["labels"] = labels
    if annotations:
        meta["annotations"] = annotations
    if obj["kind"] == "Service":  # the chart names the protocol the apiserver defaults (1.20's server-side apply)
        for port in obj["spec"].get("ports", []):
            port.setdefault("protocol", "TCP")
    if obj["kind"] == "Secret":
        obj["data"] = dict.fromkeys(obj.get("data", {}), CREDENTIAL)
        obj.setdefault("type", "Opaque")
    if obj["kind"] in ("MutatingWebhookConfiguration", "ValidatingWebhookConfiguration"):
        # the CA of a credential (test_chart.py checks it is the Secret's)
        for hook in obj.get("webhooks", []):
            hook["clientConfig"]["caBundle"] = CA_BUNDLE
    template = obj.get("spec", {}).get("template", {}).get("metadata", {})
    if template.get("annotations"):
        kept = {k: v for k, v in template["annotations"].items() if not k.startswith(HELM_POD_ANNOTATION_PREFIXES)}
        template.pop("annotations")
        if kept:
            template["annotations"] = kept
    return _unordered(obj, "")


def _unordered(value: Any, key: str) -> Any:
    if isinstance(value, dict):
        return {k: _unordered(v, k) for k, v in value.items()}
    if isinstance(value, list):
        items = [_unordered(v, key) for v in value]
        if key not in ORDERED_LISTS and all(isinstance(i, dict) for i in items):
            items.sort(key=lambda i: json.dumps(i, sort_keys=True))
        return items
    return value


def object_key(obj: dict[str, Any]) -> tuple[str, str, str]:
    """(kind, namespace, name) of an object."""
    meta = obj["metadata"]
    return obj["kind"], meta.get("namespace", ""), meta["name"]


def field_differences(path: str, chart: Any, kustomize: Any) -> list[str]:
    """Lines `path: chart=... kustomize=...` for every leaf where the two values differ."""
    if isinstance(chart, dict) and isinstance(kustomize, dict):
        out: list[str] = []
        for k in sorted(set(chart) | set(kustomize)):
            sub = f"{path}.{k}" if path else k
            if k not in chart:
                out.append(f"{sub}: only in kustomize = {_short(kustomize[k])}")
            elif k not in kustomize:
                out.append(f"{sub}: only in the chart = {_short(chart[k])}")
            else:
                out += field_differences(sub, chart[k], kustomize[k])
        return out
    if isinstance(chart, list) and isinstance(kustomize, list) and len(chart) == len(kustomize):
        out = []
        for i, (a, b) in enumerate(zip(chart, kustomize, strict=True)):
            label = a.get("name", i) if isinstance(a, dict) and a.get("name") == b.get("name") else i
            out += field_differences(f"{path}[{label}]", a, b)
        return out
    if chart != kustomize:
        if isinstance(chart, str) and isinstance(kustomize, str) and "\n" in chart + kustomize:
            return [f"{path}: the texts differ (chart ---, kustomize +++):\n{_text_diff(chart, kustomize)}"]
        return [f"{path}: chart = {_short(chart)}, kustomize = {_short(kustomize)}"]
    return []


def _text_diff(chart: str, kustomize: str) -> str:
    lines = difflib.unified_diff(
        chart.splitlines(keepends=True), kustomize.splitlines(keepends=True), "chart", "kustomize", n=1
    )
    return "".join(f"    {line!r}\n" for line in list(lines)[2:14])


def _short(value: Any) -> str:
    text = json.dumps(value, sort_keys=True)
    return text if len(text) <= 300 else text[:300] + "..."


def differences(chart: list[dict[str, Any]], kustomize: list[dict[str, Any]]) -> list[str]:
    """What the chart's and the kustomize tree's objects disagree on, object by object (empty when none)."""
    ours = {object_key(o): normalise(o) for o in chart if not is_helm_test(o)}
    theirs = {object_key(o): normalise(o) for o in kustomize}
    out: list[str] = []
    for k in sorted(set(ours) | set(theirs)):
        name = "/".join(p for p in k if p)
        if k not in ours:
            out.append(f"{name}: rendered by kustomize only")
        elif k not in theirs:
            out.append(f"{name}: rendered by the chart only")
        else:
            out += [f"{name}: {line}" for line in field_differences("", ours[k], theirs[k])]
    return out
