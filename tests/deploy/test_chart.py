"""The Helm chart (charts/gpushare) lints, renders every mode the kustomize tree has, object for object the same,
refuses wrong values with a message that names them, and carries what only a chart can: generated credentials,
the migration as an upgrade hook, `helm test` pods.

One source of truth: k8s/ stays for kustomize users and this module renders both for each mode and compares
them (tests/deploy/chart.py says what is normalised). A change to one that the other lacks fails here with the
object and field that differ.
"""

from __future__ import annotations

import base64
import hashlib
import http.server
import json
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.deploy.chart import (
    CHART,
    DRA_POLICY,
    MODES,
    RELEASE,
    WITH_SERVICE_MONITOR,
    differences,
    helm_binary,
    helm_errors,
    render_mode,
    run_helm,
    template,
    values_file,
)
from tests.deploy.test_ha_overlay import undocumented
from tests.deploy.test_manifests import secret_readable
from tests.deploy.tools import NAMESPACE, assert_serving_certificate, find, key, load_all, pod_spec, runs_on


@pytest.fixture(scope="module")
def helm() -> str:
    return helm_binary()


@pytest.mark.parametrize("mode", sorted(MODES))
def test_helm_lint_passes_in_every_mode(helm: str, mode: str, tmp_path: Path) -> None:
    values, _ = MODES[mode]
    proc = run_helm(helm, "lint", "--strict", str(CHART), "-f", str(values_file(values, tmp_path)), check=False)
    assert proc.returncode == 0, f"helm lint ({mode}):\n{proc.stdout}\n{helm_errors(proc.stderr)}"
    assert "0 chart(s) failed" in proc.stdout


@pytest.mark.parametrize("mode", sorted(MODES))
def test_the_chart_renders_what_the_kustomize_tree_renders(
    helm: str, rendered: dict[str, list[dict[str, Any]]], mode: str, tmp_path: Path
) -> None:
    found = differences(render_mode(helm, mode, tmp_path), rendered[mode])
    assert not found, f"charts/gpushare and k8s/{mode} differ ({len(found)}):\n" + "\n".join(found)


def test_a_difference_is_reported_by_object_and_field(
    helm: str, rendered: dict[str, list[dict[str, Any]]], tmp_path: Path
) -> None:
    chart = template(helm, {"extender": {"replicas": 3}, "mps": {"enabled": True}}, WITH_SERVICE_MONITOR, tmp_path)
    found = differences(chart, rendered["base"])
    assert "Deployment/gpushare-system/gpushare-extender: spec.replicas: chart = 3, kustomize = 2" in found
    assert "DaemonSet/gpushare-system/gpushare-mps-control: rendered by the chart only" in found
    assert any(line.startswith("DaemonSet/gpushare-system/gpushare-node-agent: spec.template") for line in found)


