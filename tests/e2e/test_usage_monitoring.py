"""The usage story end to end without a GPU, on the real control plane.

The node agents run fake GPUs with simulated usage (`--simulate-usage @usage.rules`); a real Prometheus (Debian's
package) scrapes the extender, binder, accounting and node agents; prometheus-adapter (built from its Go module)
serves `custom.metrics.k8s.io` through kube-apiserver's aggregation layer with the rules gpushare ships
(k8s/hpa/prometheus-adapter-config.yaml), and `external.metrics.k8s.io` for the gpushare guide's HPA metric
`aliyun_gpu_mem_usage`; kube-controller-manager's HPA controller scales Deployments of GPU pods on the pods' GPU
memory usage, through either metric, the extender places the new replicas, and the ledger stays exact. Every
panel of the shipped Grafana dashboard then finds data in that Prometheus (or is listed with the event it needs).
"""

from __future__ import annotations

import asyncio
import json
import math
import re
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.monitoring.adapter import GUIDE_HPA, external_hpa_metric, hpa_metric
from devstack.stack.demo import DEMO_NAMESPACE, DEMO_USAGE_RULES, deployment, submit_demo
from tests import system_tools
from tests.e2e import helpers as h
from tests.e2e.conftest import ADMIN_TOKEN
from tests.waiting import eventually

pytestmark = pytest.mark.e2e

ROOT = Path(__file__).resolve().parents[2]
DASHBOARD = ROOT / "k8s" / "base" / "gpushare-dashboard.json"

STACK_NODES = 2
STACK_GPUS = "2x16GiB:Tesla-T4"
STACK_USAGE_RULES = DEMO_USAGE_RULES
STACK_CONTROLLER_MANAGER = ["--horizontal-pod-autoscaler-sync-period=2s"]
STACK_MONITORING = True

# Panels whose query needs an event these tests do not cause, and why (each still has to be valid PromQL).
NEEDS_EVENT = {
    "gpushare_extender_preempt_seconds_bucket": "kube-scheduler calls the extender's preempt verb only when "
    "lower-priority pods could make room: no pod here has a priority",
    "DCGM_FI_DEV_FB_USED": "the join with NVIDIA's dcgm-exporter needs its series, and the local stack runs no "
    "dcgm-exporter (tests/foundation/test_metrics_conventions.py checks the join's labels)",
}


def panels() -> list[tuple[str, str]]:
    """(panel title, PromQL) of every query in the shipped dashboard."""
    board = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in board["panels"] for t in p.get("targets", []) if t.get("expr")]


def quantity(text: str) -> float:
    """A Kubernetes quantity as the custom metrics API writes values (`300m`, `1`, `1500u`)."""
    m = re.fullmatch(r"(-?\d+(?:\.\d+)?)([numkMG]?)", text)
    assert m, f"not a quantity: {text!r}"
    scale = {"n": 1e-9, "u": 1e-6, "m": 1e-3, "": 1.0, "k": 1e3, "M": 1e6, "G": 1e9}[m.group(2)]
    return float(m.group(1)) * scale


def write_rules(stack: Any, first: str) -> None:
    """Put `first` before the demo's rules in the node agents' rules file (they read it again within a second)."""
    assert stack.config.usage.simulate.startswith("@")
    Path(stack.config.usage.simulate[1:]).write_text(f"{first}\n{DEMO_USAGE_RULES}")


@pytest.fixture(scope="module")
def prometheus(stack):
    """The stack's Prometheus, started before any workload (skip, or fail under CI, when it cannot run here)."""
    if stack.prometheus is None:
        system_tools.unavailable(f"Prometheus unavailable: {stack.monitoring_error}")
    return stack.prometheus


@pytest.fixture(scope="module")
def adapter(stack, prometheus):
    """The stack's prometheus-adapter, registered as custom.metrics.k8s.io."""
    if stack.adapter is None:
        system_tools.unavailable(f"prometheus-adapter unavailable: {stack.monitoring_error}")
    return stack.adapter


async def custom_metric(stack: Any, namespace: str, metric: str) -> dict[str, float]:
    """Pod name -> value of `metric` as kube-apiserver serves it (through the aggregation layer)."""
    cp = stack.control_plane
    url = f"{cp.server_url}/apis/custom.metrics.k8s.io/v1beta2/namespaces/{namespace}/pods/*/{metric}"
    async with httpx.AsyncClient(verify=False, headers={"Authorization": f"Bearer {cp.token}"}, timeout=10) as http:
        resp = await http.get(url)
    if resp.status_code != 200:
        return {}
    return {i["describedObject"]["name"]: quantity(i["value"]) for i in resp.json()["items"]}


