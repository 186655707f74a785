"""The kustomizations render, validate against the Kubernetes schemas offline, and say what the docs promise."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
import yaml

from devstack.embedded import nats_server_binary
from services.cli import build_parser
from tests.deploy.tools import (
    K8S,
    KUSTOMIZATIONS,
    MIGRATE_JOB,
    NAMESPACE,
    ROOT,
    VERSION,
    find,
    key,
    pod_spec,
    unavailable,
)

# Kinds without a schema in kubernetes-validate (CRDs): checked by hand below.
CRD_KINDS = {"ServiceMonitor", "Cluster"}  # Cluster: CloudNativePG's (overlays/ha, test_ha_overlay.py)
# Kinds served only from a Kubernetes minor version on: older schema sets skip them (overlays/before-1.30
# leaves them out for such clusters).
NEWER_KINDS = {
    "ValidatingAdmissionPolicy": (1, 30),
    "ValidatingAdmissionPolicyBinding": (1, 30),
    "MutatingWebhookConfiguration": (1, 30),  # overlays/dra: matchConditions (GA in 1.30)
    "ValidatingWebhookConfiguration": (1, 30),
    "DeviceClass": (1, 34),  # overlays/dra: resource.k8s.io/v1
}
POLICY = "gpushare-device-env"
ANNOTATION_POLICY = "gpushare-annotations"
ADMISSION_KINDS = ("ValidatingAdmissionPolicy", "ValidatingAdmissionPolicyBinding")
EXEMPT = "gpushare.io/allow-device-env"
# Oldest and newest schema sets kubernetes-validate ships: the manifests must pass both.
SCHEMA_VERSIONS = ("1.25.0", "latest")
SECRETS = {"gpushare-database", "gpushare-nats", "gpushare-node-agent", "gpushare-admin"}
GPUSHARE_WORKLOADS = {
    ("Deployment", "gpushare-extender"),
    ("Deployment", "gpushare-binder"),
    ("Deployment", "gpushare-accounting"),
    ("DaemonSet", "gpushare-node-agent"),
    ("DaemonSet", "gpushare-node-agent-dra"),  # overlays/dra
    ("Job", MIGRATE_JOB),
}
NODE_AGENTS = (
    "gpushare-node-agent",
    "gpushare-node-agent-dra",
)  # the device-plugin agent; the DRA plugin (overlays/dra)


def _validator() -> Any:
    try:
        import kubernetes_validate
    except ImportError:
        unavailable("kubernetes-validate is not installed (pip install 'kubernetes-validate>=1.37')")
    return kubernetes_validate


def _subcommands() -> set[str]:
    parser = build_parser()
    action = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    return set(action.choices)


def parse_cli(args: list[str], where: str) -> None:
    """Fail unless `gpushare ARGS` parses with the CLI as it is now (subcommand and every flag)."""
    commands = _subcommands()
    assert args and args[0] in commands, (
        f"{where} runs `gpushare {args[0] if args else ''}`; CLI has {sorted(commands)}"
    )
    try:
        build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `gpushare {' '.join(args)}` does not parse (see the usage message above)")


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_renders_into_one_namespace(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    objects = rendered[name]
    assert len({(*key(o), o["metadata"].get("namespace", "")) for o in objects}) == len(objects), "duplicates"
    allowed = {NAMESPACE, "kube-system"} if name == "overlays/second-scheduler" else {NAMESPACE}
    cluster_scoped = {
        "Namespace",
        "ClusterRole",
        "ClusterRoleBinding",
        "ValidatingAdmissionPolicy",
        "ValidatingAdmissionPolicyBinding",
        "MutatingWebhookConfiguration",
        "ValidatingWebhookConfiguration",
        "DeviceClass",
    }
    for obj in objects:
        ns = obj["metadata"].get("namespace")
        if obj["kind"] in cluster_scoped:
            assert ns is None, key(obj)
        else:
            assert ns in allowed, f"{key(obj)} in namespace {ns!r}"
    for obj in objects:
        for container in (pod_spec(obj) or {}).get("containers", []):
            assert container["image"] != "gpushare", f"{key(obj)}: image not rewritten by `images:`"


@pytest.mark.parametrize("version", SCHEMA_VERSIONS)
@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_validates_against_kubernetes_schemas(
    rendered: dict[str, list[dict[str, Any]]], name: str, version: str
) -> None:
    kv = _validator()
    target = kv.latest_version() if version == "latest" else version
    minor = tuple(int(x) for x in target.split(".")[:2])
    checked = 0
    for obj in rendered[name]:
        if obj["kind"] in CRD_KINDS or minor < NEWER_KINDS.get(obj["kind"], (0, 0)):
            continue
        try:
            kv.validate(obj, target, strict=True)
        except kv.ValidationError as exc:
            pytest.fail(f"{name}: {key(obj)} invalid for Kubernetes {target}: {exc.message}")
        checked += 1
    assert checked >= 20


def test_a_broken_object_fails_validation() -> None:
    kv = _validator()
    bad = {"apiVersion": "apps/v1", "kind": "Deployment", "metadata": {"name": "x"}, "spec": {"replicass": 2}}
    with pytest.raises(kv.ValidationError):
        kv.validate(bad, "1.25.0", strict=True)


def test_service_monitor_scrapes_every_metrics_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    monitor = find(objects, "ServiceMonitor", "gpushare")
    assert monitor["apiVersion"] == "monitoring.coreos.com/v1"
    selector = monitor["spec"]["selector"]["matchLabels"]
    ports = {e["port"] for e in monitor["spec"]["endpoints"]}
    assert all(e["path"] == "/metrics" for e in monitor["spec"]["endpoints"])
    expected = {
        "gpushare-extender": 12345,
        "gpushare-binder": 8081,
        "gpushare-accounting": 8080,
        "gpushare-node-agent": 9119,
    }
    for name, number in expected.items():
        svc = find(objects, "Service", name)
        assert selector.items() <= svc["metadata"]["labels"].items(), name
        assert any(p["port"] == number and p["name"] in ports for p in svc["spec"]["ports"]), name


def test_dashboard_is_valid_grafana_json_over_gpushare_metrics(rendered: dict[str, list[dict[str, Any]]]) -> None:
    cm = find(rendered["base"], "ConfigMap", "gpushare-grafana-dashboard")
    assert cm["metadata"]["labels"]["grafana_dashboard"] == "1"
    dashboard = json.loads(cm["data"]["gpushare-dashboard.json"])
    assert dashboard["title"] and dashboard["panels"]
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    assert len(exprs) >= 8
    names = {m for e in exprs for m in re.findall(r"\bgpushare_[a-z0-9_]+", e)}
    assert names and all(re.search(r"\bgpushare_", e) for e in exprs)
    # Every metric the dashboard plots is one the services define.
    sources = "\n".join(p.read_text() for p in (K8S.parent / "services").rglob("*.py"))
    defined = set(re.findall(r"[\"'](gpushare_[a-z0-9_]+)[\"']", sources))
    stem = lambda n: re.sub(r"_(bucket|sum|count|total|created)$", "", n)  # noqa: E731
    defined_stems = {stem(n) for n in defined}
    missing = sorted(n for n in names if n not in defined and stem(n) not in defined_stems)
    assert not missing, f"dashboard plots metrics no service defines: {missing}"


def test_gpushare_containers_run_cli_subcommands_that_exist(rendered: dict[str, list[dict[str, Any]]]) -> None:
    seen = set()
    for name in KUSTOMIZATIONS:
        for obj in rendered[name]:
            if key(obj) not in GPUSHARE_WORKLOADS:
                continue
            for container in pod_spec(obj)["containers"]:
                parse_cli(container["args"], f"{name}: {key(obj)}")
                seen.add(container["args"][0])
    assert {"migrate"} <= seen


def test_hardened_pods(rendered: dict[str, list[dict[str, Any]]]) -> None:
    for obj in rendered["overlays/second-scheduler"]:
        spec = pod_spec(obj)
        if spec is None:
            continue
        for container in spec["containers"]:
            sc = container["securityContext"]
            assert sc["readOnlyRootFilesystem"] is True, key(obj)
            assert sc["allowPrivilegeEscalation"] is False, key(obj)
            assert sc["capabilities"]["drop"] == ["ALL"], key(obj)
            assert not sc.get("privileged"), key(obj)
            assert "memory" in container["resources"]["limits"], key(obj)
            if obj["kind"] != "Job":
                assert "readinessProbe" in container and "livenessProbe" in container, key(obj)
            if key(obj) in GPUSHARE_WORKLOADS:
                mounts = {m["mountPath"] for m in container["volumeMounts"]}
                assert "/tmp" in mounts, f"{key(obj)}: no writable /tmp"
        if key(obj) != ("DaemonSet", "gpushare-node-agent"):
            assert spec["securityContext"]["runAsNonRoot"] is True, key(obj)
            assert spec["securityContext"]["runAsUser"] != 0, key(obj)


def test_extender_is_highly_available(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    dep = find(objects, "Deployment", "gpushare-extender")
    assert dep["spec"]["replicas"] >= 2
    spec = dep["spec"]["template"]["spec"]
    assert spec["serviceAccountName"] == "gpushare-extender"
    assert spec["affinity"]["podAntiAffinity"]
    container = spec["containers"][0]
    assert container["args"] == ["extender", "--port", "12345"]
    assert container["readinessProbe"]["httpGet"]["path"] == "/readyz"
    assert container["livenessProbe"]["httpGet"]["path"] == "/healthz"
    pdb = find(objects, "PodDisruptionBudget", "gpushare-extender")
    assert pdb["spec"]["selector"]["matchLabels"].items() <= dep["spec"]["template"]["metadata"]["labels"].items()
    assert pdb["spec"]["minAvailable"] >= 1
    svc = find(objects, "Service", "gpushare-extender")
    assert svc["spec"]["ports"][0]["port"] == 12345


def test_node_agent_daemonset(rendered: dict[str, list[dict[str, Any]]]) -> None:
    ds = find(rendered["base"], "DaemonSet", "gpushare-node-agent")
    spec = ds["spec"]["template"]["spec"]
    assert spec["nodeSelector"] == {"gpushare": "true"}
    assert spec["hostPID"] is True
    assert {t["key"] for t in spec["tolerations"]} >= {"nvidia.com/gpu", "gpushare"}
    paths = {v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    assert paths == {"/var/lib/kubelet/device-plugins", "/var/lib/kubelet/pod-resources"}
    container = spec["containers"][0]
    env = {e["name"]: e for e in container["env"]}
    assert env["NODE_NAME"]["valueFrom"]["fieldRef"]["fieldPath"] == "spec.nodeName"
    args = container["args"]
    assert args[:3] == ["node-agent", "--node", "$(NODE_NAME)"]
    assert args[args.index("--pod-resources-socket") + 1] == "/var/lib/kubelet/pod-resources/kubelet.sock"
    assert args[args.index("--metrics-port") + 1] == "9119"


def test_nats_is_a_three_server_jetstream_cluster(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    sts = find(objects, "StatefulSet", "nats")
    assert sts["spec"]["replicas"] == 3
    assert sts["spec"]["volumeClaimTemplates"][0]["metadata"]["name"] == "data"
    conf = find(objects, "ConfigMap", "nats-config")["data"]["nats.conf"]
    assert "jetstream" in conf and "store_dir: /data" in conf
    routes = re.findall(r"nats://(nats-\d)\.nats-headless:6222", conf)
    assert routes == ["nats-0", "nats-1", "nats-2"]
    assert find(objects, "Service", "nats-headless")["spec"]["clusterIP"] == "None"
    # every client is given all three servers (a lost one is replaced by another at once)
    servers = find(objects, "ConfigMap", "gpushare-config")["data"]["GPUSHARE_NATS_URL"].split(",")
    assert servers == [f"nats://nats-{i}.nats-headless:4222" for i in range(3)]
    assert find(objects, "ConfigMap", "gpushare-config")["data"]["GPUSHARE_STREAM_REPLICAS"] == "3"


def test_managed_postgres_overlay_has_no_database(rendered: dict[str, list[dict[str, Any]]]) -> None:
    base = {key(o) for o in rendered["base"]}
    objects = rendered["overlays/managed-postgres"]
    managed = {key(o) for o in objects}
    removed = {("StatefulSet", "postgres"), ("Service", "postgres"), ("NetworkPolicy", "postgres")}
    assert removed <= base
    assert base - managed == removed
    assert managed <= base
    config = find(objects, "ConfigMap", "gpushare-config")["data"]
    assert config["GPUSHARE_DATABASE_SERVER"].startswith("db.example.internal:5432/gpushare?sslmode=verify-full")
    # Every workload still finds its Secrets (an old kustomize blanks references to deleted objects).
    for obj in objects:
        for container in (pod_spec(obj) or {}).get("containers", []):
            for env in container.get("env", []):
                ref = env.get("valueFrom", {}).get("secretKeyRef")
                if ref is not None:
                    assert ref["name"] in SECRETS, key(obj)


def test_gpushare_compat_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["overlays/gpushare-compat"]
    svc = find(objects, "Service", "gpushare-extender")
    assert svc["spec"]["type"] == "NodePort"
    assert svc["spec"]["ports"] == [{"name": "http", "port": 12345, "targetPort": "http", "nodePort": 32766}]
    spec = find(objects, "Deployment", "gpushare-extender")["spec"]["template"]["spec"]
    assert spec["hostNetwork"] is True and spec["dnsPolicy"] == "ClusterFirstWithHostNet"
    assert spec["affinity"]["podAntiAffinity"], "the base's anti-affinity survives the patch"


def test_second_scheduler_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["overlays/second-scheduler"]
    dep = find(objects, "Deployment", "gpushare-scheduler")
    assert dep["metadata"]["namespace"] == NAMESPACE
    container = dep["spec"]["template"]["spec"]["containers"][0]
    assert container["image"].startswith("registry.k8s.io/kube-scheduler:v1.")
    assert "--config=/etc/gpushare-scheduler/config.yaml" in container["command"]
    cm = find(objects, "ConfigMap", "gpushare-scheduler-config")
    assert cm["metadata"]["namespace"] == NAMESPACE
    config = yaml.safe_load(cm["data"]["config.yaml"])
    assert config["apiVersion"] == "kubescheduler.config.k8s.io/v1"
    assert config["profiles"] == [{"schedulerName": "gpushare-scheduler"}]
    assert config["leaderElection"]["resourceName"] == "gpushare-scheduler"
    (ext,) = config["extenders"]
    assert ext["urlPrefix"] == "http://gpushare-extender.gpushare-system.svc:12345/gpushare-scheduler"
    base = {key(o) for o in rendered["base"]}
    assert base < {key(o) for o in objects}


def test_nats_config_is_accepted_by_nats_server(rendered: dict[str, list[dict[str, Any]]], tmp_path: Path) -> None:
    data = find(rendered["base"], "ConfigMap", "nats-config")["data"]
    assert set(data) == {"nats.conf", "nats-auth.conf"} and "include ./nats-auth.conf" in data["nats.conf"]
    (tmp_path / "nats-auth.conf").write_text(data["nats-auth.conf"])
    conf = tmp_path / "nats.conf"
    conf.write_text(data["nats.conf"])
    sts = find(rendered["base"], "StatefulSet", "nats")
    passwords = {e["name"]: "x" for e in sts["spec"]["template"]["spec"]["containers"][0]["env"] if "valueFrom" in e}
    env = {**os.environ, **passwords, "POD_NAME": "nats-0"}
    cmd = [nats_server_binary(), "-t", "-c", str(conf)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode == 0, proc.stderr
    conf.write_text(conf.read_text() + "\njetstream {\n")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=30, check=False)
    assert proc.returncode != 0, "nats-server -t accepts a broken file: the check above proves nothing"


def _admission_policy(objects: list[dict[str, Any]], name: str) -> tuple[dict[str, Any], ...]:
    """A ValidatingAdmissionPolicy, its binding (cluster-scoped, denying) and its one resource rule."""
    policy = find(objects, "ValidatingAdmissionPolicy", name)
    binding = find(objects, "ValidatingAdmissionPolicyBinding", name)
    assert policy["apiVersion"] == binding["apiVersion"] == "admissionregistration.k8s.io/v1"
    assert "namespace" not in policy["metadata"] and "namespace" not in binding["metadata"]
    assert binding["spec"]["policyName"] == name and binding["spec"]["validationActions"] == ["Deny"]
    (rule,) = policy["spec"]["matchConstraints"]["resourceRules"]
    return policy, binding, rule


def test_device_env_policy_is_bound_and_gpushares_own_namespace_is_allow_listed(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["base"]
    policy, binding, rule = _admission_policy(objects, POLICY)
    assert rule["resources"] == ["pods"] and rule["operations"] == ["CREATE"]
    (selector,) = binding["spec"]["matchResources"]["namespaceSelector"]["matchExpressions"]
    assert selector == {"key": EXEMPT, "operator": "NotIn", "values": ["true"]}
    message = policy["spec"]["validations"][0]["messageExpression"]
    variables = " ".join(v["expression"] for v in policy["spec"]["variables"])
    assert EXEMPT in message and "NVIDIA_VISIBLE_DEVICES" in variables
    # the node agent reads every GPU with NVIDIA_VISIBLE_DEVICES=all: its namespace must be allow-listed
    agent = find(objects, "DaemonSet", "gpushare-node-agent")["spec"]["template"]["spec"]["containers"][0]
    assert {"name": "NVIDIA_VISIBLE_DEVICES", "value": "all"} in agent["env"]
    assert find(objects, "Namespace", NAMESPACE)["metadata"]["labels"][EXEMPT] == "true"


def test_annotation_policy_is_bound_cluster_wide_and_exempts_exactly_gpushares_writers(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered["base"]
    policy, binding, rule = _admission_policy(objects, ANNOTATION_POLICY)
    assert set(binding["spec"]) == {"policyName", "validationActions"}  # no selector: every namespace
    assert rule["resources"] == ["pods", "pods/*"] and rule["operations"] == ["CREATE", "UPDATE"]
    conditions = {c["name"]: c["expression"] for c in policy["spec"]["matchConditions"]}
    # the ServiceAccounts the binder and the node agent really run as, in the namespace they are installed in
    writers = {
        f"system:serviceaccount:{o['metadata']['namespace']}:{pod_spec(o)['serviceAccountName']}"  # type: ignore[index]
        for o in (find(objects, "Deployment", "gpushare-binder"), find(objects, "DaemonSet", "gpushare-node-agent"))
    }
    assert set(re.findall(r"'([^']+)'", conditions["not-gpushare"])) == writers
    assert set(re.findall(r"'([^']+)'", conditions["not-a-migration-writer"])) == {
        "system:serviceaccount:kube-system:gpushare-schd-extender",
        "system:serviceaccount:kube-system:gpushare-device-plugin",
    }
    variables = " ".join(v["expression"] for v in policy["spec"]["variables"])
    assert "'ALIYUN_COM_GPU_MEM_'" in variables and "'gpushare.io/allocation'" in variables


def test_before_1_30_overlay_is_the_base_without_the_admission_policies(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    base = {key(o) for o in rendered["base"]}
    older = {key(o) for o in rendered["overlays/before-1.30"]}
    policies = (POLICY, f"{POLICY}-workloads", ANNOTATION_POLICY)
    assert base - older == {(kind, name) for name in policies for kind in ADMISSION_KINDS}
    assert older < base


def test_every_shared_setting_is_one_gpushare_reads_and_parses(
    rendered: dict[str, list[dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    from shared.events.streams import StreamLimits
    from shared.settings import Settings

    data = dict(find(rendered["base"], "ConfigMap", "gpushare-config")["data"])
    # not a setting: Kubernetes expands $(GPUSHARE_DATABASE_SERVER) into each service's own database URL
    server = data.pop("GPUSHARE_DATABASE_SERVER")
    for service in ("extender", "binder", "accounting"):
        env = {
            e["name"]: e
            for e in pod_spec(find(rendered["base"], "Deployment", f"gpushare-{service}"))["containers"][0]["env"]
        }
        assert env["GPUSHARE_DATABASE_URL"]["value"].endswith("@$(GPUSHARE_DATABASE_SERVER)"), service
    assert "/" in server and ":" in server, server
    known = {f"GPUSHARE_{name.upper()}" for name in Settings.model_fields}
    assert set(data) <= known, f"unknown settings: {set(data) - known}"
    for name, value in data.items():
        monkeypatch.setenv(name, value)
    settings = Settings()
    assert StreamLimits.from_settings(settings).samples_max_age_s == 86_400
    assert (settings.snapshot_interval, settings.usage_retention) == (3_600, 30 * 86_400)


def _containers(spec: dict[str, Any]) -> list[dict[str, Any]]:
    return [*spec.get("initContainers", []), *spec["containers"]]


def test_every_pod_runs_with_the_runtime_default_seccomp_profile(rendered: dict[str, list[dict[str, Any]]]) -> None:
    checked = 0
    for name in KUSTOMIZATIONS:
        for obj in rendered[name]:
            spec = pod_spec(obj)
            if spec is None:
                continue
            pod_level = (spec.get("securityContext") or {}).get("seccompProfile", {}).get("type")
            for container in _containers(spec):
                profile = (container.get("securityContext") or {}).get("seccompProfile", {}).get("type", pod_level)
                assert profile == "RuntimeDefault", f"{name}: {key(obj)} container {container['name']}: {profile}"
                checked += 1
    assert checked >= 40


def secret_readable(spec: dict[str, Any], container: dict[str, Any], volume: dict[str, Any]) -> bool:
    """Whether `container` can read the files of the Secret `volume` it mounts, as kubelet writes them: owned by root,
    mode `defaultMode` (0644 when unset); with the pod's fsGroup, group fsGroup and mode | 0440 for a read-only
    volume (`changeFilePermission`, pkg/volume/volume_linux.go, v1.37.2; a Secret volume is always read-only), and
    fsGroup among the container's supplemental groups. Root reads everything."""
    pod, own = spec.get("securityContext") or {}, container.get("securityContext") or {}
    uid = own.get("runAsUser", pod.get("runAsUser"))
    gid = own.get("runAsGroup", pod.get("runAsGroup"))
    mode = volume["secret"].get("defaultMode", 0o644)
    items = volume["secret"].get("items") or []
    modes = [i.get("mode", mode) for i in items] or [mode]
    fs_group = pod.get("fsGroup")
    groups = {gid, *pod.get("supplementalGroups", []), *([fs_group] if fs_group is not None else [])}
    file_group = fs_group if fs_group is not None else 0
    if uid == 0:
        return True
    if uid is None:
        return False  # the image's user: unknown here, so a gpushare pod always names it
    return all(
        (m | (0o440 if fs_group is not None else 0)) & 0o004
        or ((m | (0o440 if fs_group is not None else 0)) & 0o040 and file_group in groups)
        for m in modes
    )


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_every_container_can_read_the_secrets_it_mounts(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    checked = 0
    for obj in rendered[name]:
        spec = pod_spec(obj)
        if spec is None:
            continue
        secrets = {v["name"]: v for v in spec.get("volumes", []) if "secret" in v}
        for container in _containers(spec):
            for mount in container.get("volumeMounts", []):
                if mount["name"] in secrets:
                    volume = secrets[mount["name"]]
                    secret = volume["secret"]
                    assert secret_readable(spec, container, volume), (
                        f"{name}: {key(obj)} container {container['name']} cannot read Secret {secret['secretName']}"
                        f" (mode {oct(secret.get('defaultMode', 0o644))}, pod {spec.get('securityContext')},"
                        f" container {container.get('securityContext', {}).get('runAsUser')})"
                    )
                    checked += 1
    if name in ("overlays/extender-mtls", "overlays/dra"):
        assert checked >= 1


def test_the_secret_permission_check_mirrors_kubelet() -> None:
    pod = {"securityContext": {"runAsUser": 10001, "runAsGroup": 10001}}
    container: dict[str, Any] = {}
    owner_only = {"secret": {"secretName": "s", "defaultMode": 0o400}}
    assert not secret_readable(pod, container, owner_only), "root's file, 0400: not for user 10001"
    assert secret_readable({"securityContext": {**pod["securityContext"], "fsGroup": 10001}}, container, owner_only)
    assert secret_readable(pod, container, {"secret": {"secretName": "s"}}), "0644 by default: world-readable"
    assert secret_readable({"securityContext": {"runAsUser": 0}}, container, owner_only)


def test_gpushare_compat_admits_the_host_network_extender_to_postgres_and_nats(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    base, compat = rendered["base"], rendered["overlays/gpushare-compat"]
    cidrs = set()
    for policy, port in (("postgres", 5432), ("nats", 4222)):
        before = find(base, "NetworkPolicy", policy)["spec"]["ingress"]
        after = find(compat, "NetworkPolicy", policy)["spec"]["ingress"]
        assert after[: len(before)] == before, "the base's rules stay as they are"
        (added,) = after[len(before) :]
        assert added["ports"] == [{"port": port}], added
        (source,) = added["from"]
        cidrs.add(source["ipBlock"]["cidr"])
        # the rule is for the host-network extender: no pod selector, so it matches the node's address only
        assert set(source) == {"ipBlock"}, source
    (cidr,) = cidrs  # one CIDR, the same in both patches
    assert ipaddress.ip_network(cidr).num_addresses >= 1
    install = (ROOT / "docs" / "install.md").read_text()
    assert cidr in install and "host-network-postgres.yaml" in install, "install.md says which value to replace"


IMAGE = re.compile(r"^(?P<name>[^@]+?)(?::(?P<tag>[^:@/]+))?(?:@(?P<digest>sha256:[0-9a-f]{64}))?$")
EXACT_TAG = re.compile(r"^v?\d+\.\d+(\.\d+)?([-.][a-z0-9.]+)*$")


def test_third_party_images_are_pinned_by_exact_version(rendered: dict[str, list[dict[str, Any]]]) -> None:
    seen = set()
    for name in KUSTOMIZATIONS:
        for obj in rendered[name]:
            for container in _containers(pod_spec(obj) or {"containers": []}):
                match = IMAGE.match(container["image"])
                assert match, container["image"]
                if match["name"].endswith("/gpushare"):
                    continue  # the project's own image: `kustomize edit set image gpushare=...` (install.md step 1)
                tag = match["tag"] or ""
                assert EXACT_TAG.match(tag) or match["digest"], f"{name}: {key(obj)} runs {container['image']}"
                seen.add(match["name"])
                if match["name"] in {"postgres", "nats"}:  # a major.minor.patch release, not a moving minor
                    assert tag.count(".") >= (1 if match["name"] == "postgres" else 2), container["image"]
    assert {"postgres", "nats", "registry.k8s.io/kube-scheduler", "nvcr.io/nvidia/cuda"} <= seen
    # the base's kustomization pins the same tags as the manifests, so a digest added there lands on them
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    pinned = {i["name"]: str(i["newTag"]) for i in kustomization["images"] if i["name"] in {"postgres", "nats"}}
    for image in (
        find(rendered["base"], "StatefulSet", n)["spec"]["template"]["spec"]["containers"][0]["image"]
        for n in ("postgres", "nats")
    ):
        image_name, tag = image.split(":")
        assert pinned[image_name] == tag, (image, pinned)


def test_a_digest_added_to_the_kustomization_pins_every_workload(kubectl: str, tmp_path: Path) -> None:
    """The step docs/install.md describes (`kustomize edit set image postgres=postgres:16.6@sha256:...`): rendered,
    every PostgreSQL and NATS container runs `name:tag@digest`."""
    digests = {"postgres": "sha256:" + "1" * 64, "nats": "sha256:" + "2" * 64}
    overlay = tmp_path / "pinned"
    overlay.mkdir()
    kustomization = yaml.safe_load((K8S / "base" / "kustomization.yaml").read_text())
    images = [
        {"name": i["name"], "newTag": str(i["newTag"]), "digest": digests[i["name"]]}
        for i in kustomization["images"]
        if i["name"] in digests
    ]
    base = os.path.relpath(K8S / "overlays" / "gpushare-compat", overlay)
    (overlay / "kustomization.yaml").write_text(yaml.safe_dump({"resources": [base], "images": images}))
    proc = subprocess.run(
        [kubectl, "kustomize", str(overlay)], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, proc.stderr
    running = {
        c["image"]
        for obj in yaml.safe_load_all(proc.stdout)
        if obj and pod_spec(obj)
        for c in _containers(pod_spec(obj))
        if not c["image"].endswith(f"gpushare:{VERSION}")
    }
    tags = {i["name"]: i["newTag"] for i in images}
    assert running == {f"{n}:{tags[n]}@{d}" for n, d in digests.items()}, running


def test_components_label_the_service_monitor_and_run_mps_where_labelled(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    from services.node_agent.mps import MpsRoot

    base, full = rendered["base"], rendered["overlays/with-components"]
    assert "release" not in find(base, "ServiceMonitor", "gpushare")["metadata"]["labels"]
    assert find(full, "ServiceMonitor", "gpushare")["metadata"]["labels"]["release"] == "kube-prometheus-stack"
    assert {key(o) for o in full} - {key(o) for o in base} == {("DaemonSet", "gpushare-mps-control")}
    daemon = find(full, "DaemonSet", "gpushare-mps-control")["spec"]["template"]["spec"]
    assert daemon["nodeSelector"] == {"gpushare": "true", "gpushare.io/mps": "true"}
    agent = find(full, "DaemonSet", "gpushare-node-agent")["spec"]["template"]["spec"]
    args = agent["containers"][0]["args"]
    root = MpsRoot(Path(args[args.index("--mps-root") + 1]))
    # the daemon's pipe and shared memory are where the agent's MpsRoot looks and what it mounts into clients
    env = {e["name"]: e["value"] for e in daemon["containers"][0]["env"]}
    assert env["CUDA_MPS_PIPE_DIRECTORY"] == str(root.pipe_dir)
    host = {v["name"]: v["hostPath"]["path"] for v in daemon["volumes"]}
    mounts = {m["mountPath"]: m["name"] for m in daemon["containers"][0]["volumeMounts"]}
    assert host[mounts["/dev/shm"]] == str(root.shm_dir) and host[mounts[str(root.root)]] == str(root.root)
    agent_mount = {m["mountPath"]: m for m in agent["containers"][0]["volumeMounts"]}[str(root.root)]
    assert agent_mount["readOnly"] is True
    assert {v["name"]: v.get("hostPath", {}).get("path") for v in agent["volumes"]}[agent_mount["name"]] == str(
        root.root
    )


def test_extender_mtls_overlay(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Mutual TLS on the verbs' port; probes and Prometheus on the plain health port (which serves nothing else)."""
    objects = rendered["overlays/extender-mtls"]
    spec = pod_spec(find(objects, "Deployment", "gpushare-extender"))
    (container,) = spec["containers"]
    args = container["args"]
    flags = {args[i]: args[i + 1] for i in range(1, len(args) - 1, 2)}
    assert flags["--tls-client-ca"] == "/etc/gpushare/tls/ca.crt" and flags["--health-port"] == "12346"
    assert all(flags[f].startswith("/etc/gpushare/tls/") for f in ("--tls-cert", "--tls-key"))
    assert container["readinessProbe"]["httpGet"]["port"] == "health"
    assert container["livenessProbe"]["httpGet"]["port"] == "health"
    assert {"name": "health", "containerPort": 12346} in container["ports"]
    assert {v["name"]: v["secret"]["secretName"] for v in spec["volumes"] if "secret" in v} == {
        "tls": "gpushare-extender-tls"
    }
    ports = {p["name"]: p["port"] for p in find(objects, "Service", "gpushare-extender")["spec"]["ports"]}
    assert ports == {"https": 12345, "metrics": 12346}  # the ServiceMonitor scrapes `metrics`, not 12345
    monitor = next(o for o in objects if o["kind"] == "ServiceMonitor")
    assert "https" not in {e["port"] for e in monitor["spec"]["endpoints"]}


def _secret_refs(obj: dict[str, Any]) -> set[tuple[str, str]]:
    """(Secret, key) of every secretKeyRef, envFrom secretRef and secret volume of a workload."""
    spec = pod_spec(obj) or {}
    out = set()
    for container in spec.get("containers", []) + spec.get("initContainers", []):
        for env in container.get("env", []):
            if ref := env.get("valueFrom", {}).get("secretKeyRef"):
                out.add((ref["name"], ref["key"]))
        for source in container.get("envFrom", []):
            if ref := source.get("secretRef"):
                out.add((ref["name"], "*"))
    for volume in spec.get("volumes", []):
        if "secret" in volume:
            out.add((volume["secret"]["secretName"], "*"))
    return out


@pytest.mark.parametrize("name", KUSTOMIZATIONS)
def test_node_agents_see_no_database_credential(rendered: dict[str, list[dict[str, Any]]], name: str) -> None:
    """A GPU node's kubelet fetches only the Secrets its pods name: a node agent's names its NATS password."""
    agents = [o for o in rendered[name] if o["kind"] == "DaemonSet" and o["metadata"]["name"] in NODE_AGENTS]
    assert "gpushare-node-agent" in {a["metadata"]["name"] for a in agents}
    for agent in agents:
        assert _secret_refs(agent) == {("gpushare-node-agent", "nats-password")}, key(agent)
        env = {e["name"] for e in pod_spec(agent)["containers"][0].get("env", [])}
        assert not any("DATABASE" in e for e in env), env
    (secret,) = [o for o in rendered[name] if key(o) == ("Secret", "gpushare-node-agent")]
    assert set(secret.get("data") or secret.get("stringData")) == {"nats-password"}


def test_each_service_uses_its_own_role_and_nats_user(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    for service in ("extender", "binder", "accounting"):
        obj = find(objects, "Deployment", f"gpushare-{service}")
        env = {e["name"]: e for e in pod_spec(obj)["containers"][0]["env"]}
        assert env["GPUSHARE_DATABASE_URL"]["value"] == f"postgresql://gpushare_{service}@$(GPUSHARE_DATABASE_SERVER)"
        assert env["GPUSHARE_NATS_USER"]["value"] == f"gpushare-{service}"
        assert {r for r in _secret_refs(obj) if r[0] != "gpushare-admin"} == {
            ("gpushare-database", f"{service}-password"),
            ("gpushare-nats", f"{service}-password"),
        }
    job = pod_spec(find(objects, "Job", MIGRATE_JOB))["containers"][0]
    env = {e["name"]: e for e in job["env"]}
    assert env["GPUSHARE_DATABASE_URL"]["value"].startswith("postgresql://gpushare_migrate@")
    assert {f"GPUSHARE_DB_PASSWORD_{s}" for s in ("EXTENDER", "BINDER", "ACCOUNTING")} <= set(env)
    auth_conf = find(objects, "ConfigMap", "nats-config")["data"]["nats-auth.conf"]
    nats_users = re.findall(r"user: (gpushare-[a-z-]+)", auth_conf)
    assert set(nats_users) == {
        "gpushare-extender",
        "gpushare-binder",
        "gpushare-accounting",
        "gpushare-node-agent",
        "gpushare-admin",
    }


def test_shipped_secrets_are_placeholders_the_services_refuse(rendered: dict[str, list[dict[str, Any]]]) -> None:
    """Every shipped secret is a placeholder (so `generate-secrets.sh` must run, docs/install.md step 2)."""
    import base64

    from shared.placeholders import PLACEHOLDER

    for name in SECRETS:
        secret = find(rendered["base"], "Secret", name)
        for k, v in secret["data"].items():
            assert base64.b64decode(v).decode().startswith(PLACEHOLDER), (name, k)


def test_generate_secrets_replaces_every_placeholder_once(tmp_path: Path) -> None:
    import shutil

    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    script = copy / "generate-secrets.sh"
    first = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, check=True)
    files = sorted((copy / "base" / "secrets").iterdir())
    values = {f.name: f.read_text() for f in files}
    assert len(first.stdout.splitlines()) == len(files) >= 11
    assert all(re.fullmatch(r"[A-Za-z0-9]{32}", v) for v in values.values()), values
    assert len(set(values.values())) == len(values)
    assert all(oct(f.stat().st_mode)[-3:] == "600" for f in files)
    again = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert again.stdout == "" and {f.name: f.read_text() for f in files} == values  # kept
    forced = subprocess.run(["sh", str(script), "--force"], capture_output=True, text=True, timeout=60, check=True)
    assert len(forced.stdout.splitlines()) == len(files)
    assert all(values[f.name] != f.read_text() for f in files)
