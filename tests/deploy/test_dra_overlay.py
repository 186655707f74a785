"""k8s/overlays/dra: gpushare admission as shipped is the object `shared.dra.webhook` writes (and `gpushare up --dra`
registers), served by the extender on its webhook port with the Secret's certificate, whose CA reaches `caBundle`;
the extender may create exactly the ResourceClaimTemplates its code creates (a rule of k8s/base); the node agent runs
as a kubelet DRA plugin on the nodes labelled gpushare.io/allocator=dra, with kubelet's plugin paths, and the
device-plugin agent never runs there; `k8s/generate-webhook-cert.sh` makes a certificate kube-apiserver can verify
for the Service's name, and the extender refuses the shipped placeholder."""

from __future__ import annotations

import ast
import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from shared.dra import CDI_DIR, PLUGIN_DIR, REGISTRATION_DIR
from shared.dra.classes import device_class
from shared.dra.webhook import CLAIM_PATH, PATH, claim_webhook_configuration, webhook_configuration
from tests.deploy.test_rbac import granted
from tests.deploy.tools import K8S, ROOT, assert_serving_certificate, find, pod_spec, render, runs_on

OVERLAY = "overlays/dra"
SERVICE = {"namespace": "gpushare-system", "name": "gpushare-extender", "path": PATH, "port": 443}


