"""gpushare admission end to end: unchanged `aliyun.com/*` workloads in a namespace labelled gpushare.io/allocator=dra
are rewritten by the webhook (the extender's HTTPS `--webhook-port`, registered by the stack exactly as
`shared.dra.webhook` writes it) into DRA claims, which the real v1.37.2 kube-apiserver validates, the resourceclaim
controller turns into claims (each counted against the namespace's GPU quota by the claim webhook), kube-scheduler
allocates from the node's ResourceSlice, the binder records in the ledger, and the kubelet stand-in prepares once
the ledger holds the claim. One device-plugin node beside the DRA node shows that a
namespace that did not opt in is left alone (the extender places it).

Nodes: each has a Tesla-T4 (index 0) and an A100 (index 1) of 16 GiB.
"""

from __future__ import annotations

import base64
import json
import ssl
from typing import Any

import httpx
import pytest
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from devstack.cluster.waits import poll
from devstack.stack.demo import demo_deployments
from shared.annotations import ALLOCATION, parse_allocation
from shared.dra.admission import DEMAND_ANNOTATION, MANAGED_BY, MANAGED_BY_LABEL, OPT_IN_LABEL, OPT_IN_VALUE
from shared.dra.slices import device_name
from shared.kube.raw import read_json
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.e2e.conftest import ADMIN_TOKEN

pytestmark = needs_dra

STACK_NODES = 2
STACK_DRA_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4,1x16GiB:A100-SXM4"
STACK_USAGE_RULES = "*=steady:0.5\n"  # every container uses half its share (simulated processes in its cgroup)


@pytest.fixture
async def dra_namespace(api, namespace):  # type: ignore[no-untyped-def]
    """The test's namespace, opted in to DRA; its Deployments go first when the test ends."""
    await client.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}})
    yield namespace
    await client.AppsV1Api(api).delete_collection_namespaced_deployment(namespace)


def _pod(name: str, containers: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {"name": name, "labels": {"e2e": "admission"}, **extra},
        "spec": {"terminationGracePeriodSeconds": 0, "containers": containers},
    }


def _c(name: str, **limits: str) -> dict[str, Any]:
    return {
        "name": name,
        "image": "nvcr.io/nvidia/cuda:12.2.0-base-ubuntu22.04",
        "resources": {"limits": {f"aliyun.com/gpu-{k}": v for k, v in limits.items()}},
    }


async def _templates(api, namespace: str) -> list[dict[str, Any]]:  # type: ignore[no-untyped-def]
    body = await read_json(
        await client.ResourceV1Api(api).list_namespaced_resource_claim_template(namespace, _preload_content=False)
    )
    return list(body.get("items") or [])


async def _parts(api, namespace: str, pod: str) -> dict[str, list[tuple[int, int, int]]]:  # type: ignore[no-untyped-def]
    """container -> [(GPU index, MiB, compute)] from the pod's allocation record (once written)."""
    raw = await w.annotated_pod(api, namespace, pod)
    _, _, parts = parse_allocation(raw["metadata"]["annotations"][ALLOCATION])
    out: dict[str, list[tuple[int, int, int]]] = {}
    for p in parts:
        out.setdefault(p.container, []).append((p.gpu_index, p.memory_mib, p.compute))
    return out


def _aliyun_left(pod: dict[str, Any]) -> list[str]:
    spec = pod["spec"]
    return [
        k
        for c in (*spec.get("containers", []), *spec.get("initContainers", []))
        for section in ("limits", "requests")
        for k in ((c.get("resources") or {}).get(section) or {})
        if k.startswith("aliyun.com/")
    ]