async def running_pods(api: Any, namespace: str) -> dict[str, str]:
    """Pod name -> node of the namespace's Running pods that are not being deleted."""
    pods = (await client.CoreV1Api(api).list_namespaced_pod(namespace)).items
    return {
        p.metadata.name: p.spec.node_name
        for p in pods
        if p.status.phase == "Running" and p.metadata.deletion_timestamp is None
    }


AT_ONCE = {"stabilizationWindowSeconds": 0, "policies": [{"type": "Percent", "value": 100, "periodSeconds": 1}]}


def hpa_body(name: str, metric: str) -> dict[str, Any]:
    """2..4 replicas of Deployment `name` at 0.5 used/allocated GPU memory per pod, reacting at once both ways."""
    target = {"type": "AverageValue", "averageValue": "500m"}
    return {
        "apiVersion": "autoscaling/v2",
        "kind": "HorizontalPodAutoscaler",
        "metadata": {"name": name},
        "spec": {
            "scaleTargetRef": {"apiVersion": "apps/v1", "kind": "Deployment", "name": name},
            "minReplicas": 2,
            "maxReplicas": 4,
            "metrics": [{"type": "Pods", "pods": {"metric": {"name": metric}, "target": target}}],
            "behavior": {"scaleUp": AT_ONCE, "scaleDown": AT_ONCE},
        },
    }


def guide_hpa_body(name: str) -> dict[str, Any]:
    """The guide's HPA as shipped (k8s/hpa/guide-external-hpa.yaml: External aliyun_gpu_mem_usage, average 70),
    aimed at Deployment `name` with 2..4 replicas, reacting at once both ways."""
    body = yaml.safe_load(GUIDE_HPA.read_text())
    body["metadata"] = {"name": name}
    spec = body["spec"]
    spec["scaleTargetRef"]["name"] = name
    spec["metrics"][0]["external"]["metric"]["selector"]["matchLabels"]["workload"] = name
    spec.update(minReplicas=2, maxReplicas=4, behavior={"scaleUp": AT_ONCE, "scaleDown": AT_ONCE})
    return body


async def external_metric(stack: Any, namespace: str, metric: str, labels: dict[str, str]) -> dict[str, float]:
    """Pod name -> value of External `metric` for `labels` as kube-apiserver serves it (the aggregation layer)."""
    cp = stack.control_plane
    url = f"{cp.server_url}/apis/external.metrics.k8s.io/v1beta1/namespaces/{namespace}/{metric}"
    selector = ",".join(f"{k}={v}" for k, v in labels.items())
    async with httpx.AsyncClient(verify=False, headers={"Authorization": f"Bearer {cp.token}"}, timeout=10) as http:
        resp = await http.get(url, params={"labelSelector": selector})
    if resp.status_code != 200:
        return {}
    return {i["metricLabels"]["pod"]: quantity(i["value"]) for i in resp.json()["items"]}


PODS, EXTERNAL = "infer-pods", "infer-ext"  # one Deployment per HPA (neither name a prefix of the other)