def test_the_webhook_configuration_is_the_one_the_code_writes(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered[OVERLAY]
    shipped = find(objects, "MutatingWebhookConfiguration", "gpushare-dra-admission")
    (hook,) = shipped["webhooks"]
    (want,) = webhook_configuration({"service": SERVICE})["webhooks"]
    ca_bundle = hook["clientConfig"].pop("caBundle")
    assert hook == want
    secret = find(objects, "Secret", "gpushare-admission-tls")
    assert "".join(ca_bundle.split()) == "".join(secret["data"]["caBundle"].split())  # the Secret's CA
    assert find(objects, "DeviceClass", "gpushare-gpu")["spec"] == device_class()["spec"]
    claims = find(objects, "ValidatingWebhookConfiguration", "gpushare-dra-claims")
    (hook,) = claims["webhooks"]
    (want,) = claim_webhook_configuration({"service": {**SERVICE, "path": CLAIM_PATH}})["webhooks"]
    claims_ca = hook["clientConfig"].pop("caBundle")
    assert hook == want
    assert "".join(claims_ca.split()) == "".join(secret["data"]["caBundle"].split())


def test_only_kube_apiserver_reaches_the_webhook_port(rendered: dict[str, list[dict[str, Any]]]) -> None:
    policy = find(rendered[OVERLAY], "NetworkPolicy", "gpushare-extender")
    assert policy["spec"]["podSelector"]["matchLabels"]["app.kubernetes.io/name"] == "gpushare-extender"
    verbs, webhook = policy["spec"]["ingress"]
    assert verbs == {"ports": [{"port": 12345}]}
    assert webhook["ports"] == [{"port": 8443}] and [f["ipBlock"]["cidr"] for f in webhook["from"]] == [
        "198.51.100.0/24"
    ]


def test_the_extender_serves_the_webhook_port_with_the_secrets_certificate(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered[OVERLAY]
    spec = pod_spec(find(objects, "Deployment", "gpushare-extender"))
    (container,) = spec["containers"]
    args = build_parser().parse_args(container["args"])  # every flag exists
    assert (args.port, args.webhook_port) == (12345, 8443)
    mounts = {m["name"]: m["mountPath"] for m in container["volumeMounts"]}
    volumes = {v["name"]: v.get("secret", {}).get("secretName") for v in spec["volumes"]}
    (volume,) = [name for name, secret in volumes.items() if secret == "gpushare-admission-tls"]
    assert args.webhook_tls_cert == f"{mounts[volume]}/tls.crt" and args.webhook_tls_key == f"{mounts[volume]}/tls.key"
    assert spec["securityContext"]["fsGroup"] == spec["securityContext"]["runAsGroup"]  # the key is the group's
    assert {"name": "webhook", "containerPort": 8443} in container["ports"]
    ports = {p["name"]: p for p in find(objects, "Service", "gpushare-extender")["spec"]["ports"]}
    assert ports["webhook"]["port"] == SERVICE["port"] and ports["webhook"]["targetPort"] == "webhook"
    assert ports["http"]["port"] == 12345  # kube-scheduler's verbs are where they were


def _calls(path: Path) -> set[str]:
    return {n.attr for n in ast.walk(ast.parse(path.read_text())) if isinstance(n, ast.Attribute)}


def test_the_extender_may_create_what_admission_creates_in_every_installation(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    """The DRA path's RBAC is in k8s/base, like the binder's and the node agent's DRA rules (test_rbac.py checks
    each account's rules against its code): the overlay grants nothing more."""
    calls = _calls(ROOT / "services" / "extender" / "admission.py")
    assert {"create_namespaced_resource_claim_template", "read_namespaced_resource_claim_template"} <= calls
    for account in ("gpushare-extender", "gpushare-binder", "gpushare-node-agent", "gpushare-accounting"):
        assert granted(rendered[OVERLAY], account) == granted(rendered["base"], account), account
    assert {
        ("resource.k8s.io", "resourceclaimtemplates", "create"),
        ("resource.k8s.io", "resourceclaimtemplates", "get"),
    } <= granted(rendered["base"], "gpushare-extender")
    inspect = find(rendered["base"], "ClusterRole", "gpushare-inspect")["rules"]
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]} in inspect
    assert find(rendered[OVERLAY], "ClusterRole", "gpushare-inspect") == find(
        rendered["base"], "ClusterRole", "gpushare-inspect"
    )
    assert "list_resource_slice" in _calls(ROOT / "services" / "accounting" / "inspect_source.py")


DRA_AGENT = "gpushare-node-agent-dra"
DRA_NODE = {"gpushare": "true", "gpushare.io/allocator": "dra", "kubernetes.io/hostname": "gpu-node-2"}
DEVICE_PLUGIN_NODE = {"gpushare": "true", "kubernetes.io/hostname": "gpu-node-1"}


def test_the_node_agent_runs_as_a_dra_plugin_with_kubelets_plugin_paths_mounted(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    objects = rendered[OVERLAY]
    spec = pod_spec(find(objects, "DaemonSet", DRA_AGENT))
    (container,) = spec["containers"]
    args = build_parser().parse_args(container["args"])
    assert args.dra and args.node == "$(NODE_NAME)" and args.metrics_port == 9119
    # the directories the agent is told are the ones kubelet and the runtime use (shared/dra), mounted from the host
    assert (args.dra_registration_dir, args.dra_plugin_dir, args.cdi_dir) == (REGISTRATION_DIR, PLUGIN_DIR, CDI_DIR)
    host = {v["name"]: v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v}
    mounted = {host[m["name"]]: m["mountPath"] for m in container["volumeMounts"] if m["name"] in host}
    assert mounted == {d: d for d in (REGISTRATION_DIR, PLUGIN_DIR, CDI_DIR)}, "exactly kubelet's plugin paths"
    assert not any(m.get("readOnly") for m in container["volumeMounts"] if m["name"] in host)  # sockets, specs
    # --dra needs the API (its slice, the claims): the agent's own account, with its token
    assert spec["serviceAccountName"] == "gpushare-node-agent" and spec.get("automountServiceAccountToken") is not False
    assert {"resourceslices", "resourceclaims"} <= {r for _, r, _ in granted(objects, "gpushare-node-agent")}
    device_plugin = pod_spec(find(objects, "DaemonSet", "gpushare-node-agent"))
    for field in ("hostPID", "priorityClassName", "tolerations", "securityContext"):
        assert spec[field] == device_plugin[field], field
    assert container["securityContext"] == device_plugin["containers"][0]["securityContext"]
    # the pod template carries gpushare's label, which the NATS NetworkPolicy admits
    nats = find(objects, "NetworkPolicy", "nats")["spec"]["ingress"][0]["from"][0]["podSelector"]["matchLabels"]
    assert nats.items() <= find(objects, "DaemonSet", DRA_AGENT)["spec"]["template"]["metadata"]["labels"].items()


def test_a_node_is_a_device_plugin_node_or_a_dra_node_never_both(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered[OVERLAY]
    dra = pod_spec(find(objects, "DaemonSet", DRA_AGENT))
    device_plugin = pod_spec(find(objects, "DaemonSet", "gpushare-node-agent"))
    assert runs_on(dra, DRA_NODE) and not runs_on(device_plugin, DRA_NODE)
    assert runs_on(device_plugin, DEVICE_PLUGIN_NODE) and not runs_on(dra, DEVICE_PLUGIN_NODE)
    assert not runs_on(dra, {"kubernetes.io/hostname": "cpu-node"})
    # the base, without DRA nodes, keeps the device-plugin agent as it was
    base = pod_spec(find(rendered["base"], "DaemonSet", "gpushare-node-agent"))
    assert "affinity" not in base and runs_on(base, DRA_NODE)
    # neither DaemonSet selects the other's pods, and each has its metrics Service, which the ServiceMonitor scrapes
    selectors = [
        find(objects, "DaemonSet", n)["spec"]["selector"]["matchLabels"] for n in (DRA_AGENT, "gpushare-node-agent")
    ]
    templates = [
        find(objects, "DaemonSet", n)["spec"]["template"]["metadata"]["labels"]
        for n in ("gpushare-node-agent", DRA_AGENT)
    ]
    assert not any(s.items() <= t.items() for s, t in zip(selectors, templates, strict=True))
    monitor = find(objects, "ServiceMonitor", "gpushare")["spec"]
    service = find(objects, "Service", DRA_AGENT)
    assert monitor["selector"]["matchLabels"].items() <= service["metadata"]["labels"].items()
    assert service["spec"]["selector"].items() <= templates[1].items()
    assert {"port": "metrics", "path": "/metrics"}.items() <= next(
        e for e in monitor["endpoints"] if e["port"] == "metrics"
    ).items()


def test_generate_webhook_cert_makes_a_certificate_for_the_service_and_its_ca_reaches_ca_bundle(
    tmp_path: Path, kubectl: str
) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    script = copy / "generate-webhook-cert.sh"
    first = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, check=True)
    tls = copy / "overlays" / "dra" / "tls"
    assert "generated the webhook certificate for gpushare-extender.gpushare-system.svc" in first.stdout
    assert_serving_certificate(tls / "ca.crt", tls / "tls.crt")
    text = subprocess.run(
        ["openssl", "x509", "-in", str(tls / "tls.crt"), "-noout", "-ext", "subjectAltName"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout
    assert "DNS:gpushare-extender.gpushare-system.svc" in text
    assert oct((tls / "tls.key").stat().st_mode)[-3:] == "600"
    cert = (tls / "tls.crt").read_bytes()
    again = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, check=True)
    assert "kept" in again.stdout and (tls / "tls.crt").read_bytes() == cert
    objects = render(kubectl, str(copy / "overlays" / "dra"))
    (hook,) = find(objects, "MutatingWebhookConfiguration", "gpushare-dra-admission")["webhooks"]
    assert base64.b64decode("".join(hook["clientConfig"]["caBundle"].split())) == (tls / "ca.crt").read_bytes()


def test_the_extender_refuses_the_shipped_placeholder_certificate() -> None:
    from services.extender.cli import run
    from shared.settings import Settings

    tls = K8S / "overlays" / "dra" / "tls"
    argv = ["extender", "--webhook-port", "8443", "--webhook-tls-cert", str(tls / "tls.crt")]
    args = build_parser().parse_args([*argv, "--webhook-tls-key", str(tls / "tls.key")])
    with pytest.raises(SystemExit, match=r"shipped placeholder: run k8s/generate-webhook-cert\.sh"):
        run(args, Settings())
    missing = build_parser().parse_args(["extender", "--webhook-port", "8443"])
    with pytest.raises(SystemExit, match="needs --webhook-tls-cert and --webhook-tls-key"):
        run(missing, Settings())