WRONG_VALUES = [
    ({"scheduler": {"mode": "extender"}}, ["/scheduler/mode", "default", "second-scheduler"]),
    ({"extender": {"replica": 3}}, ["/extender", "replica"]),
    ({"extender": {"replicas": 0}}, ["/extender/replicas", "minimum"]),
    ({"postgresql": {"enabled": False}}, ["/database", "server"]),
    ({"extender": {"gpushareCompat": {"enabled": True}}}, ["/extender/gpushareCompat", "controlPlaneCIDR"]),
    ({"extender": {"gpushareCompat": {"enabled": True, "controlPlaneCIDR": "control-plane"}}}, ["controlPlaneCIDR"]),
    ({"config": {"memoryUnit": "GB"}}, ["/config/memoryUnit", "GiB", "MiB"]),
    ({"config": {"samplesMaxAge": "one day"}}, ["/config/samplesMaxAge"]),
    ({"secrets": {"adminToken": "change-me-admin-token"}}, ["/secrets/adminToken"]),
    ({"image": {"digest": "latest"}}, ["/image/digest"]),
    ({"nodeAgent": {"tolerations": {"key": "gpu"}}}, ["/nodeAgent/tolerations", "array"]),
    ({"nodeAgent": {"nodeSelector": {"gpushare": True}}}, ["/nodeAgent/nodeSelector/gpushare", "string"]),
    ({"monitoring": {"serviceMonitor": {"enabled": "yes"}}}, ["/monitoring/serviceMonitor/enabled"]),
    ({"database": {"server": "postgresql://user:pw@db:5432/gpushare"}}, ["/database/server"]),
    ({"postgresql": {"mode": "patroni"}}, ["/postgresql/mode", "statefulset", "cloudnativepg"]),
    (
        {"postgresql": {"cloudnativepg": {"synchronous": {"method": "any", "number": 1, "dataDurability": "strict"}}}},
        ["/postgresql/cloudnativepg/synchronous/dataDurability", "required", "preferred"],
    ),
    ({"postgresql": {"cloudnativepg": {"instances": 1}}}, ["/postgresql/cloudnativepg/instances", "minimum"]),
    ({"dra": {"enabled": "yes"}}, ["/dra/enabled", "boolean"]),
    ({"dra": {"admission": {"tls": {"certificate": "not a PEM"}}}}, ["/dra/admission/tls/certificate"]),
    (
        {
            "dra": {
                "admission": {"tls": {"certificate": "-----BEGIN CERTIFICATE-----\nMII=\n-----END CERTIFICATE-----"}}
            }
        },
        ["/dra/admission/tls", "key", "caBundle"],
    ),
]


@pytest.mark.parametrize(("values", "said"), WRONG_VALUES, ids=[str(v) for v, _ in WRONG_VALUES])
def test_the_schema_refuses_a_wrong_value_and_names_it(
    helm: str, values: dict[str, Any], said: list[str], tmp_path: Path
) -> None:
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file(values, tmp_path))]
    proc = run_helm(helm, *args, check=False)
    message = helm_errors(proc.stderr)
    assert proc.returncode != 0, f"accepted {values}"
    assert "values don't meet the specifications of the schema" in message, message
    for part in said:
        assert part in message, f"{part!r} not in helm's message:\n{message}"


