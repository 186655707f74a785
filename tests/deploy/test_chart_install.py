"""`helm install` against real kube-apiservers: the current release (v1.37.2) and 1.20.

Every mode is installed with `--dry-run=server` (Helm looks the credentials up, reads the served APIs, checks
for objects it would clash with), and what Helm would create, hooks and `helm test` pods included, is then
dry-run by the server itself (`kubectl apply --dry-run=server`: Helm's own dry run sends no object to the
server). The HA mode's CloudNativePG Cluster is a kind no test server serves (the operator's CRDs cannot be had
here): Helm refuses to build it, as on a cluster without the operator, so that mode's other objects are rendered
for the server and dry-run without it, with a warning naming what was not. The DRA mode (Kubernetes 1.34+) is
refused on 1.20 with what to do. One real install shows what `lookup` is for: an upgrade keeps the generated
credentials, an uninstall keeps the Secrets, and a reinstall finds them; another, in the DRA mode, that the webhook's
generated certificate and its CA in the caBundle are kept by an upgrade.

On 1.20 the chart leaves out by itself what the server does not serve (the admission policy, the ServiceMonitor)
and writes PodDisruptionBudgets as policy/v1beta1. Helm v4 applies server-side by default; 1.20's
kube-controller-manager claims a StatefulSet's volumeClaimTemplates as its own, so a server-side upgrade there
conflicts: on 1.20 the chart is installed with `--server-side=false` (docs/install.md), and upgrades follow.
The pre-upgrade migration hook is rendered and dry-run here; it runs (and the upgrade waits for it) where pods
run, which this control plane without kubelets cannot show: tests/reliability/test_upgrade.py runs the
migration and both releases' services for real.
"""

from __future__ import annotations

import json
import subprocess
import warnings
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.cluster import ControlPlane
from tests.deploy.chart import CHART, MODES, RELEASE, helm_binary, helm_errors, run_helm, values_file
from tests.deploy.tools import NAMESPACE, key, load_all

SERVERS = ("current", "1.20")
# Modes with an object of a kind that no test server serves: the API version Helm cannot build (the CRD missing).
UNBUILDABLE = {"overlays/ha": "postgresql.cnpg.io/v1"}  # CloudNativePG's Cluster
# Not the kustomize tests' gpushare-system: they create that namespace without Helm's ownership on the same server.
CHART_NAMESPACE = "gpushare-chart"


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


@pytest.fixture(scope="module", params=SERVERS)
def server(request: pytest.FixtureRequest) -> ControlPlane:
    """A real kube-apiserver of each release the chart installs on."""
    return request.getfixturevalue("apiserver" if request.param == "current" else "apiserver_1_20")


