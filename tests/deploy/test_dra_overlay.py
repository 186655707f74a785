"""k8s/overlays/dra: gpushare admission as shipped is the object `shared.dra.webhook` writes (and `gpushare up --dra`
registers), served by the extender on its webhook port with the Secret's certificate, whose CA reaches `caBundle`;
the extender may create exactly the ResourceClaimTemplates its code creates; `k8s/generate-webhook-cert.sh` makes a
certificate kube-apiserver can verify for the Service's name, and the extender refuses the shipped placeholder."""

from __future__ import annotations

import ast
import base64
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from services.cli import build_parser
from shared.dra.classes import device_class
from shared.dra.webhook import PATH, webhook_configuration
from tests.deploy.test_rbac import granted
from tests.deploy.tools import K8S, ROOT, find, pod_spec, render

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


def test_the_extender_may_create_what_admission_creates_and_nothing_more(
    rendered: dict[str, list[dict[str, Any]]],
) -> None:
    base = granted(rendered["base"], "gpushare-extender")
    overlay = granted(rendered[OVERLAY], "gpushare-extender")
    calls = _calls(ROOT / "services" / "extender" / "admission.py")
    assert {"create_namespaced_resource_claim_template", "read_namespaced_resource_claim_template"} <= calls
    assert overlay - base == {
        ("resource.k8s.io", "resourceclaimtemplates", "create"),
        ("resource.k8s.io", "resourceclaimtemplates", "get"),
    }
    inspect = find(rendered[OVERLAY], "ClusterRole", "gpushare-inspect")["rules"]
    assert {"apiGroups": ["resource.k8s.io"], "resources": ["resourceslices"], "verbs": ["list"]} in inspect
    assert "list_resource_slice" in _calls(ROOT / "services" / "accounting" / "inspect_source.py")


def test_generate_webhook_cert_makes_a_certificate_for_the_service_and_its_ca_reaches_ca_bundle(
    tmp_path: Path, kubectl: str
) -> None:
    copy = tmp_path / "k8s"
    shutil.copytree(K8S, copy)
    script = copy / "generate-webhook-cert.sh"
    first = subprocess.run(["sh", str(script)], capture_output=True, text=True, timeout=60, check=True)
    tls = copy / "overlays" / "dra" / "tls"
    assert "generated the webhook certificate for gpushare-extender.gpushare-system.svc" in first.stdout
    verify = subprocess.run(
        ["openssl", "verify", "-CAfile", str(tls / "ca.crt"), "-purpose", "sslserver", str(tls / "tls.crt")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert verify.returncode == 0, verify.stdout + verify.stderr
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
