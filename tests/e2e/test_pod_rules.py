"""Today's pod rules on the real current release (kube-apiserver, kube-scheduler, kube-controller-manager 1.37)
with the whole gpushare stack: one node, one 16 GiB GPU.

- A GPU sidecar (an init container with `restartPolicy: Always`) holds its share beside the app container.
- A pod held by `schedulingGates` is neither reserved nor reported as refused until the gates go.
- A native `ResourceQuota` on `requests.aliyun.com/gpu-mem` refuses at admission (403); the ledger quota
  leaves the pod pending with a quota reason.
- The `gpushare-device-env` ValidatingAdmissionPolicy shipped in k8s/base refuses pods that set GPU
  visibility in their own environment, unless exempted (it stays in force until removed).
- The gpushare guide's Deployments as written (k8s/examples/gpushare-guide/), under the admission policies `gpushare
  up` applies: each placed, or refused with a message that says what to change.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
import uuid
from pathlib import Path
from typing import Any

import httpx
import pytest
import yaml
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from tests.e2e import helpers as h
from tests.e2e.conftest import ADMIN_TOKEN

pytestmark = pytest.mark.e2e

STACK_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"

POLICY_FILE = Path(__file__).resolve().parents[2] / "k8s" / "base" / "device-env-policy.yaml"
EXEMPT = "gpushare.io/allow-device-env"


def with_sidecar(pod: dict[str, Any], name: str, gib: int) -> dict[str, Any]:
    """The pod with a GPU sidecar: an init container with `restartPolicy: Always` limiting `gib` GiB."""
    sidecar = {
        "name": name,
        "image": "envoyproxy/envoy:v1.31",
        "restartPolicy": "Always",
        "resources": {"limits": {"aliyun.com/gpu-mem": str(gib)}},
    }
    pod["spec"]["initContainers"] = [*pod["spec"].get("initContainers", []), sidecar]
    return pod


async def test_a_gpu_sidecar_holds_its_share_beside_the_app(stack, api, namespace) -> None:
    node = stack.node_names[0]
    await h.create_pod(api, namespace, with_sidecar(h.gpu_pod("with-sidecar", [8]), "proxy", 4))
    await h.wait_bound(api, namespace, ["with-sidecar"])
    allocs = await h.wait_ledger(stack.database_url, namespace, ["with-sidecar"])
    (gpu,) = await h.gpu_rows(stack.database_url, node)
    # Kubernetes' rule (and kubelet's device count): sidecar + app = 12 GiB, not max(8, 4) = 8 GiB
    assert allocs["with-sidecar"]["memory_mib"] == gpu["allocated_memory_mib"] == 12 * 1024
    parts = {p["container"]: p for p in allocs["with-sidecar"]["parts"]}
    assert parts["proxy"]["init"] and parts["proxy"]["sidecar"] and not parts["c0"]["sidecar"]
    shown = (await h.accounting_pod(stack, namespace, "with-sidecar"))["allocation"]
    assert {p["container"]: p["sidecar"] for p in shown["parts"]} == {"proxy": True, "c0": False}

    # kubelet (the stand-in, as kubelet does) allocated devices for the sidecar too: each container got the GPU
    # from the node agent, with its own share and the pod's lasting total
    for container, gib in (("proxy", 4), ("c0", 8)):
        env = await h.container_env(stack, node, namespace, "with-sidecar", container)
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"], (container, env)
        assert env["ALIYUN_COM_GPU_MEM_CONTAINER"] == str(gib), (container, env)
        assert env["ALIYUN_COM_GPU_MEM_POD"] == "12", (container, env)
    standin = stack.kubelets[node].standin
    pod = {"metadata": {"namespace": namespace, "name": "with-sidecar"}}
    devices = [set(standin.assigned(pod, c, "aliyun.com/gpu-mem")) for c in ("proxy", "c0")]
    assert len(devices[0]) == 4 and len(devices[1]) == 8 and not devices[0] & devices[1]

    # 4 GiB are left: a pod needing 6 GiB stays pending with the reason (the old rule, charging the sidecar as an
    # init container, left 8 GiB and would have placed it on top of the sidecar's memory). kube-scheduler, counting
    # GPU memory per node by the same rule (the shipped configuration), refuses the node itself: the reason is its own
    await h.create_pod(api, namespace, h.gpu_pod("needs-six", [6]))
    assert await h.stays_pending(api, namespace, "needs-six", 6.0)

    view = await h.wait_pending_reason(stack, namespace, "needs-six")
    assert view["pending"]["source"] == "kube-scheduler", view
    assert "0/1 nodes are available: 1 Insufficient aliyun.com/gpu-mem" in view["pending"]["summary"], view
    # how long it has waited, from its own creationTimestamp (accounting's pod watch)
    created = (await client.CoreV1Api(api).read_namespaced_pod("needs-six", namespace)).metadata.creation_timestamp
    assert view["pending"]["created_at"] == created.isoformat() and view["pending"]["waiting_seconds"] >= 0, view
    assert (await h.scheduled_condition(api, namespace, "needs-six")).startswith("False:Unschedulable")
    assert "needs-six" not in await h.ledger_allocations(stack.database_url, namespace)


async def test_a_gated_pod_is_not_reserved_or_refused_until_its_gates_are_removed(stack, api, namespace) -> None:
    node = stack.node_names[0]
    body = h.gpu_pod("gated", [4])
    body["spec"]["schedulingGates"] = [{"name": "gpushare.io/e2e-hold"}]
    await h.create_pod(api, namespace, body)
    assert await h.stays_pending(api, namespace, "gated", 6.0)
    cond = await h.scheduled_condition(api, namespace, "gated")
    assert cond.startswith("False:SchedulingGated"), cond
    assert "gated" not in await h.ledger_allocations(stack.database_url, namespace)
    assert await h.accounting_pending(stack, namespace) == []
    view = await h.accounting_pod(stack, namespace, "gated")
    assert view is None or (view.get("pending") is None and view.get("last_refusal") is None), view

    patch = [{"op": "remove", "path": "/spec/schedulingGates"}]
    await client.CoreV1Api(api).patch_namespaced_pod(
        "gated", namespace, patch, _content_type="application/json-patch+json"
    )
    assert (await h.wait_bound(api, namespace, ["gated"]))["gated"] == node
    allocs = await h.wait_ledger(stack.database_url, namespace, ["gated"])
    assert allocs["gated"]["memory_mib"] == 4 * 1024
    env = await h.container_env(stack, node, namespace, "gated", "c0")
    assert env["NVIDIA_VISIBLE_DEVICES"] == allocs["gated"]["parts"][0]["gpu_uuid"]
    assert await h.accounting_pending(stack, namespace) == []


async def test_native_resource_quota_and_ledger_quota_each_refuse(stack, api, namespace) -> None:
    core = client.CoreV1Api(api)
    quota = {
        "apiVersion": "v1",
        "kind": "ResourceQuota",
        "metadata": {"name": "gpu-mem"},
        "spec": {"hard": {"requests.aliyun.com/gpu-mem": "10"}},
    }
    await core.create_namespaced_resource_quota(namespace, quota)

    async def counted() -> bool:  # admission refuses every pod until the quota controller filled the status
        status = (await core.read_namespaced_resource_quota("gpu-mem", namespace)).status
        return bool(status and status.hard and "requests.aliyun.com/gpu-mem" in status.hard)

    await h.poll(counted, 30, what="the ResourceQuota status")
    resp = await h.set_quota(stack, ADMIN_TOKEN, namespace, 6)
    assert resp.status_code in (200, 201, 204), resp.text

    await h.create_pod(api, namespace, h.gpu_pod("first", [4]))
    await h.wait_bound(api, namespace, ["first"])

    # native quota: 4 + 8 > 10 GiB, refused by kube-apiserver at admission; the pod never exists
    with pytest.raises(ApiException) as refused:
        await h.create_pod(api, namespace, h.gpu_pod("over-native", [8]))
    assert refused.value.status == 403, refused.value.body
    assert "exceeded quota: gpu-mem" in refused.value.body and "requests.aliyun.com/gpu-mem" in refused.value.body
    assert [p.metadata.name for p in (await core.list_namespaced_pod(namespace)).items] == ["first"]

    # within the native quota (4 + 4 <= 10) but over the ledger quota (4 + 4 > 6 GiB): created, left pending
    await h.create_pod(api, namespace, h.gpu_pod("over-ledger", [4]))
    assert await h.stays_pending(api, namespace, "over-ledger", 5.0)

    view = await h.wait_pending_reason(stack, namespace, "over-ledger")
    assert "quota" in view["pending"]["summary"].lower(), view
    # the native quota counts the pending pod already; the ledger only what is placed
    used = (await core.read_namespaced_resource_quota("gpu-mem", namespace)).status.used
    assert used["requests.aliyun.com/gpu-mem"] == "8", used

    # accounting's /v1/quotas shows both, side by side: the ledger quota and the ResourceQuota as the cluster counts it
    async def both() -> dict | None:
        async with httpx.AsyncClient(timeout=5) as http:
            body = (await http.get(f"{stack.accounting_url}/v1/quotas")).json()
        native = [q for q in body["resource_quotas"] if q["namespace"] == namespace]
        return body if native and native[0]["used"] == 8 else None

    body = await h.poll(both, 30, what="/v1/quotas to show the namespace's ResourceQuota usage")
    assert body["resource_quotas_unavailable"] is None and body["memory_unit"] == "GiB"
    assert [q for q in body["resource_quotas"] if q["namespace"] == namespace] == [
        {
            "namespace": namespace,
            "name": "gpu-mem",
            "key": "requests.aliyun.com/gpu-mem",
            "resource": "aliyun.com/gpu-mem",
            "hard": 10,
            "used": 8,
        }
    ]
    (ledger,) = [q for q in body["items"] if q["namespace"] == namespace]
    assert (ledger["memory_mib"], ledger["allocated_memory_mib"]) == (6 * 1024, 4 * 1024)


def _hostile(name: str, *, init: bool = False, value: str = "all", var: str = "NVIDIA_VISIBLE_DEVICES") -> dict:
    pod = h.gpu_pod(name, [])
    container = {"name": "grab", "image": "busybox", "command": ["sleep", "1"], "env": [{"name": var, "value": value}]}
    pod["spec"]["initContainers" if init else "containers"] = [container]
    if init:
        pod["spec"]["containers"] = [{"name": "main", "image": "busybox", "command": ["sleep", "infinity"]}]
    return pod


async def _refusal(api, namespace: str, body: dict) -> str | None:
    """The refusal message when the apiserver refuses `body`; None when it admits it (then deleted again)."""
    try:
        await h.create_pod(api, namespace, body)
    except ApiException as exc:
        assert exc.status == 403, exc.body
        return str(json.loads(exc.body)["message"])
    await h.delete_pod(api, namespace, body["metadata"]["name"])
    return None


async def test_device_env_admission_policy_refuses_hostile_pods_and_admits_the_rest(stack, api, namespace) -> None:
    """The pod policy shipped in k8s/base, applied to the real current apiserver (its ValidatingAdmissionPolicy
    admission plugin is on by default since 1.30); removed again afterwards."""
    admission = client.AdmissionregistrationV1Api(api)
    policy, binding = list(yaml.safe_load_all(POLICY_FILE.read_text()))[:2]  # the pods' (then the workloads')
    await admission.create_validating_admission_policy(policy)
    await admission.create_validating_admission_policy_binding(binding)
    allowed_ns = f"{namespace[:40]}-allowed"
    try:
        # enforcement is eventually consistent (the apiserver compiles the policy from its informer): probe with
        # fresh names until the first refusal, within a bound
        deadline = time.monotonic() + 60
        while True:
            message = await _refusal(api, namespace, _hostile(f"probe-{uuid.uuid4().hex[:6]}"))
            if message is not None or time.monotonic() > deadline:
                break
            await asyncio.sleep(0.5)
        assert message is not None, "the policy was never enforced"
        assert "ValidatingAdmissionPolicy 'gpushare-device-env'" in message
        assert "grab: NVIDIA_VISIBLE_DEVICES=all" in message
        assert 'pod label gpushare.io/allow-device-env: "true"' in message
        assert "labelling its namespace gpushare.io/allow-device-env=true" in message

        # the other variables, in an init container too
        message = await _refusal(api, namespace, _hostile("cuda", var="CUDA_VISIBLE_DEVICES", value="0"))
        assert message and "grab: CUDA_VISIBLE_DEVICES=0" in message
        message = await _refusal(api, namespace, _hostile("caps", init=True, var="NVIDIA_DRIVER_CAPABILITIES"))
        assert message and "grab: NVIDIA_DRIVER_CAPABILITIES=all" in message
        utility = _hostile("caps-ok", var="NVIDIA_DRIVER_CAPABILITIES", value="compute,utility")
        assert await _refusal(api, namespace, utility) is None

        # an ordinary GPU pod is admitted and gets its GPU from the node agent
        node = stack.node_names[0]
        await h.create_pod(api, namespace, h.gpu_pod("ordinary", [2]))
        await h.wait_bound(api, namespace, ["ordinary"])
        allocs = await h.wait_ledger(stack.database_url, namespace, ["ordinary"])
        env = await h.container_env(stack, node, namespace, "ordinary", "c0")
        assert env["NVIDIA_VISIBLE_DEVICES"] == allocs["ordinary"]["parts"][0]["gpu_uuid"]

        # exemptions: the pod label, or an allow-listed namespace
        exempted = _hostile("exempted")
        exempted["metadata"]["labels"][EXEMPT] = "true"
        await h.create_pod(api, namespace, exempted)
        await client.CoreV1Api(api).create_namespace(
            {"apiVersion": "v1", "kind": "Namespace", "metadata": {"name": allowed_ns, "labels": {EXEMPT: "true"}}}
        )
        await h.create_pod(api, allowed_ns, _hostile("monitoring-agent"))
    finally:
        await admission.delete_validating_admission_policy_binding(binding["metadata"]["name"])
        await admission.delete_validating_admission_policy(policy["metadata"]["name"])
        try:
            await h.delete_all_pods(api, allowed_ns)
            await client.CoreV1Api(api).delete_namespace(allowed_ns)
        except ApiException as exc:
            if exc.status != 404:
                raise


# ---------------------------------------------------------------------------------------------------------------
# The gpushare guide's examples as written (k8s/examples/gpushare-guide/), with the admission policies `gpushare
# up` applies (devstack.stack.admission, from k8s/base): each is placed, or refused saying what to change.

GUIDE = Path(__file__).resolve().parents[2] / "k8s" / "examples" / "gpushare-guide"


def guide_example(name: str) -> dict[str, Any]:
    return yaml.safe_load((GUIDE / f"{name}.yaml").read_text())


async def _refused(apps: client.AppsV1Api, namespace: str, body: dict[str, Any]) -> tuple[int, str]:
    with pytest.raises(ApiException) as refused:
        await apps.create_namespaced_deployment(namespace, body)
    return refused.value.status, str(json.loads(refused.value.body)["message"])


async def test_the_guides_deployments_are_placed_or_refused_saying_what_to_change(stack, api, namespace) -> None:
    from devstack.stack.admission import apply_policies, policy_objects, wait_enforced

    apps, core = client.AppsV1Api(api), client.CoreV1Api(api)
    node = stack.node_names[0]
    # the guide labels its GPU nodes gpushare=true (the stack's nodes carry it); the node agent adds gpu-type
    await h.poll(
        lambda: _labelled(core, node, {"gpushare": "true", "gpu-type": "t4"}), 30, what="the guide's node labels"
    )
    names = await apply_policies(api, stack.control_plane.release.minor)
    assert names == ["gpushare-device-env", "gpushare-device-env-workloads", "gpushare-annotations"]
    try:
        assert await wait_enforced(api, namespace)

        # BERT as written: NVIDIA_VISIBLE_DEVICES=all. Refused when the Deployment is applied, naming the variable
        bert = guide_example("bert-training")
        status, message = await _refused(apps, namespace, bert)
        assert status == 403, message
        assert "ValidatingAdmissionPolicy 'gpushare-device-env-workloads'" in message
        assert "gpushare refused this Deployment: its pod template sets GPU visibility" in message
        assert "(bert: NVIDIA_VISIBLE_DEVICES=all)" in message and "remove these variables" in message
        # ... and with it removed (what the message says), placed by the guide's nodeSelector and toleration
        del bert["spec"]["template"]["spec"]["containers"][0]["env"]
        await apps.create_namespaced_deployment(namespace, bert)

        # ResNet as written: `gpu-core: 30%` is not a Kubernetes quantity; kube-apiserver refuses it before any
        # admission (its message, quoted in the example and the migration guide, which say to write 30)
        resnet = guide_example("resnet-inference")
        status, message = await _refused(apps, namespace, resnet)
        assert status == 400 and "quantities must match the regular expression" in message, message
        resnet["spec"]["template"]["spec"]["containers"][0]["resources"]["limits"]["aliyun.com/gpu-core"] = 30
        await apps.create_namespaced_deployment(namespace, resnet)

        # the 0.5 GB development pod: extended resources are whole numbers (the migration guide: the MiB unit, 512)
        status, message = await _refused(apps, namespace, guide_example("dev-notebook"))
        assert status == 422 and 'aliyun.com/gpu-mem]: Invalid value: "500m": must be an integer' in message

        placed = await h.poll(lambda: _running_on(core, namespace, 3), 60, what="BERT and two ResNet pods placed")
        assert set(placed.values()) == {node}
        allocs = await h.wait_ledger(stack.database_url, namespace, list(placed))
        assert sorted(a["memory_mib"] for a in allocs.values()) == [4096, 4096, 8192]
        shown = [(await h.accounting_pod(stack, namespace, name))["allocation"] for name in sorted(placed)]
        assert sorted(a["compute"] for a in shown) == [0, 30, 30]  # gpu-core 30: 30 % of the GPU each
        (gpu,) = await h.gpu_rows(stack.database_url, node)
        bert_pod = next(p for p in placed if p.startswith("bert-training-"))
        env = await h.container_env(stack, node, namespace, bert_pod, "bert")
        assert env["NVIDIA_VISIBLE_DEVICES"] == gpu["uuid"]  # the one GPU it was given, not `all`
        # each one's scheduling wait, creation to Binding, in accounting's histogram (by namespace and outcome)
        counted = f'gpushare_scheduling_wait_seconds_count{{namespace="{namespace}",outcome="bound"}} 3.0'
        await h.poll(lambda: _metrics_say(stack, counted), 30, what="the three scheduling waits observed")

        # a nodeSelector that no node matches (a hand-set label the node agent spells otherwise) waits with
        # kube-scheduler's own reason
        other = guide_example("bert-training")
        del other["spec"]["template"]["spec"]["containers"][0]["env"]
        other["metadata"]["name"] = other["spec"]["template"]["metadata"]["labels"]["app"] = "bert-a100"
        other["spec"]["selector"]["matchLabels"]["app"] = "bert-a100"
        other["spec"]["template"]["spec"]["nodeSelector"]["gpu-type"] = "A100"
        await apps.create_namespaced_deployment(namespace, other)
        waiting = await h.poll(lambda: _pod_named(core, namespace, "bert-a100-"), 30, what="the A100 pod")
        cond = await h.poll(
            lambda: _unschedulable(core, namespace, waiting), 30, what="kube-scheduler's reason for the A100 pod"
        )
        assert "didn't match Pod's node affinity/selector" in cond, cond
    finally:
        for dep in ("bert-training", "resnet-inference", "bert-a100"):
            with contextlib.suppress(ApiException):
                await apps.delete_namespaced_deployment(dep, namespace)
        admission = client.AdmissionregistrationV1Api(api)
        for obj in policy_objects():
            delete = (
                admission.delete_validating_admission_policy
                if obj["kind"] == "ValidatingAdmissionPolicy"
                else admission.delete_validating_admission_policy_binding
            )
            await delete(obj["metadata"]["name"])
        await h.delete_all_pods(api, namespace)


async def _labelled(core: client.CoreV1Api, node: str, labels: dict[str, str]) -> bool:
    have = (await core.read_node(node)).metadata.labels or {}
    return all(have.get(k) == v for k, v in labels.items())


async def _running_on(core: client.CoreV1Api, namespace: str, count: int) -> dict[str, str] | None:
    pods = (await core.list_namespaced_pod(namespace)).items
    placed = {p.metadata.name: p.spec.node_name for p in pods if p.spec.node_name and p.status.phase == "Running"}
    return placed if len(placed) >= count else None


async def _pod_named(core: client.CoreV1Api, namespace: str, prefix: str) -> str | None:
    pods = (await core.list_namespaced_pod(namespace)).items
    return next((p.metadata.name for p in pods if p.metadata.name.startswith(prefix)), None)


async def _unschedulable(core: client.CoreV1Api, namespace: str, name: str) -> str | None:
    pod = await core.read_namespaced_pod(name, namespace)
    for cond in pod.status.conditions or []:
        if cond.type == "PodScheduled" and cond.status == "False" and cond.message:
            return cond.message
    return None


async def _metrics_say(stack: Any, line: str) -> bool:
    async with httpx.AsyncClient(timeout=5) as http:
        return line in (await http.get(f"{stack.accounting_url}/metrics")).text.splitlines()


async def test_replica_sets_are_named_by_the_owner_the_api_server_shows(stack, api, namespace) -> None:
    """Accounting's workload names come from the ReplicaSet's ownerReferences where the API server has it: a
    ReplicaSet made by hand keeps its name even when it looks like a Deployment's, and a gone one falls back to the
    name's shape."""
    from services.accounting.owners import WorkloadNames

    apps = client.AppsV1Api(api)
    labels = {"app": "web"}
    template = {"metadata": {"labels": labels}, "spec": {"containers": [{"name": "c", "image": "x"}]}}
    spec = {"replicas": 0, "selector": {"matchLabels": labels}, "template": template}
    await apps.create_namespaced_deployment(namespace, {"metadata": {"name": "web"}, "spec": spec})
    orphan = {"metadata": {"name": "cache-5c9d7f6b8"}, "spec": {**spec, "selector": {"matchLabels": {"app": "x"}}}}
    orphan["spec"]["template"] = {**template, "metadata": {"labels": {"app": "x"}}}
    await apps.create_namespaced_replica_set(namespace, orphan)

    async def web_replica_set() -> str | None:
        items = (await apps.list_namespaced_replica_set(namespace, label_selector="app=web")).items
        return items[0].metadata.name if items else None

    rs = await h.poll(web_replica_set, 30, what="the Deployment's ReplicaSet")
    names = WorkloadNames(stack.services_kubeconfig)
    try:
        keys = {(namespace, "ReplicaSet", rs), (namespace, "ReplicaSet", "cache-5c9d7f6b8")}
        keys.add((namespace, "ReplicaSet", "gone-6c9f7d8b4"))
        assert await names.resolve(keys) == {
            (namespace, "ReplicaSet", rs): ("Deployment", "web"),  # read from its ownerReferences
            (namespace, "ReplicaSet", "gone-6c9f7d8b4"): ("Deployment", "gone"),  # not found: from its name
        }  # the hand-made one shaped like a Deployment's keeps its own name
    finally:
        await names.close()
        await apps.delete_namespaced_deployment("web", namespace)
        await apps.delete_namespaced_replica_set("cache-5c9d7f6b8", namespace)