async def test_the_readme_demo_deployment_is_admitted_and_packed_on_dra_nodes(stack, api, dra_namespace) -> None:  # type: ignore[no-untyped-def]
    dra_node = stack.dra_node_names[0]
    apps = client.AppsV1Api(api)
    deployments = demo_deployments()  # the README's manifests, unchanged
    for dep in deployments:
        await apps.create_namespaced_deployment(dra_namespace, dep)
    want = sum(d["spec"]["replicas"] for d in deployments)
    core = client.CoreV1Api(api)

    async def all_bound() -> list[Any] | None:
        found = (await core.list_namespaced_pod(dra_namespace, label_selector="gpushare.io/demo=true")).items
        return found if len(found) == want and all(p.spec.node_name for p in found) else None

    bound = await poll(all_bound, 120, interval=0.5, what="the demo's pods to be bound")
    await w.wait_recorded(api, dra_namespace, [p.metadata.name for p in bound])
    assert {p.spec.node_name for p in bound} == {dra_node}
    templates = {t["metadata"]["name"]: t for t in await _templates(api, dra_namespace)}
    assert len(templates) == 2  # one per Deployment: every replica asks the same, so names the same template
    for t in templates.values():
        assert t["metadata"]["labels"][MANAGED_BY_LABEL] == MANAGED_BY
    allocations = await w.claim_allocations(stack.database_url, dra_namespace)
    by_app: dict[str, list[int]] = {}
    for p in bound:
        raw = await w.raw_pod(api, dra_namespace, p.metadata.name)
        assert _aliyun_left(raw) == []
        (entry,) = raw["spec"]["resourceClaims"]
        assert entry["resourceClaimTemplateName"] in templates
        demand = json.loads(raw["metadata"]["annotations"][DEMAND_ANNOTATION])
        assert demand["template"] == entry["resourceClaimTemplateName"]
        row = allocations[p.metadata.name]
        assert row["claim_uid"] and row["node"] == dra_node
        by_app.setdefault(p.metadata.labels["app"], []).append(row["memory_mib"])
    assert by_app == {"bert-training": [4096, 4096], "resnet-inference": [2048] * 4}
    assert await w.ledger_exact(stack.database_url) == []
    # accounting and inspect show the DRA shares as they show extender shares
    one = bound[0].metadata.name
    view = await helpers.accounting_pod(stack, dra_namespace, one)
    assert view is not None and view["allocation"]["node"] == dra_node
    assert view["allocation"]["memory_mib"] == allocations[one]["memory_mib"]
    assert view["allocation"]["owner_kind"] == "ReplicaSet"  # the owner, as for any extender share
    detail = helpers.detail_sections(await helpers.inspect(stack, "-d"))
    assert {pod: gib for pod, gib in detail[dra_node].items() if pod in allocations} == {
        name: row["memory_mib"] // 1024 for name, row in allocations.items()
    }
    # usage: the node agent attributes each container's processes (found through their cgroups) to its DRA share
    containers = {p.metadata.name: p.spec.containers[0].name for p in bound}

    async def sampled() -> dict[str, tuple[str, int]] | None:
        rows = await w.ledger_rows(
            stack.database_url,
            "SELECT pod_name, container, max(used_memory_mib) AS used FROM usage_samples WHERE namespace = $1"
            " GROUP BY pod_name, container",
            dra_namespace,
        )
        found = {r["pod_name"]: (r["container"], r["used"]) for r in rows}
        return found if set(found) == set(containers) else None

    samples = await poll(sampled, 60, interval=1.0, what="usage samples of every demo pod")
    assert {pod: c for pod, (c, _) in samples.items()} == containers
    assert {pod: used for pod, (_, used) in samples.items()} == {
        name: row["memory_mib"] // 2 for name, row in allocations.items()
    }
    async with httpx.AsyncClient(base_url=stack.accounting_url, timeout=10) as http:
        sizing = (await http.get("/v1/rightsizing", params={"namespace": dra_namespace})).json()["items"]
    # named by their Deployments (the ReplicaSets' owners), as for extender shares
    assert {(s["owner_name"], s["allocated_mib"], s["peak_used_mib"]) for s in sizing} == {
        ("bert-training", 4096, 2048),
        ("resnet-inference", 2048, 1024),
    }