async def test_hpas_scale_gpu_pods_on_the_pods_metric_and_on_the_guides_external_metric(
    stack, api, namespace, adapter
) -> None:
    """Two Deployments side by side under the same simulated usage: one scaled by an HPA on the Pods metric
    (k8s/hpa/example-hpa.yaml's), one by the gpushare guide's HPA on the External metric aliyun_gpu_mem_usage
    (k8s/hpa/guide-external-hpa.yaml, target average 70 %). Both hold 2 replicas at 0.3 of the share, go to 4
    at 0.9 and back to 2 at 0.2."""
    metric = hpa_metric()
    external, _ = external_hpa_metric()
    write_rules(stack, f"{namespace}/*=steady:0.3")
    apps, autoscaling = client.AppsV1Api(api), client.AutoscalingV2Api(api)
    for name in (PODS, EXTERNAL):
        body = deployment(name, replicas=2, gpu_mem=2, image="nvcr.io/nvidia/tritonserver:23.10-py3", command=["x"])
        await apps.create_namespaced_deployment(namespace, body)
    await autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, hpa_body(PODS, metric))
    await autoscaling.create_namespaced_horizontal_pod_autoscaler(namespace, guide_hpa_body(EXTERNAL))

    def pods_metric(value: float, pods: int) -> Any:
        return lambda: _all_near(_of(custom_metric(stack, namespace, metric), PODS), value, pods=pods)

    def external_metric_at(value: float, pods: int) -> Any:  # percent; selected by the Deployment's name
        return lambda: _all_near(external_metric(stack, namespace, external, {"workload": EXTERNAL}), value, pods=pods)

    try:
        # 0.3 of each 2 GiB share in use: both metrics reach the HPA controller through Prometheus and the adapter
        low = await eventually(pods_metric(0.3, 2), what="the Pods metric at 0.3", within=60)
        assert len(low) == 2
        low = await eventually(external_metric_at(30, 2), what="aliyun_gpu_mem_usage at 30 %", within=60)
        assert all(name.startswith(f"{EXTERNAL}-") for name in low), low
        await eventually(lambda: _hpa_wants(autoscaling, namespace, PODS, 2, 0.3), what="the Pods HPA to hold 2")
        await eventually(lambda: _hpa_wants(autoscaling, namespace, EXTERNAL, 2, 30), what="the guide's HPA to hold 2")

        write_rules(stack, f"{namespace}/*=steady:0.9")  # 0.9 > 0.5 and 90 % > 70 %: up to the maximum
        for name in (PODS, EXTERNAL):
            await eventually(lambda n=name: _replicas(apps, namespace, n, 4), what=f"{name} scaled to 4", within=90)
        placed = await eventually(lambda: _running(api, namespace, 8), what="8 replicas placed and running", within=60)
        allocs = await h.wait_ledger(stack.database_url, namespace, list(placed), timeout_s=30)
        assert {name: a["memory_mib"] for name, a in allocs.items()} == {name: 2048 for name in placed}
        assert {a["node"] for a in allocs.values()} <= set(stack.node_names)
        assert await h.ledger_disagreements(stack.database_url) == []
        high = await eventually(external_metric_at(90, 4), what="4 pods at 90 %", within=30)
        assert set(high) == {name for name in placed if name.startswith(f"{EXTERNAL}-")}

        write_rules(stack, f"{namespace}/*=steady:0.2")  # 4 x 0.2 / 0.5 -> 2; 4 x 20 / 70 -> 2
        for name in (PODS, EXTERNAL):
            await eventually(lambda n=name: _replicas(apps, namespace, n, 2), what=f"{name} back to 2", within=90)
        kept = await eventually(lambda: _running(api, namespace, 4, exact=True), what="4 replicas left", within=60)

        async def released() -> dict | None:
            live = await h.ledger_allocations(stack.database_url, namespace)
            return live if set(live) == set(kept) else None

        await eventually(released, what="the scaled-down replicas' shares released", within=30)
        assert await h.ledger_disagreements(stack.database_url) == []
    finally:
        for name in (PODS, EXTERNAL):
            await autoscaling.delete_namespaced_horizontal_pod_autoscaler(name, namespace)
            await apps.delete_namespaced_deployment(name, namespace)
        await h.delete_all_pods(api, namespace)


async def _of(values_now: Any, deployment_name: str) -> dict[str, float]:
    return {pod: v for pod, v in (await values_now).items() if pod.startswith(f"{deployment_name}-")}


async def _all_near(values_now: Any, value: float, *, pods: int) -> dict[str, float] | None:
    values = await values_now
    tolerance = 0.02 * max(1.0, value)  # 2 % of a ratio, or 2 points of a percent
    return values if len(values) == pods and all(abs(v - value) < tolerance for v in values.values()) else None


async def _hpa_wants(autoscaling: Any, namespace: str, name: str, replicas: int, value: float) -> bool:
    status = (await autoscaling.read_namespaced_horizontal_pod_autoscaler(name, namespace)).status
    metrics = status.current_metrics or []
    current = [
        quantity((m.pods or m.external).current.average_value) for m in metrics if (m.pods or m.external) is not None
    ]
    tolerance = 0.02 * max(1.0, value)
    return status.desired_replicas == replicas and len(current) == 1 and abs(current[0] - value) < tolerance


async def _replicas(apps: Any, namespace: str, name: str, replicas: int) -> bool:
    return (await apps.read_namespaced_deployment(name, namespace)).spec.replicas == replicas


async def _running(api: Any, namespace: str, count: int, *, exact: bool = False) -> dict[str, str] | None:
    pods = await running_pods(api, namespace)
    placed = {name: node for name, node in pods.items() if node}
    return placed if (len(placed) == count if exact else len(placed) >= count) else None


