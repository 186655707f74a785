"""gpushare admission in the local stack: the webhook's serving certificate and its registration.

With DRA nodes, the extender also serves the mutating webhook (`--webhook-port`) over HTTPS with a certificate
signed by a CA made here (openssl, as `devstack.cluster.controlplane` makes its own), for `127.0.0.1`, the
address kube-apiserver calls it at. Once the control plane is up, the MutatingWebhookConfiguration of
`shared.dra.webhook` is registered with that CA as `caBundle`, and a namespace opts in with the label
`gpushare.io/allocator=dra`: its unchanged `aliyun.com/*` pods are then rewritten into claims. The
ValidatingWebhookConfiguration that counts every gpushare claim against its namespace's GiB quota at creation is
registered beside it.
"""

from __future__ import annotations

import base64
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from shared.dra.admission import OPT_IN_LABEL, OPT_IN_VALUE
from shared.dra.webhook import (
    CLAIM_CONFIGURATION_NAME,
    CLAIM_PATH,
    CONFIGURATION_NAME,
    PATH,
    claim_webhook_configuration,
    webhook_configuration,
)

HOST = "127.0.0.1"


class CertificateError(RuntimeError):
    """openssl could not make the webhook's certificate (the message has its error)."""


@dataclass(frozen=True)
class WebhookTls:
    """The webhook's CA certificate and its serving certificate and key."""

    ca: Path
    cert: Path
    key: Path

    def ca_bundle(self) -> str:
        """The CA as a MutatingWebhookConfiguration's `caBundle` (base64 of the PEM)."""
        return base64.b64encode(self.ca.read_bytes()).decode()


def _openssl(*args: str) -> None:
    res = subprocess.run(["openssl", *args], capture_output=True, check=False)
    if res.returncode:
        raise CertificateError(f"openssl {args[0]} failed: {res.stderr.decode(errors='replace')[-500:]}")


def make_certificates(directory: Path, host: str = HOST, days: int = 30) -> WebhookTls:
    """A CA and a serving certificate for `host` (an IP address SAN) it signed; kept when they exist."""
    directory.mkdir(parents=True, exist_ok=True)
    ca_key, ca, key, cert = (directory / n for n in ("ca.key", "ca.crt", "tls.key", "tls.crt"))
    if ca.exists() and cert.exists() and key.exists():
        return WebhookTls(ca, cert, key)
    csr, ext = directory / "tls.csr", directory / "tls.ext"
    _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", str(days), "-subj", "/CN=gpushare-admission-ca",
             "-keyout", str(ca_key), "-out", str(ca))  # fmt: skip
    _openssl("req", "-newkey", "rsa:2048", "-nodes", "-subj", "/CN=gpushare-admission", "-keyout", str(key),
             "-out", str(csr))  # fmt: skip
    ext.write_text(f"subjectAltName=IP:{host}\nextendedKeyUsage=serverAuth\n")
    _openssl("x509", "-req", "-in", str(csr), "-CA", str(ca), "-CAkey", str(ca_key), "-CAcreateserial",
             "-days", str(days), "-extfile", str(ext), "-out", str(cert))  # fmt: skip
    for secret in (ca_key, key):
        secret.chmod(0o600)
    return WebhookTls(ca, cert, key)


def webhook_url(port: int, host: str = HOST, path: str = PATH) -> str:
    """Where kube-apiserver calls the webhook (`path`: the pods' `/mutate`, or the claims' `/validate-claims`)."""
    return f"https://{host}:{port}{path}"


async def register_webhook(api: Any, url: str, tls: WebhookTls) -> dict[str, Any]:
    """Create (or replace) the MutatingWebhookConfiguration calling `url` and the claims' ValidatingWebhookConfiguration
    on the same port; returns the mutating one."""
    from kubernetes_asyncio import client

    admission = client.AdmissionregistrationV1Api(api)
    claims_url = url.removesuffix(PATH) + CLAIM_PATH
    await _create_or_replace(
        claim_webhook_configuration({"url": claims_url, "caBundle": tls.ca_bundle()}),
        CLAIM_CONFIGURATION_NAME,
        admission.create_validating_webhook_configuration,
        admission.read_validating_webhook_configuration,
        admission.replace_validating_webhook_configuration,
    )
    return await _create_or_replace(
        webhook_configuration({"url": url, "caBundle": tls.ca_bundle()}),
        CONFIGURATION_NAME,
        admission.create_mutating_webhook_configuration,
        admission.read_mutating_webhook_configuration,
        admission.replace_mutating_webhook_configuration,
    )


async def _create_or_replace(body: dict[str, Any], name: str, create: Any, read: Any, replace: Any) -> dict[str, Any]:
    from kubernetes_asyncio.client.exceptions import ApiException

    from shared.kube.raw import read_json

    try:
        return await read_json(await create(body, _preload_content=False))
    except ApiException as exc:
        if exc.status != 409:
            raise
    current = await read_json(await read(name, _preload_content=False))
    body["metadata"]["resourceVersion"] = current["metadata"]["resourceVersion"]
    return await read_json(await replace(name, body, _preload_content=False))


async def opt_in(api: Any, namespace: str) -> None:
    """Label a namespace so that its `aliyun.com/*` pods go to DRA (created when missing)."""
    from kubernetes_asyncio import client
    from kubernetes_asyncio.client.exceptions import ApiException

    core = client.CoreV1Api(api)
    labels = {OPT_IN_LABEL: OPT_IN_VALUE}
    namespace_object = {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": namespace, "labels": labels}}
    try:
        await core.create_namespace(namespace_object)
    except ApiException as exc:
        if exc.status != 409:
            raise
        await core.patch_namespace(namespace, {"metadata": {"labels": labels}})