async def test_a_two_container_pod_a_sidecar_pod_and_a_count_two_pod_through_the_webhook(
    stack, api, dra_namespace
) -> None:  # type: ignore[no-untyped-def]
    node = stack.dra_node_names[0]
    side = _pod("side", [_c("main", mem="2")])
    side["spec"]["initContainers"] = [_c("setup", mem="1"), {**_c("proxy", mem="1"), "restartPolicy": "Always"}]
    for pod in (
        _pod("duo", [_c("a", mem="4"), _c("b", mem="2", core="20")]),
        side,
        _pod("pair", [_c("main", mem="8", count="2")]),
    ):
        await helpers.create_pod(api, dra_namespace, pod)
    await helpers.wait_bound(api, dra_namespace, ["duo", "side", "pair"], timeout_s=90)
    await w.wait_recorded(api, dra_namespace, ["duo", "side", "pair"])

    duo = await _parts(api, dra_namespace, "duo")
    assert {c: [(m, k) for _, m, k in v] for c, v in duo.items()} == {"a": [(4096, 0)], "b": [(2048, 20)]}
    env_b = await helpers.container_env(stack, node, dra_namespace, "duo", "b")
    assert env_b["ALIYUN_COM_GPU_MEM_CONTAINER"] == "2" and env_b["ALIYUN_COM_GPU_MEM_POD"] == "6"

    # the regular init container uses the app container's share (Kubernetes reuses init resources); the sidecar runs
    # beside the app and holds its own: 2 + 1 GiB, as kube-scheduler's effective request counts it
    claim = await w.pod_claim(api, dra_namespace, "side")
    assert sorted(r["name"] for r in claim["spec"]["devices"]["requests"]) == ["main", "proxy"]
    allocations = await w.claim_allocations(stack.database_url, dra_namespace)
    assert allocations["side"]["memory_mib"] == 3072
    setup_env = await helpers.container_env(stack, node, dra_namespace, "side", "setup")
    main_env = await helpers.container_env(stack, node, dra_namespace, "side", "main")
    assert setup_env["NVIDIA_VISIBLE_DEVICES"] == main_env["NVIDIA_VISIBLE_DEVICES"]
    assert setup_env["GPUSHARE_GPU_MEMORY_MIB"] == "2048"

    pair = await _parts(api, dra_namespace, "pair")
    assert sorted((g, m) for g, m, _ in pair["main"]) == [(0, 4096), (1, 4096)]  # gpu-count 2: two distinct GPUs
    env = await helpers.container_env(stack, node, dra_namespace, "pair", "main")
    assert env["ALIYUN_COM_GPU_MEM_IDX"] == "0,1"
    assert await w.ledger_exact(stack.database_url) == []


async def test_steering_annotations_become_selectors_that_steer(stack, api, dra_namespace) -> None:  # type: ignore[no-untyped-def]
    node = stack.dra_node_names[0]
    t4, a100 = (r["uuid"] for r in await helpers.gpu_rows(stack.database_url, node))
    cases = {
        "on-a100": ({"gpushare.io/gpu-model-include": "a100"}, a100),
        "not-t4": ({"gpushare.io/gpu-model-exclude": "T4"}, a100),
        "by-uuid": ({"gpushare.io/gpu-uuid-include": t4}, t4),
        "not-by-uuid": ({"gpushare.io/gpu-uuid-exclude": t4}, a100),
        "cuda-12": ({"gpushare.io/min-cuda-version": "12.0"}, None),  # the fake GPUs report CUDA 12.4
    }
    for name, (hints, _) in cases.items():
        await helpers.create_pod(api, dra_namespace, _pod(name, [_c("main", mem="1")], annotations=hints))
    await helpers.create_pod(
        api, dra_namespace, _pod("cuda-99", [_c("main", mem="1")], annotations={"gpushare.io/min-cuda-version": "99"})
    )
    await helpers.wait_bound(api, dra_namespace, list(cases), timeout_s=90)
    for name, (_, gpu) in cases.items():
        claim = await w.pod_claim(api, dra_namespace, name)
        (result,) = w.consumed(claim)
        if gpu is not None:
            assert result[1] == device_name(gpu), f"{name} got {result[1]}"
    # no GPU has CUDA 99: kube-scheduler finds no device for the claim, nothing is recorded
    assert await helpers.stays_pending(api, dra_namespace, "cuda-99", 6)
    events = await w.events_of(api, dra_namespace, "cuda-99")
    assert any(e.startswith("FailedScheduling") and "claim" in e for e in events), events
    assert "cuda-99" not in await w.claim_allocations(stack.database_url, dra_namespace)
    # and accounting says why, as it does for the extender's refusals
    view = await helpers.wait_pending_reason(stack, dra_namespace, "cuda-99")
    assert view["pending"]["summary"].startswith("kube-scheduler (DRA): ") and "claim" in view["pending"]["summary"]