def test_node_agent_placement_resources_and_image_are_values(helm: str, tmp_path: Path) -> None:
    values = {
        "image": {"repository": "registry.example.org/gpu/gpushare", "tag": "0.2.0-rc1", "pullPolicy": "Always"},
        "imagePullSecrets": [{"name": "pull"}],
        "nodeAgent": {
            "nodeSelector": {"gpushare": None, "nvidia.com/gpu.present": "true"},  # null drops a default key
            "tolerations": [{"key": "dedicated", "operator": "Equal", "value": "gpu", "effect": "NoExecute"}],
            "runtimeClassName": "nvidia",
            "resources": {"requests": {"cpu": "100m", "memory": "64Mi"}, "limits": {"memory": "256Mi"}},
        },
        "postgresql": {"storageClassName": "fast", "storage": "50Gi"},
    }
    objects = template(helm, values, (), tmp_path)
    agent = pod_spec(find(objects, "DaemonSet", "gpushare-node-agent"))
    assert agent is not None
    assert agent["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert agent["tolerations"] == values["nodeAgent"]["tolerations"]
    assert agent["runtimeClassName"] == "nvidia"
    assert agent["imagePullSecrets"] == [{"name": "pull"}]
    container = agent["containers"][0]
    assert container["resources"] == values["nodeAgent"]["resources"]
    assert container["image"] == "registry.example.org/gpu/gpushare:0.2.0-rc1"
    assert container["imagePullPolicy"] == "Always"
    claim = find(objects, "StatefulSet", "postgres")["spec"]["volumeClaimTemplates"][0]["spec"]
    assert claim["storageClassName"] == "fast" and claim["resources"]["requests"]["storage"] == "50Gi"
    digest = "sha256:" + "ab" * 32
    pinned = template(helm, {"image": {"digest": digest}}, (), tmp_path)
    images = {
        c["image"] for o in pinned if (spec := pod_spec(o)) for c in spec["containers"] if "gpushare" in c["image"]
    }
    assert images == {f"ghcr.io/gpushare/gpushare:0.2.0@{digest}"}


def _credentials(objects: list[dict[str, Any]]) -> dict[tuple[str, str], str]:
    return {
        (o["metadata"]["name"], k): base64.b64decode(v).decode()
        for o in objects
        if o["kind"] == "Secret"
        for k, v in o["data"].items()
    }


def test_credentials_are_generated_random_and_distinct_or_taken_from_values(helm: str, tmp_path: Path) -> None:
    first = _credentials(template(helm, {}, (), tmp_path))
    second = _credentials(template(helm, {}, (), tmp_path))
    assert len(first) == 11
    assert all(len(v) == 32 and v.isalnum() for v in first.values())
    assert len(set(first.values())) == len(first), "two credentials alike"
    assert not set(first.values()) & set(second.values()), "`helm template` cannot look up: each render is new"
    given = _credentials(template(helm, {"secrets": {"adminToken": "mine-0123456789"}}, (), tmp_path))
    assert given[("gpushare-admin", "token")] == "mine-0123456789"
    secrets = [o for o in template(helm, {}, (), tmp_path) if o["kind"] == "Secret"]
    assert {o["metadata"]["annotations"]["helm.sh/resource-policy"] for o in secrets} == {"keep"}


def test_the_migration_is_a_job_at_install_and_a_pre_upgrade_hook_at_upgrade(helm: str, tmp_path: Path) -> None:
    installed = [o for o in template(helm, {}, (), tmp_path) if o["kind"] == "Job"]
    upgraded = [o for o in template(helm, {}, ("--is-upgrade",), tmp_path) if o["kind"] == "Job"]
    assert [key(j) for j in installed] == [key(j) for j in upgraded] == [("Job", "gpushare-migrate-0-2-0")]
    assert "annotations" not in installed[0]["metadata"]
    assert upgraded[0]["metadata"]["annotations"] == {
        "helm.sh/hook": "pre-upgrade",
        "helm.sh/hook-delete-policy": "before-hook-creation",
    }
    assert upgraded[0]["spec"]["template"]["spec"]["containers"][0]["args"] == ["migrate"]


def test_optional_apis_follow_the_cluster(helm: str, tmp_path: Path) -> None:
    """auto: the ServiceMonitor when monitoring.coreos.com/v1 is served, the admission policy from 1.30, and
    PodDisruptionBudgets as policy/v1beta1 where only that is served."""
    bare = {key(o) for o in template(helm, {}, ("--kube-version", "v1.29.0"), tmp_path)}
    assert ("ServiceMonitor", "gpushare") not in bare
    assert ("ValidatingAdmissionPolicy", "gpushare-device-env") not in bare
    full = {key(o) for o in template(helm, {}, ("--kube-version", "v1.30.0", *WITH_SERVICE_MONITOR), tmp_path)}
    assert {("ServiceMonitor", "gpushare"), ("ValidatingAdmissionPolicy", "gpushare-device-env")} <= full
    forced = {key(o) for o in template(helm, {"admissionPolicy": {"enabled": False}}, (), tmp_path)}
    assert ("ValidatingAdmissionPolicy", "gpushare-device-env") not in forced


def test_notes_say_how_to_wire_the_scheduler_and_run_the_tests(helm: str, tmp_path: Path) -> None:
    default = run_helm(helm, "install", RELEASE, str(CHART), "-n", NAMESPACE, "--dry-run=client").stdout
    assert "kube-scheduler-config.v1.yaml" in default and "helm test gpushare -n gpushare-system" in default
    assert "logs job/gpushare-migrate-0-2-0" in default
    second = run_helm(
        helm,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--dry-run=client",
        "--set",
        "scheduler.mode=second-scheduler",
    ).stdout
    assert "spec.schedulerName: gpushare-scheduler" in second
    modes = run_helm(
        helm,
        "install",
        RELEASE,
        str(CHART),
        "-n",
        NAMESPACE,
        "--dry-run=client",
        "--set",
        "dra.enabled=true",
        "--set",
        "dra.admission.networkPolicy.apiServerCIDRs={198.51.100.0/24}",
        "--set",
        "postgresql.mode=cloudnativepg",
    ).stdout
    assert "kubectl label node <gpu-node> gpushare.io/allocator=dra" in modes
    assert "kubectl label namespace <namespace> gpushare.io/allocator=dra" in modes
    assert "cluster/gpushare-db" in modes


# -- helm test: the script of the services-answer pod, run here against HTTP servers that answer as told


class _Answer(http.server.BaseHTTPRequestHandler):
    status = 200

    def do_GET(self) -> None:
        self.send_response(self.server.status)  # type: ignore[attr-defined]
        self.end_headers()
        self.wfile.write(b'{"status": "not ready", "reason": "schema 0006 is older than this build needs"}')

    def log_message(self, *args: object) -> None:
        pass


@pytest.fixture
def answering() -> Iterator[dict[int, http.server.HTTPServer]]:
    servers = {}
    for status in (200, 503):
        server = http.server.HTTPServer(("127.0.0.1", 0), _Answer)
        server.status = status  # type: ignore[attr-defined]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        servers[status] = server
    yield servers
    for server in servers.values():
        server.shutdown()
        server.server_close()


def test_the_helm_test_pod_passes_when_every_service_answers_and_names_the_one_that_does_not(
    helm: str, answering: dict[int, http.server.HTTPServer], tmp_path: Path
) -> None:
    pods = template(helm, {}, ("--show-only", "templates/tests/services-answer.yaml"), tmp_path)
    pod = next(p for p in pods if p["metadata"]["name"] == "gpushare-test-services")
    assert pod["metadata"]["annotations"]["helm.sh/hook"] == "test"
    python, flag, script, checks = pod["spec"]["containers"][0]["command"]
    assert (python, flag) == ("python", "-c")
    assert "http://gpushare-extender:12345/readyz" in checks and "http://gpushare-accounting:8080/readyz" in checks
    ok, bad = (f"http://127.0.0.1:{answering[s].server_port}/readyz" for s in (200, 503))
    passing = subprocess.run(
        [sys.executable, "-c", script, f'[["extender", "{ok}"], ["binder", "{ok}"]]'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert passing.returncode == 0, passing.stdout + passing.stderr
    assert passing.stdout.count("ok      ") == 2
    failing = subprocess.run(
        [sys.executable, "-c", script, f'[["extender", "{ok}"], ["binder", "{bad}"], ["nats", "http://127.0.0.1:1/"]]'],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert failing.returncode == 1
    assert "FAILED  binder" in failing.stdout and "answered 503" in failing.stdout and "older than" in failing.stdout
    assert "FAILED  nats" in failing.stdout
    assert "not answering: binder, nats" in failing.stderr
    mtls = template(
        helm,
        {"extender": {"tls": {"enabled": True}}},
        ("--show-only", "templates/tests/services-answer.yaml"),
        tmp_path,
    )
    assert "http://gpushare-extender:12346/readyz" in mtls[0]["spec"]["containers"][0]["command"][3]


def test_helm_is_the_v4_release_built_from_its_module(helm: str) -> None:
    from devstack.cluster.helm import HELM_VERSION, helm_version

    assert helm_version(Path(helm)) == HELM_VERSION == "v4.3.2"


# -- modes beyond the kustomize tree's defaults: replicas, namespaces, DRA admission's certificate, CloudNativePG


def test_a_single_replica_gets_no_disruption_budget_that_would_block_every_drain(helm: str, tmp_path: Path) -> None:
    one = {name: {"replicas": 1} for name in ("extender", "binder", "accounting")}
    budgets = {key(o) for o in template(helm, one, (), tmp_path) if o["kind"] == "PodDisruptionBudget"}
    assert budgets == {("PodDisruptionBudget", "nats")}
    default = {key(o)[1] for o in template(helm, {}, (), tmp_path) if o["kind"] == "PodDisruptionBudget"}
    assert default == {"nats", "gpushare-extender", "gpushare-binder", "gpushare-accounting"}


def test_another_namespace_reaches_every_namespaced_name_in_the_shared_files(helm: str, tmp_path: Path) -> None:
    """The rules read from k8s/ (RBAC, the admission policies, the webhook) name gpushare-system; installed elsewhere,
    the chart names the release's namespace in each: bindings' subjects, the writers the annotation policy exempts,
    the webhook's Service, the webhook certificate's name."""
    values = {"dra": {"enabled": True, **DRA_POLICY}}
    args = ["template", RELEASE, str(CHART), "-n", "gpu-ops", "-f", str(values_file(values, tmp_path))]
    objects = load_all(run_helm(helm, *args).stdout)
    text = yaml.safe_dump_all(objects)
    assert "gpushare-system" not in text
    subjects = [s for o in objects if o["kind"].endswith("Binding") for s in o.get("subjects", [])]
    assert subjects and {s["namespace"] for s in subjects if s["kind"] == "ServiceAccount"} == {"gpu-ops"}
    assert {o["metadata"]["namespace"] for o in objects if o["kind"] in ("ServiceAccount", "Role", "RoleBinding")} == {
        "gpu-ops"
    }
    policy = find(objects, "ValidatingAdmissionPolicy", "gpushare-annotations")
    assert "system:serviceaccount:gpu-ops:gpushare-binder" in json.dumps(policy["spec"]["matchConditions"])
    (hook,) = find(objects, "MutatingWebhookConfiguration", "gpushare-dra-admission")["webhooks"]
    assert hook["clientConfig"]["service"]["namespace"] == "gpu-ops"
    cert = base64.b64decode(find(objects, "Secret", "gpushare-admission-tls")["data"]["tls.crt"])
    assert "DNS:gpushare-extender.gpu-ops.svc" in _openssl(tmp_path, cert, "x509", "-noout", "-ext", "subjectAltName")


def _openssl(tmp_path: Path, pem: bytes, *args: str) -> str:
    path = tmp_path / f"pem-{len(list(tmp_path.glob('pem-*')))}"
    path.write_bytes(pem)
    proc = subprocess.run(["openssl", *args, "-in", str(path)], capture_output=True, text=True, check=False)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout


def _admission(objects: list[dict[str, Any]]) -> tuple[dict[str, bytes], str, str]:
    """The webhook Secret's files, the webhook's caBundle (decoded) and the extender's restart checksum."""
    data = {k: base64.b64decode(v) for k, v in find(objects, "Secret", "gpushare-admission-tls")["data"].items()}
    (hook,) = find(objects, "MutatingWebhookConfiguration", "gpushare-dra-admission")["webhooks"]
    extender = find(objects, "Deployment", "gpushare-extender")["spec"]["template"]["metadata"]
    return (
        data,
        base64.b64decode(hook["clientConfig"]["caBundle"]).decode(),
        extender["annotations"]["checksum/admission-tls"],
    )


def test_dra_generates_a_webhook_certificate_the_api_server_can_verify_and_wires_its_ca(
    helm: str, tmp_path: Path
) -> None:
    objects = template(helm, {"dra": {"enabled": True, **DRA_POLICY}}, (), tmp_path)
    data, ca_bundle, checksum = _admission(objects)
    assert ca_bundle == data["caBundle"].decode(), "the webhook trusts the CA of the Secret the extender serves"
    (tmp_path / "ca.crt").write_bytes(data["caBundle"])
    (tmp_path / "tls.crt").write_bytes(data["tls.crt"])
    assert_serving_certificate(tmp_path / "ca.crt", tmp_path / "tls.crt")
    sans = _openssl(tmp_path, data["tls.crt"], "x509", "-noout", "-ext", "subjectAltName")
    assert "DNS:gpushare-extender.gpushare-system.svc" in sans  # the Service kube-apiserver calls
    key_modulus = _openssl(tmp_path, data["tls.key"], "rsa", "-noout", "-modulus")
    assert key_modulus == _openssl(tmp_path, data["tls.crt"], "x509", "-noout", "-modulus"), "the key is the cert's"
    assert checksum == hashlib.sha256(base64.b64encode(data["tls.crt"])).hexdigest()
    # the extender serves it: the webhook port, the Secret mounted where its flags say, readable by its group
    spec = find(objects, "Deployment", "gpushare-extender")["spec"]["template"]["spec"]
    (volume,) = [v for v in spec["volumes"] if v.get("secret", {}).get("secretName") == "gpushare-admission-tls"]
    assert secret_readable(spec, spec["containers"][0], volume)
    # helm template cannot look the installed one up: a new one each time (an install keeps it: test_chart_install.py)
    assert (
        _admission(template(helm, {"dra": {"enabled": True, **DRA_POLICY}}, (), tmp_path))[0]["tls.crt"]
        != data["tls.crt"]
    )


def test_dra_takes_a_webhook_certificate_of_your_own(helm: str, tmp_path: Path) -> None:
    subprocess.run(
        ["sh", "-c", "openssl req -x509 -newkey rsa:2048 -nodes -days 2 -subj /CN=mine -keyout key.pem -out crt.pem"],
        cwd=tmp_path,
        capture_output=True,
        check=True,
    )
    crt, key_pem = (tmp_path / "crt.pem").read_text(), (tmp_path / "key.pem").read_text()
    tls = {"certificate": crt, "key": key_pem, "caBundle": crt}
    given = {"dra": {"enabled": True, "admission": {"tls": tls, **DRA_POLICY["admission"]}}}
    data, ca_bundle, checksum = _admission(template(helm, given, (), tmp_path))
    assert (data["tls.crt"].decode(), data["tls.key"].decode(), ca_bundle) == (crt, key_pem, crt)
    again = _admission(template(helm, given, (), tmp_path))
    assert again[2] == checksum, "the same certificate: no restart"


def test_the_webhook_port_admits_only_kube_apiserver_and_needs_its_addresses(helm: str, tmp_path: Path) -> None:
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "dra.enabled=true"]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0 and "dra.admission.networkPolicy.apiServerCIDRs" in proc.stderr
    values = {
        "dra": {"enabled": True, "admission": {"networkPolicy": {"apiServerCIDRs": ["10.0.0.10/32", "10.0.0.11/32"]}}}
    }
    policy = find(template(helm, values, (), tmp_path), "NetworkPolicy", "gpushare-extender")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "gpushare-extender"
    verbs, webhook = policy["spec"]["ingress"]
    assert verbs == {"ports": [{"port": 12345}]}  # kube-scheduler's verbs, probes, metrics: from anywhere, as before
    assert webhook["ports"] == [{"port": 8443}]
    assert webhook["from"] == [{"ipBlock": {"cidr": "10.0.0.10/32"}}, {"ipBlock": {"cidr": "10.0.0.11/32"}}]
    off = {"dra": {"enabled": True, "admission": {"networkPolicy": {"enabled": False}}}}
    assert not [
        o
        for o in template(helm, off, (), tmp_path)
        if o["kind"] == "NetworkPolicy" and "extender" in o["metadata"]["name"]
    ]


def test_dra_is_refused_before_kubernetes_1_34_with_what_to_do(helm: str, tmp_path: Path) -> None:
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "--set", "dra.enabled=true", "--kube-version", "v1.33.4"]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0
    assert "dra.enabled needs Kubernetes 1.34 or later" in proc.stderr and "v1.33.4" in proc.stderr


def test_dra_runs_the_dra_agent_on_its_nodes_and_the_device_plugin_agent_elsewhere(helm: str, tmp_path: Path) -> None:
    """dra.nodeSelector of two labels: a node with both is a DRA node, a node lacking either runs the device plugin."""
    selector = {"gpushare.io/allocator": "dra", "pool": "gpu-b"}
    objects = template(helm, {"dra": {"enabled": True, "nodeSelector": selector, **DRA_POLICY}}, (), tmp_path)
    dra, device_plugin = (
        pod_spec(find(objects, "DaemonSet", n)) for n in ("gpushare-node-agent-dra", "gpushare-node-agent")
    )
    for labels in ({"gpushare": "true", **selector}, selector):
        assert runs_on(dra, labels) and not runs_on(device_plugin, labels), labels
    for labels in (
        {"gpushare": "true"},
        {"gpushare": "true", "pool": "gpu-b"},
        {"gpushare": "true", "gpushare.io/allocator": "dra"},
    ):
        assert runs_on(device_plugin, labels) and not runs_on(dra, labels), labels
    plain = pod_spec(find(template(helm, {}, (), tmp_path), "DaemonSet", "gpushare-node-agent"))
    assert "affinity" not in plain


def test_cloudnativepg_values_stay_within_the_operators_documented_fields(helm: str, tmp_path: Path) -> None:
    values = {
        "postgresql": {
            "mode": "cloudnativepg",
            "storage": "50Gi",
            "storageClassName": "fast",
            "cloudnativepg": {
                "instances": 5,
                "synchronous": {"method": "first", "number": 2, "dataDurability": "preferred"},
                "parameters": {"max_connections": "400", "shared_buffers": "1GB"},
                "operatorNamespace": "postgres-operator",
            },
        }
    }
    objects = template(helm, values, (), tmp_path)
    cluster = find(objects, "Cluster", "gpushare-db")
    assert undocumented(cluster["spec"]) == []
    assert (cluster["spec"]["instances"], cluster["spec"]["storage"]) == (5, {"size": "50Gi", "storageClass": "fast"})
    assert cluster["spec"]["postgresql"]["synchronous"] == values["postgresql"]["cloudnativepg"]["synchronous"]
    assert not {("StatefulSet", "postgres"), ("Service", "postgres")} & {key(o) for o in objects}
    operator = find(objects, "NetworkPolicy", "gpushare-db")["spec"]["ingress"][1]["from"][1]
    assert operator == {"namespaceSelector": {"matchLabels": {"kubernetes.io/metadata.name": "postgres-operator"}}}
    too_many = {
        "postgresql": {
            "mode": "cloudnativepg",
            "cloudnativepg": {"instances": 2, "synchronous": {"method": "any", "number": 2}},
        }
    }
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file(too_many, tmp_path))]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0 and "synchronous.number (2) must be below instances (2)" in proc.stderr