async def test_every_dashboard_panel_finds_data(stack, api, namespace, prometheus) -> None:
    """The demo workload with its simulated usage, a pod that cannot fit, a quota and one replaced pod: then each
    panel query of the shipped dashboard returns finite values from the services' real metrics."""
    try:
        await submit_demo(api)
    except ApiException as exc:  # the HPA test ran in this stack already: the demo may exist
        if exc.status != 409:
            raise
    await h.create_pod(api, namespace, h.gpu_pod("too-big", [20]))  # no 16 GiB GPU fits it: refused, pending
    assert (await h.set_quota(stack, ADMIN_TOKEN, namespace, 8)).status_code == 200
    demo = await eventually(lambda: _running(api, DEMO_NAMESPACE, 6), what="the demo running", within=90)

    async def training_over() -> bool:  # the first 40 s of a training container are over its share
        over = await asyncio.to_thread(prometheus.query, _panel("over their GPU memory"))
        return any(s["metric"]["pod"].startswith("bert-training-") and float(s["value"][1]) == 1 for s in over)

    await eventually(training_over, what="a training pod over its share (its spike)", within=60, interval=1.0)
    await h.delete_pod(api, DEMO_NAMESPACE, sorted(demo)[0])  # a release, and a replacement placed

    def missing(results: dict[str, list[dict[str, Any]]]) -> list[str]:
        out = []
        for title, expr in panels():
            values = [float(s["value"][1]) for s in results[expr]]
            needs = next((why for key, why in NEEDS_EVENT.items() if key in expr), None)
            if needs is None and (not values or not all(math.isfinite(v) for v in values)):
                out.append(f"{title}: {expr} -> {values}")
        return out

    last: list[str] = []

    async def all_panels() -> bool:
        nonlocal last
        results = {expr: await asyncio.to_thread(prometheus.query, expr) for _, expr in panels()}  # invalid: ValueError
        last = missing(results)
        return not last

    try:
        await eventually(all_panels, what="every dashboard panel to find data", within=90, interval=1.0)
    except TimeoutError:
        pytest.fail("dashboard panels without data:\n" + "\n".join(last))
    down = {name: health for name, health in prometheus.targets_up().items() if health != "up"}
    assert not down, down

    # accounting's dashboard (/ui) reads used next to allocated from /v1/cluster and /v1/nodes
    async with httpx.AsyncClient(base_url=stack.accounting_url, timeout=10) as http:
        cluster = (await http.get("/v1/cluster")).json()
    assert cluster["allocated_memory_mib"] >= 16 * 1024 and cluster["used_memory_mib"] > 0, cluster
    # the usage panels show the simulated usage: inference at 0.45 of its share
    ratio = _panel("used / allocated")
    by_pod = {s["metric"]["pod"]: float(s["value"][1]) for s in await asyncio.to_thread(prometheus.query, ratio)}
    inference = [v for pod, v in by_pod.items() if pod.startswith("resnet-inference-")]
    assert inference and all(abs(v - 0.45) < 0.01 for v in inference), by_pod
    # each pod's SM utilisation (simulated: its memory's part of the GPU, 0.9 of 16 GiB) and its workload named by
    # its Deployment (read from its ReplicaSet), in accounting's REST as in the node agents' gauge
    async with httpx.AsyncClient(base_url=stack.accounting_url, timeout=10) as http:
        pods = (await http.get("/v1/usage/pods", params={"namespace": DEMO_NAMESPACE})).json()["items"]
        sizing = (await http.get("/v1/rightsizing", params={"namespace": DEMO_NAMESPACE})).json()["items"]
    infer = [p for p in pods if p["pod_name"].startswith("resnet-inference-") and p["sm_utilization_pct"] is not None]
    assert infer and all(abs(p["sm_utilization_pct"] - 100 * 0.45 * 2 / 16) < 0.1 for p in infer), pods
    assert {(p["owner_kind"], p["owner_name"]) for p in infer} == {("Deployment", "resnet-inference")}
    assert {("Deployment", "bert-training"), ("Deployment", "resnet-inference")} <= {
        (i["owner_kind"], i["owner_name"]) for i in sizing
    }, sizing


def _panel(title_part: str) -> str:
    """The query of the dashboard panel whose title contains `title_part`."""
    return next(expr for title, expr in panels() if title_part in title)