async def test_a_claim_over_the_quota_is_refused_at_creation_and_the_pod_says_why_until_the_quota_allows(
    stack, api, dra_namespace
) -> None:  # type: ignore[no-untyped-def]
    """The resourceclaim controller's claim for the rewritten pod is counted at creation (the claim webhook) against
    the namespace's 2 GiB quota and refused: the pod's events and /v1/pending say which quota, what is held and what
    is left. Raised, the controller's next try passes and the pod binds."""
    assert (await helpers.set_quota(stack, ADMIN_TOKEN, dra_namespace, 2)).status_code == 200
    await w.wait_quota_enforced(api, dra_namespace)
    await helpers.create_pod(api, dra_namespace, _pod("over-quota", [_c("main", mem="4")]))
    view = await helpers.wait_pending_reason(stack, dra_namespace, "over-quota", timeout_s=60)
    summary = view["pending"]["summary"]
    assert summary.startswith("gpushare admission: "), view["pending"]
    assert "GPU memory quota is 2 GiB" in summary and "0 GiB held" in summary and "2 GiB left" in summary, summary
    assert "asks 4 GiB" in summary, summary
    events = " ".join(await w.events_of(api, dra_namespace, "over-quota"))
    assert "FailedResourceClaimCreation" in events and "claims.gpu.gpushare.io" in events, events
    assert await w.pod_claim(api, dra_namespace, "over-quota") is None  # no claim was created
    assert "over-quota" not in await w.claim_allocations(stack.database_url, dra_namespace)
    assert (await helpers.set_quota(stack, ADMIN_TOKEN, dra_namespace, 8)).status_code == 200
    await helpers.wait_bound(api, dra_namespace, ["over-quota"], timeout_s=120)
    await poll(
        lambda: _no_pending(stack, dra_namespace), timeout_s=30, what="the pod gone from /v1/pending once recorded"
    )


async def _no_pending(stack, namespace: str) -> bool:  # type: ignore[no-untyped-def]
    return [p["pod_name"] for p in await helpers.accounting_pending(stack, namespace)] == []