def test_a_required_standby_must_survive_the_loss_of_one_instance(helm: str, tmp_path: Path) -> None:
    """Two instances with a required synchronous standby hold every ledger write (all GPU scheduling) while either
    is lost: the chart refuses that and says what keeps scheduling; preferred durability, or a third instance,
    renders."""

    def values(instances: int, number: int, durability: str) -> dict[str, Any]:
        sync = {"method": "any", "number": number, "dataDurability": durability}
        return {"postgresql": {"mode": "cloudnativepg", "cloudnativepg": {"instances": instances, "synchronous": sync}}}

    strict = values(2, 1, "required")
    args = ["template", RELEASE, str(CHART), "-n", NAMESPACE, "-f", str(values_file(strict, tmp_path))]
    proc = run_helm(helm, *args, check=False)
    assert proc.returncode != 0
    assert "losing one instance leaves fewer standbys than a commit waits for" in proc.stderr, proc.stderr
    assert "Use instances >= 3 (synchronous.number + 2), or dataDurability preferred" in proc.stderr
    for instances, number, durability in ((2, 1, "preferred"), (3, 1, "required"), (4, 2, "required")):
        cluster = find(template(helm, values(instances, number, durability), (), tmp_path), "Cluster", "gpushare-db")
        assert cluster["spec"]["postgresql"]["synchronous"]["number"] == number