def _on(cp: ControlPlane, helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return run_helm(helm, *args, "--kubeconfig", str(cp.kubeconfig_path), check=check)


def _install(cp: ControlPlane, helm: str, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
    return _on(cp, helm, "install", RELEASE, str(CHART), "-n", CHART_NAMESPACE, *args, check=check)


def _kubectl(kubectl: str, cp: ControlPlane, *args: str, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    cmd = [kubectl, f"--kubeconfig={cp.kubeconfig_path}", *args]
    return subprocess.run(cmd, input=stdin, capture_output=True, text=True, timeout=120, check=False)


def _apply_method(cp: ControlPlane) -> tuple[str, ...]:
    return ("--server-side=false",) if cp.release.minor < 22 else ()


def _release_objects(release: dict[str, Any]) -> list[dict[str, Any]]:
    """Everything a release would create: its manifest, its hooks and its test pods."""
    return load_all(release["manifest"]) + [doc for hook in release["hooks"] for doc in load_all(hook["manifest"])]


@pytest.fixture(scope="module")
def namespace(kubectl: str, server: ControlPlane) -> str:
    """The chart's namespace, as `helm install --create-namespace` leaves it and owned by the release (the chart
    labels it), so that namespaced objects can be dry-run into it."""
    if _kubectl(kubectl, server, "get", "namespace", CHART_NAMESPACE).returncode != 0:
        created = _kubectl(kubectl, server, "create", "namespace", CHART_NAMESPACE)
        assert created.returncode == 0, created.stderr
    for what, pairs in (
        ("label", ("app.kubernetes.io/managed-by=Helm",)),
        ("annotate", (f"meta.helm.sh/release-name={RELEASE}", f"meta.helm.sh/release-namespace={CHART_NAMESPACE}")),
    ):
        done = _kubectl(kubectl, server, what, "--overwrite", "namespace", CHART_NAMESPACE, *pairs)
        assert done.returncode == 0, done.stderr
    return CHART_NAMESPACE


def _served(kubectl: str, cp: ControlPlane) -> set[str]:
    proc = _kubectl(kubectl, cp, "api-versions")
    assert proc.returncode == 0, proc.stderr
    return set(proc.stdout.split())


def _rendered_for(helm: str, cp: ControlPlane, served: set[str], values_path: Path) -> list[dict[str, Any]]:
    """The release's objects, hooks and test pods, as `helm template` renders them for this server (its version
    and the API versions it serves): what `helm install --dry-run=server` shows, for a mode it cannot build."""
    args = ["template", RELEASE, str(CHART), "-n", CHART_NAMESPACE, "-f", str(values_path)]
    args += ["--kube-version", cp.release.version, *(f"--api-versions={v}" for v in sorted(served))]
    return load_all(run_helm(helm, *args).stdout)


@pytest.mark.parametrize("mode", sorted(MODES))
def test_helm_install_dry_run_server_in_every_mode(
    helm: str, kubectl: str, server: ControlPlane, namespace: str, mode: str, tmp_path: Path
) -> None:
    values, _ = MODES[mode]
    values_path = values_file(values, tmp_path)
    release = server.release.version
    if mode == "overlays/dra" and server.release.minor < 34:  # resource.k8s.io/v1: DeviceClass, ResourceSlice
        refused = _install(server, helm, "--dry-run=server", "-f", str(values_path), check=False)
        assert refused.returncode != 0
        assert "dra.enabled needs Kubernetes 1.34 or later" in refused.stderr and release in refused.stderr
        return
    if mode == "overlays/ha" and server.release.minor < 30:
        pytest.skip(f"CloudNativePG 1.28 (overlays/ha) does not run on Kubernetes {release}")
    if mode in UNBUILDABLE:
        # Helm cannot build an object of a kind the server does not serve, and CloudNativePG's CRDs cannot be had
        # here: the install is refused, naming it, as on a cluster without the operator ...
        refused = _install(server, helm, "--dry-run=server", "-f", str(values_path), check=False)
        assert refused.returncode != 0, f"{mode}: installed without {UNBUILDABLE[mode]}"
        assert f'no matches for kind "Cluster" in version "{UNBUILDABLE[mode]}"' in refused.stderr, refused.stderr
        assert "ensure CRDs are installed first" in refused.stderr
        # ... and everything else the release holds is dry-run by the server (test_ha_overlay.py and
        # test_chart.py check the Cluster's fields against the operator's documented ones)
        served = _served(kubectl, server)
        every = _rendered_for(helm, server, served, values_path)
        objects = [o for o in every if o["apiVersion"] in served]
        skipped = {o["apiVersion"] for o in every} - served
        assert skipped == {UNBUILDABLE[mode]}, skipped
        kinds_skipped = sorted(key(o) for o in every if o["apiVersion"] in skipped)
        warnings.warn(f"{mode}: not dry-run, not served by Kubernetes {release}: {kinds_skipped}", stacklevel=1)
    else:
        proc = _install(server, helm, "--create-namespace", "--dry-run=server", "-o", "json", "-f", str(values_path))
        objects = _release_objects(json.loads(proc.stdout))
    kinds = {o["kind"] for o in objects}
    assert {"Deployment", "DaemonSet", "StatefulSet", "Job", "Secret", "Pod"} <= kinds
    assert "ServiceMonitor" not in kinds, "auto: no Prometheus Operator on this server"
    policy = "ValidatingAdmissionPolicy" in kinds
    assert policy == (server.release.minor >= 30)
    pdb = {o["apiVersion"] for o in objects if o["kind"] == "PodDisruptionBudget"}
    assert pdb == {"policy/v1" if server.release.minor >= 21 else "policy/v1beta1"}
    # Helm's dry run sends nothing: the server validates each object here (in the namespace as Helm makes it).
    applied = _kubectl(
        kubectl, server, "apply", "--dry-run=server", "-o", "name", "-f", "-", stdin=yaml.safe_dump_all(objects)
    )
    assert applied.returncode == 0, f"{mode} on Kubernetes {server.release}: refused:\n{applied.stderr}"
    assert len(applied.stdout.split()) == len(objects), applied.stdout


def test_a_wrong_value_is_refused_before_anything_reaches_the_server(helm: str, server: ControlPlane) -> None:
    proc = _install(server, helm, "--dry-run=server", "--set", "scheduler.mode=both", check=False)
    assert proc.returncode != 0 and "/scheduler/mode" in helm_errors(proc.stderr)


def _credentials(kubectl: str, cp: ControlPlane) -> dict[str, dict[str, str]]:
    out = {}
    for name in ("gpushare-database", "gpushare-nats", "gpushare-node-agent", "gpushare-admin"):
        proc = _kubectl(kubectl, cp, "-n", CHART_NAMESPACE, "get", "secret", name, "-o", "json")
        assert proc.returncode == 0, proc.stderr
        out[name] = json.loads(proc.stdout)["data"]
    return out


def test_install_upgrade_uninstall_reinstall_keep_the_generated_credentials(
    helm: str, kubectl: str, server: ControlPlane
) -> None:
    base = ("-n", CHART_NAMESPACE, *_apply_method(server))
    try:
        _install(server, helm, "--create-namespace", *_apply_method(server))
        generated = _credentials(kubectl, server)
        assert sum(len(v) for v in generated.values()) == 11
        # The upgrade's hook (the migration Job) is rendered and would run first ...
        planned = json.loads(
            _on(server, helm, "upgrade", RELEASE, str(CHART), *base, "--dry-run=server", "-o", "json").stdout
        )
        hooks = {h["name"]: h["events"] for h in planned["hooks"]}
        assert hooks["gpushare-migrate-0-2-0"] == ["pre-upgrade"]
        # ... but needs a kubelet to finish; the upgrade itself runs without it here.
        _on(server, helm, "upgrade", RELEASE, str(CHART), *base, "--no-hooks", "--set", "binder.replicas=3")
        assert _credentials(kubectl, server) == generated, "the upgrade changed a generated credential"
        binder = _kubectl(kubectl, server, "-n", CHART_NAMESPACE, "get", "deployment", "gpushare-binder", "-o", "json")
        assert json.loads(binder.stdout)["spec"]["replicas"] == 3
        removed = _on(server, helm, "uninstall", RELEASE, "-n", CHART_NAMESPACE)
        assert "kept due to the resource policy" in removed.stdout + removed.stderr
        assert _credentials(kubectl, server) == generated
        _install(server, helm, *_apply_method(server))
        assert _credentials(kubectl, server) == generated, "a reinstall must find the kept credentials"
    finally:
        _on(server, helm, "uninstall", RELEASE, "-n", CHART_NAMESPACE, "--ignore-not-found", check=False)
        _kubectl(kubectl, server, "delete", "namespace", CHART_NAMESPACE, "--wait=false")


def test_a_kustomize_install_moves_to_helm_keeping_every_object_and_credential(
    helm: str, kubectl: str, apiserver: ControlPlane, rendered: dict[str, list[dict[str, Any]]]
) -> None:
    """`helm install --take-ownership --server-side=false` over what `kubectl apply -k k8s/base` installed
    (CHANGELOG.md, "Upgrading from 0.1.0"): the same names, selectors and immutable fields, so nothing is refused
    or replaced, and the installed credentials are the ones the chart keeps. (Server-side, Helm's apply conflicts
    with kubectl's client-side field ownership on fields the apiserver defaulted, e.g. `fieldRef.apiVersion`.)"""
    objects = [o for o in rendered["base"] if o["kind"] != "ServiceMonitor"]  # no Prometheus Operator here
    applied = _kubectl(kubectl, apiserver, "apply", "-f", "-", stdin=yaml.safe_dump_all(objects))
    assert applied.returncode == 0, applied.stderr
    before = {
        name: json.loads(_kubectl(kubectl, apiserver, "-n", NAMESPACE, "get", "secret", name, "-o", "json").stdout)[
            "data"
        ]
        for name in ("gpushare-database", "gpushare-nats", "gpushare-node-agent", "gpushare-admin")
    }
    uids = _kubectl(kubectl, apiserver, "-n", NAMESPACE, "get", "deploy,sts,ds,job", "-o", "json")
    known = {i["metadata"]["name"]: i["metadata"]["uid"] for i in json.loads(uids.stdout)["items"]}
    try:
        _on(apiserver, helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--take-ownership", "--server-side=false")
        after = json.loads(
            _kubectl(kubectl, apiserver, "-n", NAMESPACE, "get", "deploy,sts,ds,job", "-o", "json").stdout
        )
        assert {i["metadata"]["name"]: i["metadata"]["uid"] for i in after["items"]} == known, "an object was replaced"
        for name, data in before.items():
            kept = _kubectl(kubectl, apiserver, "-n", NAMESPACE, "get", "secret", name, "-o", "json")
            assert json.loads(kept.stdout)["data"] == data, f"{name}: the chart changed an installed credential"
        owned = _kubectl(kubectl, apiserver, "get", "clusterrole", "gpushare-binder", "-o", "json")
        assert json.loads(owned.stdout)["metadata"]["annotations"]["meta.helm.sh/release-name"] == RELEASE
    finally:
        _on(apiserver, helm, "uninstall", RELEASE, "-n", NAMESPACE, "--ignore-not-found", check=False)
        _kubectl(kubectl, apiserver, "-n", NAMESPACE, "delete", "secret", "-l", "app.kubernetes.io/part-of=gpushare")


def test_the_generated_webhook_certificate_is_kept_by_upgrades(
    helm: str, kubectl: str, apiserver: ControlPlane
) -> None:
    """dra.enabled on the real v1.37.2 apiserver: the install generates the webhook's CA and certificate, an upgrade
    reads them back (`lookup`) and writes the same Secret and caBundle, so the extender keeps serving what
    kube-apiserver trusts (and its restart checksum stays)."""
    namespace = "gpushare-chart-dra"
    base = (
        "-n",
        namespace,
        "--set",
        "dra.enabled=true",
        "--set",
        "dra.admission.networkPolicy.apiServerCIDRs={127.0.0.1/32}",
    )

    def installed() -> tuple[dict[str, str], str, str]:
        secret = _kubectl(kubectl, apiserver, "-n", namespace, "get", "secret", "gpushare-admission-tls", "-o", "json")
        hook = _kubectl(
            kubectl, apiserver, "get", "mutatingwebhookconfiguration", "gpushare-dra-admission", "-o", "json"
        )
        extender = _kubectl(kubectl, apiserver, "-n", namespace, "get", "deployment", "gpushare-extender", "-o", "json")
        for proc in (secret, hook, extender):
            assert proc.returncode == 0, proc.stderr
        pod = json.loads(extender.stdout)["spec"]["template"]["metadata"]
        return (
            json.loads(secret.stdout)["data"],
            json.loads(hook.stdout)["webhooks"][0]["clientConfig"]["caBundle"],
            pod["annotations"]["checksum/admission-tls"],
        )

    try:
        _on(apiserver, helm, "install", RELEASE, str(CHART), *base, "--create-namespace")
        data, ca_bundle, checksum = installed()
        assert set(data) == {"tls.crt", "tls.key", "caBundle"} and ca_bundle == data["caBundle"]
        _on(apiserver, helm, "upgrade", RELEASE, str(CHART), *base, "--no-hooks", "--set", "extender.replicas=3")
        assert installed() == (data, ca_bundle, checksum), "the upgrade changed the webhook's certificate"
        planned = json.loads(
            _on(apiserver, helm, "upgrade", RELEASE, str(CHART), *base, "--dry-run=server", "-o", "json").stdout
        )
        secret = next(o for o in load_all(planned["manifest"]) if key(o) == ("Secret", "gpushare-admission-tls"))
        assert secret["data"] == data, "--dry-run=server shows the installed certificate"
    finally:
        _on(apiserver, helm, "uninstall", RELEASE, "-n", namespace, "--ignore-not-found", check=False)
        _kubectl(kubectl, apiserver, "delete", "namespace", namespace, "--wait=false")