async def test_bad_input_is_refused_clearly_and_nothing_is_created(stack, api, dra_namespace) -> None:  # type: ignore[no-untyped-def]
    ca = stack._webhook_tls.ca  # the stack's webhook CA (kube-apiserver trusts it through caBundle)
    review = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview"}
    request = {
        "uid": "e2e-1",
        "operation": "CREATE",
        "namespace": dra_namespace,
        "resource": {"group": "", "version": "v1", "resource": "pods"},
    }
    async with httpx.AsyncClient(verify=ssl.create_default_context(cafile=str(ca)), timeout=10) as http:
        malformed = {**review, "request": {**request, "object": {"metadata": {}, "spec": {"containers": "gpu"}}}}
        answer = await http.post(stack.webhook_url, json=malformed)
        assert answer.status_code == 200
        response = answer.json()["response"]
        assert response["uid"] == "e2e-1" and response["allowed"] is False
        assert "spec.containers must be a list" in response["status"]["message"]
        old = await http.post(
            stack.webhook_url, json={**review, "apiVersion": "admission.k8s.io/v1beta1", "request": request}
        )
        assert old.status_code == 400 and "admissionReviewVersions: [v1]" in old.json()["error"]
        garbage = await http.post(stack.webhook_url, content=b"{nope", headers={"content-type": "application/json"})
        assert garbage.status_code == 400 and "not JSON" in garbage.json()["error"]
    # a shape DRA cannot express, through the API server: refused with what to write instead
    with pytest.raises(ApiException) as refused:
        await helpers.create_pod(api, dra_namespace, _pod("core-only", [_c("main", core="30")]))
    assert refused.value.status == 422
    message = json.loads(refused.value.body)["message"]
    assert 'admission webhook "pods.gpu.gpushare.io" denied the request' in message
    assert "Write aliyun.com/gpu-mem as well" in message
    assert await _templates(api, dra_namespace) == []
    assert (await client.CoreV1Api(api).list_namespaced_pod(dra_namespace)).items == []
    log = (stack.log_dir / "extender.log").read_text()
    assert "refused a malformed admission review" in log and "refused a pod in namespace " + dra_namespace in log


async def test_a_dry_run_is_rewritten_but_creates_no_template(stack, api, dra_namespace) -> None:  # type: ignore[no-untyped-def]
    body = await read_json(
        await client.CoreV1Api(api).create_namespaced_pod(
            dra_namespace, _pod("dry", [_c("main", mem="4")]), dry_run="All", _preload_content=False
        )
    )
    assert body["spec"]["resourceClaims"][0]["resourceClaimTemplateName"].startswith("gpushare-")
    assert body["spec"]["containers"][0]["resources"]["claims"] == [{"name": "gpushare", "request": "main"}]
    assert await _templates(api, dra_namespace) == []
    assert (await client.CoreV1Api(api).list_namespaced_pod(dra_namespace)).items == []


