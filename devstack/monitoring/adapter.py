"""prometheus-adapter serving `custom.metrics.k8s.io` and `external.metrics.k8s.io` through a local control plane's
aggregation layer.

    adapter = MetricsAdapter(work_dir, kubeconfig, prometheus_url, rules_config())
    adapter.start()                  # built once and cached (adapter_build), then waits for its /healthz
    await adapter.register(api)      # Service (ExternalName localhost) + APIServices; waits until Available
    ...
    adapter.stop()

kube-apiserver proxies `/apis/custom.metrics.k8s.io/...` to the APIService's Service. Without kube-proxy a cluster
IP leads nowhere, and Endpoints / EndpointSlices refuse loopback addresses, so the Service is an ExternalName
`localhost` on the adapter's port: kube-apiserver resolves it itself and dials https://localhost:PORT, with the
front-proxy client certificate the adapter trusts through kube-system's `extension-apiserver-authentication`.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.buildtools import ControlPlaneUnavailable, Progress, stderr_progress
from devstack.embedded import free_port
from devstack.monitoring.adapter_build import ensure_adapter
from devstack.monitoring.server import LocalServer, http_ok

HPA_DIR = Path(__file__).resolve().parents[2] / "k8s" / "hpa"
RULES_FILE = HPA_DIR / "prometheus-adapter-config.yaml"
EXAMPLE_HPA = HPA_DIR / "example-hpa.yaml"
GROUP = "custom.metrics.k8s.io"
VERSIONS = ("v1beta2", "v1beta1")
EXTERNAL_GROUP = "external.metrics.k8s.io"  # served when the rules have externalRules (the guide's HPA metric)
EXTERNAL_VERSION = "v1beta1"
GUIDE_HPA = HPA_DIR / "guide-external-hpa.yaml"
NAMESPACE = "custom-metrics"
SERVICE = "prometheus-adapter"


def rules_config(path: Path = RULES_FILE) -> str:
    """The adapter configuration gpushare ships (the ConfigMap's `config.yaml`)."""
    return str(yaml.safe_load(path.read_text())["data"]["config.yaml"])


def hpa_metric(path: Path = EXAMPLE_HPA) -> str:
    """The custom metric the shipped HPA example scales on (where the local stack and the tests take its name)."""
    spec = yaml.safe_load(path.read_text())["spec"]
    return str(spec["metrics"][0]["pods"]["metric"]["name"])


def external_hpa_metric(path: Path = GUIDE_HPA) -> tuple[str, dict[str, str]]:
    """The External metric of the guide's HPA example and the labels its selector matches."""
    metric = yaml.safe_load(path.read_text())["spec"]["metrics"][0]["external"]["metric"]
    return str(metric["name"]), dict(metric["selector"]["matchLabels"])


def api_objects(port: int) -> list[dict[str, Any]]:
    """The Service and APIServices that route custom.metrics.k8s.io and external.metrics.k8s.io to an adapter on
    localhost:`port` (pure)."""
    service = {
        "apiVersion": "v1",
        "kind": "Service",
        "metadata": {"name": SERVICE, "namespace": NAMESPACE},
        "spec": {"type": "ExternalName", "externalName": "localhost", "ports": [{"name": "https", "port": port}]},
    }
    served = [(GROUP, version, 200 - 100 * i) for i, version in enumerate(VERSIONS)]
    served.append((EXTERNAL_GROUP, EXTERNAL_VERSION, 100))
    apiservices = [
        {
            "apiVersion": "apiregistration.k8s.io/v1",
            "kind": "APIService",
            "metadata": {"name": f"{version}.{group}"},
            "spec": {
                "service": {"namespace": NAMESPACE, "name": SERVICE, "port": port},
                "group": group,
                "version": version,
                "insecureSkipTLSVerify": True,
                "groupPriorityMinimum": 100,
                "versionPriority": priority,
            },
        }
        for group, version, priority in served
    ]
    return [service, *apiservices]


class MetricsAdapter(LocalServer):
    """One prometheus-adapter process for a local control plane."""

    name = "prometheus-adapter"

    def __init__(
        self,
        work_dir: Path,
        kubeconfig: str,
        prometheus_url: str,
        config: str,
        *,
        relist_interval_s: float = 2.0,
        progress: Progress = stderr_progress,
    ) -> None:
        super().__init__(Path(work_dir) / "prometheus-adapter.log")
        self.work_dir = Path(work_dir)
        self.kubeconfig = kubeconfig
        self.prometheus_url = prometheus_url
        self.config = config
        self.relist_interval_s = relist_interval_s
        self.progress = progress
        self.port = free_port()

    def start(self, timeout_s: float = 60.0) -> MetricsAdapter:
        """Start the adapter (building it first if needed) and wait for its /healthz."""
        binary = ensure_adapter(progress=self.progress)
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config = self.work_dir / "adapter-config.yaml"
        config.write_text(self.config)
        args = [
            str(binary),
            f"--secure-port={self.port}",
            "--bind-address=127.0.0.1",
            f"--cert-dir={self.work_dir / 'adapter-certs'}",
            f"--lister-kubeconfig={self.kubeconfig}",
            f"--authentication-kubeconfig={self.kubeconfig}",
            f"--authorization-kubeconfig={self.kubeconfig}",
            f"--prometheus-url={self.prometheus_url}/",
            f"--metrics-relist-interval={self.relist_interval_s:g}s",
            f"--config={config}",
            "--v=2",
        ]
        self.spawn(args, lambda: http_ok(f"https://127.0.0.1:{self.port}/healthz"), timeout_s)
        self.progress(f"prometheus-adapter serving on https://127.0.0.1:{self.port}")
        return self

    async def register(self, api: client.ApiClient, timeout_s: float = 60.0) -> None:
        """Create the namespace, Service and APIServices, and wait until kube-apiserver reports them Available."""
        core = client.CoreV1Api(api)
        try:
            await core.create_namespace({"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": NAMESPACE}})
        except ApiException as exc:
            if exc.status != 409:
                raise
        service, *apiservices = api_objects(self.port)
        await core.create_namespaced_service(NAMESPACE, service)
        registration = client.ApiregistrationV1Api(api)
        for obj in apiservices:
            await registration.create_api_service(obj)
        deadline = time.monotonic() + timeout_s
        while True:
            states = {}
            for obj in apiservices:
                got = await registration.read_api_service(obj["metadata"]["name"])
                conditions = {c.type: c for c in (got.status.conditions or [])} if got.status else {}
                available = conditions.get("Available")
                states[obj["metadata"]["name"]] = (available.status, available.message) if available else ("?", "")
            if all(status == "True" for status, _ in states.values()):
                self.progress(f"{GROUP} ({', '.join(VERSIONS)}) and {EXTERNAL_GROUP} available through kube-apiserver")
                return
            if time.monotonic() > deadline:
                raise ControlPlaneUnavailable(f"the APIServices did not become Available: {states}\n{self.log_tail()}")
            await asyncio.sleep(0.5)
