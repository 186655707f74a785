"""Server-side dry run of every rendered object against a real current kube-apiserver and against 1.20.

Objects whose API group/version a server does not serve are skipped with a note, and the skipped set is
pinned: ServiceMonitor (a CRD of the Prometheus Operator) everywhere, CloudNativePG's Cluster (overlays/ha;
test_ha_overlay.py checks its fields), and on 1.20 the admission policy
(admissionregistration.k8s.io/v1 ValidatingAdmissionPolicy is GA from 1.30). PodDisruptionBudgets are
`policy/v1` (served from 1.21); on 1.20 they are dry-run as `policy/v1beta1`, the same spec, as
docs/install.md tells 1.20 users to apply them.
"""

from __future__ import annotations

import subprocess
import warnings
from typing import Any

import pytest
import yaml

from devstack.cluster import ControlPlane
from tests.deploy.tools import KUSTOMIZATIONS, NAMESPACE, key

EXPECTED_SKIPS = {"monitoring.coreos.com/v1", "postgresql.cnpg.io/v1"}  # CloudNativePG's Cluster: overlays/ha
ADMISSION_POLICY_KINDS = {"ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding"}  # GA in 1.30
SERVERS = ("current", "1.20")


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest) -> ControlPlane:
    """A real kube-apiserver of each release the manifests are checked against."""
    return request.getfixturevalue("apiserver" if request.param == "current" else "apiserver_1_20")


def _kubectl(kubectl: str, cp: ControlPlane, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [kubectl, f"--kubeconfig={cp.kubeconfig_path}", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, check=False)


@pytest.fixture(scope="module")
def served(kubectl: str, server: ControlPlane) -> set[str]:
    proc = _kubectl(kubectl, server, "api-versions")
    assert proc.returncode == 0, proc.stderr
    versions = set(proc.stdout.split())
    assert "apps/v1" in versions
    # The namespace must exist for namespaced objects to be dry-run into it.
    ns = _kubectl(kubectl, server, "create", "namespace", NAMESPACE)
    assert ns.returncode == 0 or "AlreadyExists" in ns.stderr, ns.stderr
    return versions


def _for_1_20(obj: dict[str, Any], served: set[str]) -> dict[str, Any]:
    """A policy/v1 PodDisruptionBudget as policy/v1beta1 when the server has only the latter."""
    if obj["apiVersion"] == "policy/v1" and "policy/v1" not in served and "policy/v1beta1" in served:
        return {**obj, "apiVersion": "policy/v1beta1"}
    return obj


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_server_side_dry_run(
    kubectl: str, server: ControlPlane, served: set[str], rendered: dict[str, list[dict[str, Any]]], name: str
) -> None:
    if name == "overlays/dra" and server.release.minor < 34:
        pytest.skip("overlays/dra is for Kubernetes 1.34+ (resource.k8s.io/v1)")
    objects = [_for_1_20(o, served) for o in rendered[name]]
    if server.release.minor < 30:  # older clusters install k8s/overlays/before-1.30, which leaves these out
        objects = [o for o in objects if o["kind"] not in ADMISSION_POLICY_KINDS]
    applicable = [o for o in objects if o["apiVersion"] in served]
    skipped = {o["apiVersion"] for o in objects} - served
    release = server.release.version
    assert skipped <= EXPECTED_SKIPS, f"unexpected APIs missing from {release}: {skipped - EXPECTED_SKIPS}"
    for api in sorted(skipped):
        kinds = sorted(key(o) for o in objects if o["apiVersion"] == api)
        warnings.warn(f"{name}: not dry-run, {api} is not served by Kubernetes {release}: {kinds}", stacklevel=1)
    assert len(applicable) >= 20
    proc = _kubectl(
        kubectl, server, "apply", "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump_all(applicable)
    )
    assert proc.returncode == 0, f"{name}: dry run refused:\n{proc.stderr}"
    assert len(proc.stdout.split()) == len(applicable), proc.stdout


def test_dry_run_catches_an_invalid_object(kubectl: str, server: ControlPlane, served: set[str]) -> None:
    bad = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": "bad", "namespace": NAMESPACE},
        "spec": {"ports": [{"port": 70000}]},
    }
    proc = _kubectl(kubectl, server, "apply", "--dry-run=server", "-f", "-", stdin=yaml.safe_dump(bad))
    assert proc.returncode != 0 and "70000" in proc.stderr