async def test_a_namespace_not_opted_in_is_untouched(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    await helpers.create_pod(api, namespace, helpers.gpu_pod("plain", [4]))
    raw = await w.raw_pod(api, namespace, "plain")
    # as written (kube-apiserver copies the limit into requests, as for any extended resource)
    assert set(_aliyun_left(raw)) == {"aliyun.com/gpu-mem"} and not raw["spec"].get("resourceClaims")
    assert DEMAND_ANNOTATION not in (raw["metadata"].get("annotations") or {})
    nodes = await helpers.wait_bound(api, namespace, ["plain"])
    assert nodes["plain"] not in stack.dra_node_names  # the extender placed it on the device-plugin node
    assert await _templates(api, namespace) == []


async def test_the_registered_webhook_is_the_shipped_configuration(stack, api) -> None:  # type: ignore[no-untyped-def]
    from shared.dra.webhook import CONFIGURATION_NAME, webhook_configuration

    stored = await read_json(
        await client.AdmissionregistrationV1Api(api).read_mutating_webhook_configuration(
            CONFIGURATION_NAME, _preload_content=False
        )
    )
    (hook,) = stored["webhooks"]
    (want,) = webhook_configuration({"url": stack.webhook_url, "caBundle": stack._webhook_tls.ca_bundle()})["webhooks"]
    assert {k: hook.get(k) for k in want} == want  # kube-apiserver kept every field as written
    assert base64.b64decode(hook["clientConfig"]["caBundle"]) == stack._webhook_tls.ca.read_bytes()


async def test_inspect_without_accounting_reads_dra_nodes_from_their_slices(stack, api, dra_namespace) -> None:  # type: ignore[no-untyped-def]
    """`kubectl inspect gpushare` when accounting cannot be reached: the API server alone (nodes, pods, and the
    gpushare ResourceSlices listed with field selectors spec.driver / spec.nodeName)."""
    from services.accounting.inspect_source import Request, from_apiserver
    from shared.settings import MemoryUnit

    node = stack.dra_node_names[0]
    await helpers.create_pod(api, dra_namespace, _pod("seen", [_c("main", mem="4")]))
    await helpers.wait_bound(api, dra_namespace, ["seen"], timeout_s=60)
    rows = await helpers.gpu_rows(stack.database_url, node)

    await w.wait_recorded(api, dra_namespace, ["seen"])  # inspect reads the binder's annotations
    shown = {n["name"]: n for n in await from_apiserver(api, Request(), MemoryUnit.GIB)}
    assert set(shown) == set(stack.node_names)  # the device-plugin node from its capacity, the DRA node from its slice
    gpus = shown[node]["gpus"]
    assert [(g["index"], g["uuid"], g["memory_mib"]) for g in gpus] == [
        (r["index"], r["uuid"], r["memory_mib"]) for r in rows
    ]
    (seen,) = [a for a in shown[node]["allocations"] if a["pod_name"] == "seen"]
    assert [p["memory_mib"] for p in seen["parts"]] == [4096] and seen["parts"][0]["gpu_uuid"] in {
        r["uuid"] for r in rows
    }
    (one,) = await from_apiserver(api, Request(node=node), MemoryUnit.GIB)
    assert one["name"] == node and len(one["gpus"]) == len(rows)


async def _template_requests(api) -> dict[str, int]:  # type: ignore[no-untyped-def]
    """kube-apiserver's own count of ResourceClaimTemplate requests so far, by verb."""
    from bench.api_requests import read_counts

    counts = await read_counts(api)
    return {verb: counts[f"{verb} resourceclaimtemplates"] for verb in ("POST", "GET")}


async def test_pods_asking_the_same_demand_cost_one_template_request_until_it_is_no_longer_trusted(
    stack, api, dra_namespace
) -> None:  # type: ignore[no-untyped-def]
    """Every pod of a Deployment asks the same template: the webhook creates it once and trusts it for
    TEMPLATE_TRUSTED_S (each pod cost a create answered 409 and a read before, benchmark 12); after that it asks
    the API server again, and writes a template deleted by hand anew."""
    before = await _template_requests(api)
    for i in range(3):  # through kube-apiserver and the extender's webhook, as any client creates a pod
        await helpers.create_pod(api, dra_namespace, _pod(f"same-{i}", [_c("main", mem="1")]))
    after = await _template_requests(api)
    assert {v: after[v] - before[v] for v in after} == {"POST": 1, "GET": 0}
    (template,) = await _templates(api, dra_namespace)

    from services.extender.admission import TEMPLATE_TRUSTED_S, Admission
    from shared.settings import MemoryUnit

    now = [1000.0]
    admission = Admission(MemoryUnit.GIB, api=api, clock=lambda: now[0])
    body = {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "operation": "CREATE",
            "namespace": dra_namespace,
            "resource": {"group": "", "version": "v1", "resource": "pods"},
            "object": _pod("direct", [_c("main", mem="1")]),
        },
    }

    async def admit() -> dict[str, int]:
        start = await _template_requests(api)
        status, answer = await admission(json.dumps(body).encode())
        assert status == 200 and json.loads(answer)["response"]["allowed"] is True
        end = await _template_requests(api)
        return {v: end[v] - start[v] for v in end}

    assert await admit() == {"POST": 1, "GET": 1}  # a handler of its own: found there (409), read, matches
    assert await admit() == {"POST": 0, "GET": 0}  # trusted
    name = template["metadata"]["name"]
    await client.ResourceV1Api(api).delete_namespaced_resource_claim_template(name, dra_namespace)
    now[0] += TEMPLATE_TRUSTED_S  # no longer trusted: created again
    assert await admit() == {"POST": 1, "GET": 0}
    assert [t["metadata"]["name"] for t in await _templates(api, dra_namespace)] == [name]
