"""gpushare admission's pure core: an unchanged `aliyun.com/*` pod -> the JSON patch and the ResourceClaimTemplate
(shared/dra/admission.py), hints -> CEL selectors (shared/dra/selectors.py), the AdmissionReview wire
(shared/dra/review.py) and the webhook configuration (shared/dra/webhook.py). What kube-apiserver, kube-scheduler
and the gate make of them is tested end to end in test_admission.py."""

from __future__ import annotations

import base64
import json
from typing import Any

import pytest

from shared.dra import DEVICE_CLASS
from shared.dra.admission import DEMAND_ANNOTATION, AdmissionRefused, rewrite_pod, template_matches
from shared.dra.review import ReviewError, allowed, denied, parse_review
from shared.dra.selectors import hint_selectors
from shared.dra.webhook import ASKS_GPUSHARE, webhook_configuration
from shared.placement.hints import parse_hints
from shared.settings import MemoryUnit
from tests.dra.patching import apply_patch

GIB = MemoryUnit.GIB


def container(name: str, limits: dict[str, str] | None = None, **extra: Any) -> dict[str, Any]:
    c: dict[str, Any] = {"name": name, "image": "cuda"}
    if limits is not None:
        c["resources"] = {"limits": dict(limits)}
    c.update(extra)
    return c


def pod(*containers: dict[str, Any], inits: list[dict[str, Any]] | None = None, **meta: Any) -> dict[str, Any]:
    spec: dict[str, Any] = {"containers": list(containers)}
    if inits:
        spec["initContainers"] = inits
    return {"apiVersion": "v1", "kind": "Pod", "metadata": {"generateName": "web-", **meta}, "spec": spec}


def requests_of(rewrite: Any) -> list[dict[str, Any]]:
    return rewrite.template["spec"]["spec"]["devices"]["requests"]


def rewritten(p: dict[str, Any], unit: MemoryUnit = GIB) -> tuple[dict[str, Any], Any]:
    rw = rewrite_pod(p, "team", unit)
    assert rw is not None
    return apply_patch(p, rw.patch), rw


def test_one_container_becomes_one_request_and_its_limits_leave() -> None:
    p = pod(container("bert", {"aliyun.com/gpu-mem": "4", "cpu": "2"}))
    out, rw = rewritten(p)
    assert requests_of(rw) == [
        {
            "name": "bert",
            "exactly": {
                "deviceClassName": DEVICE_CLASS,
                "allocationMode": "ExactCount",
                "count": 1,
                "capacity": {"requests": {"memory": "4Gi"}},  # no compute asked: the slice's default (0) applies
            },
        }
    ]
    c = out["spec"]["containers"][0]
    assert c["resources"] == {"limits": {"cpu": "2"}, "claims": [{"name": "gpushare", "request": "bert"}]}
    assert out["spec"]["resourceClaims"] == [{"name": "gpushare", "resourceClaimTemplateName": rw.template_name}]
    record = json.loads(out["metadata"]["annotations"][DEMAND_ANNOTATION])
    assert record == {
        "template": rw.template_name,
        "claim": "gpushare",
        "containers": {"bert": {"limits": {"aliyun.com/gpu-mem": "4"}}},
    }
    assert rw.template["metadata"]["namespace"] == "team" and rw.template_name.startswith("gpushare-")
    assert rw.warnings == []


def test_core_count_and_requests_only() -> None:
    p = pod(
        container(
            "train",
            None,
            resources={
                "requests": {"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-core": "60", "aliyun.com/gpu-count": "2"}
            },
        )
    )
    out, rw = rewritten(p)
    (request,) = requests_of(rw)
    # gpu-count splits memory and compute evenly, as the extender does: per GPU 4 GiB and 30 %
    assert request["exactly"]["count"] == 2
    assert request["exactly"]["capacity"] == {"requests": {"memory": "4Gi", "compute": "30"}}
    assert out["spec"]["containers"][0]["resources"] == {
        "requests": {},
        "claims": [{"name": "gpushare", "request": "train"}],
    }


def test_memory_unit_mib() -> None:
    _, rw = rewritten(pod(container("a", {"aliyun.com/gpu-mem": "1536"})), MemoryUnit.MIB)
    assert requests_of(rw)[0]["exactly"]["capacity"] == {"requests": {"memory": "1536Mi"}}


def test_two_containers_two_requests_and_a_container_without_gpu_untouched() -> None:
    p = pod(
        container("a", {"aliyun.com/gpu-mem": "4"}),
        container("b", {"aliyun.com/gpu-mem": "2", "aliyun.com/gpu-core": "20"}),
        container("log", {"cpu": "1"}),
    )
    out, rw = rewritten(p)
    assert [(r["name"], r["exactly"]["capacity"]["requests"]) for r in requests_of(rw)] == [
        ("a", {"memory": "4Gi"}),
        ("b", {"memory": "2Gi", "compute": "20"}),
    ]
    assert [c["resources"].get("claims") for c in out["spec"]["containers"]] == [
        [{"name": "gpushare", "request": "a"}],
        [{"name": "gpushare", "request": "b"}],
        None,
    ]


def test_sidecar_gets_its_own_request_and_a_regular_init_container_uses_an_app_containers_share() -> None:
    p = pod(
        container("main", {"aliyun.com/gpu-mem": "4"}),
        container("small", {"aliyun.com/gpu-mem": "2"}),
        inits=[
            container("setup", {"aliyun.com/gpu-mem": "2"}),  # runs before the app: its share is reused
            container("proxy", {"aliyun.com/gpu-mem": "1"}, restartPolicy="Always"),  # runs beside it
        ],
    )
    out, rw = rewritten(p)
    assert [r["name"] for r in requests_of(rw)] == ["main", "small", "proxy"]
    inits = out["spec"]["initContainers"]
    # the smallest app share that covers it
    assert inits[0]["resources"] == {"limits": {}, "claims": [{"name": "gpushare", "request": "small"}]}
    assert inits[1]["resources"]["claims"] == [{"name": "gpushare", "request": "proxy"}]
    assert rw.warnings == []


def test_a_regular_init_container_larger_than_every_app_container_holds_its_own_share_with_a_warning() -> None:
    p = pod(
        container("main", {"aliyun.com/gpu-mem": "2"}),
        inits=[container("warmup", {"aliyun.com/gpu-mem": "8"})],
    )
    out, rw = rewritten(p)
    assert [r["name"] for r in requests_of(rw)] == ["main", "warmup"]
    assert out["spec"]["initContainers"][0]["resources"]["claims"] == [{"name": "gpushare", "request": "warmup"}]
    (warning,) = rw.warnings
    assert "warmup" in warning and "whole life of the pod" in warning


def test_init_container_with_another_count_is_not_covered() -> None:
    p = pod(
        container("main", {"aliyun.com/gpu-mem": "8", "aliyun.com/gpu-count": "2"}),
        inits=[container("setup", {"aliyun.com/gpu-mem": "1"})],
    )
    _, rw = rewritten(p)
    assert [r["name"] for r in requests_of(rw)] == ["main", "setup"]


def test_existing_claims_are_kept_and_our_entry_gets_a_free_name() -> None:
    nic = {"name": "gpushare", "resourceClaimTemplateName": "rdma"}
    c = container("a", {"aliyun.com/gpu-mem": "4"})
    c["resources"]["claims"] = [{"name": "gpushare"}]
    p = pod(c, annotations={"team": "x"})
    p["spec"]["resourceClaims"] = [nic]
    out, rw = rewritten(p)
    assert out["spec"]["resourceClaims"] == [
        nic,
        {"name": "gpushare-2", "resourceClaimTemplateName": rw.template_name},
    ]
    assert out["spec"]["containers"][0]["resources"]["claims"] == [
        {"name": "gpushare"},
        {"name": "gpushare-2", "request": "a"},
    ]
    assert out["metadata"]["annotations"]["team"] == "x" and DEMAND_ANNOTATION in out["metadata"]["annotations"]


def test_template_name_is_a_hash_of_the_demand() -> None:
    one = rewrite_pod(pod(container("a", {"aliyun.com/gpu-mem": "4"}), name="x"), "team", GIB)
    two = rewrite_pod(pod(container("a", {"aliyun.com/gpu-mem": "4"}), name="y"), "team", GIB)
    other = rewrite_pod(pod(container("a", {"aliyun.com/gpu-mem": "5"}), name="x"), "team", GIB)
    assert one and two and other
    assert one.template_name == two.template_name != other.template_name
    assert template_matches(one.template, two.template) and not template_matches(one.template, other.template)
    stored = json.loads(json.dumps(one.template))  # as kube-apiserver 1.37 stores it: with defaults added
    stored["spec"]["metadata"] = {}
    stored["spec"]["spec"]["devices"]["requests"][0]["exactly"]["tolerations"] = []
    assert template_matches(stored, one.template) and not template_matches(other.template, one.template)
    stored["spec"]["spec"]["devices"]["requests"].append({"name": "extra"})
    assert not template_matches(stored, one.template)


def test_hints_become_selectors_on_every_request() -> None:
    p = pod(
        container("a", {"aliyun.com/gpu-mem": "4"}),
        annotations={
            "gpushare.io/gpu-model-include": "A100, H100",
            "gpushare.io/gpu-uuid-exclude": "GPU-1",
            "gpushare.io/min-cuda-version": "12.2",
            "gpushare.io/policy": "spread",
        },
    )
    _, rw = rewritten(p)
    (request,) = requests_of(rw)
    expressions = [s["cel"]["expression"] for s in request["exactly"]["selectors"]]
    attrs = 'device.attributes["gpu.gpushare.io"]'
    assert expressions == [
        f'{attrs}.model.lowerAscii().contains("a100") || {attrs}.model.lowerAscii().contains("h100")',
        f'!({attrs}.uuid in ["GPU-1"])',
        f'"cudaVersion" in {attrs} && {attrs}.cudaVersion.compareTo(semver("12.2.0")) >= 0',
    ]
    (warning,) = rw.warnings
    assert "spread" in warning and "topologySpreadConstraints" in warning


def test_selector_literals_are_escaped() -> None:
    (sel,) = hint_selectors(parse_hints({"gpushare.io/gpu-model-exclude": 'T4") || true || ("'}))
    attrs = 'device.attributes["gpu.gpushare.io"]'
    assert sel["cel"]["expression"] == f'!({attrs}.model.lowerAscii().contains("t4\\") || true || (\\""))'


def _mem(gib: str, **more: str) -> dict[str, str]:
    return {"aliyun.com/gpu-mem": gib, **{f"aliyun.com/gpu-{k}": v for k, v in more.items()}}


PINNED = pod(container("a", _mem("4")), name="fixed")
PINNED["spec"]["nodeName"] = "n1"
INEXPRESSIBLE = [
    (pod(container("a", {"aliyun.com/gpu-core": "30"})), ["without aliyun.com/gpu-mem", "Write aliyun.com/gpu-mem"]),
    (PINNED, ["spec.nodeName", "nodeSelector"]),
    (pod(*[container(f"c{i}", _mem("2", count="2")) for i in range(17)]), ["34 GPU shares", "at most 32"]),
    (pod(container("a", _mem("4")), annotations={"gpushare.io/min-cuda-version": "1.2.1.4"}), ["three parts"]),
    (pod(container("a", _mem("four"))), ["aliyun.com/gpu-mem must be a whole number"]),
    (pod(container("a", _mem("4")), annotations={"gpushare.io/policy": "random"}), ["binpack or spread"]),
    (pod(container("a", _mem("3", count="2"))), ["cannot be split evenly"]),
    (pod(container("Bad_Name", _mem("3"))), ["not a DNS label"]),
]


@pytest.mark.parametrize(("p", "words"), INEXPRESSIBLE)
def test_shapes_dra_cannot_express_are_refused_with_what_to_write(p: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(AdmissionRefused) as refused:
        rewrite_pod(p, "team", GIB)
    assert refused.value.reason == "Invalid"
    for word in words:
        assert word in refused.value.message
    assert refused.value.message.startswith("pod team/")


@pytest.mark.parametrize(
    "obj",
    [
        "a pod",
        {"metadata": "x", "spec": {}},
        {"metadata": {}},
        {"metadata": {}, "spec": {"containers": {"a": 1}}},
        {"metadata": {}, "spec": {"containers": [{"name": "a", "resources": {"limits": ["aliyun.com/gpu-mem"]}}]}},
    ],
)
def test_malformed_pods_are_refused_as_bad_requests(obj: Any) -> None:
    with pytest.raises(AdmissionRefused) as refused:
        rewrite_pod(obj, "team", GIB)
    assert refused.value.message


def test_pods_that_ask_no_share_are_left_alone() -> None:
    assert rewrite_pod(pod(container("a", {"cpu": "1"})), "team", GIB) is None
    assert rewrite_pod(pod(container("a", {"aliyun.com/gpu-mem": "0"})), "team", GIB) is None
    mirror = pod(container("a", {"aliyun.com/gpu-mem": "4"}), annotations={"kubernetes.io/config.mirror": "x"})
    mirror["spec"]["nodeName"] = "n1"  # kubelet creates a static pod's mirror bound to its node
    assert rewrite_pod(mirror, "team", GIB) is None


# -- the review wire ----------------------------------------------------------------------------------------------
def review(request: dict[str, Any] | None = None, **top: Any) -> bytes:
    body = {"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview", **top}
    if request is not None:
        body["request"] = request
    return json.dumps(body).encode()


def test_parse_review() -> None:
    r = parse_review(
        review(
            {
                "uid": "u1",
                "operation": "CREATE",
                "namespace": "team",
                "resource": {"group": "", "version": "v1", "resource": "pods"},
                "object": {"kind": "Pod"},
                "dryRun": True,
                "userInfo": {"username": "system:serviceaccount:kube-system:replicaset-controller"},
            }
        )
    )
    assert (r.uid, r.operation, r.namespace, r.resource, r.dry_run) == ("u1", "CREATE", "team", "pods", True)
    assert r.object == {"kind": "Pod"} and r.user.endswith("replicaset-controller")


@pytest.mark.parametrize(
    ("body", "words"),
    [
        (b"{not json", "not JSON"),
        (b"[1]", "not an AdmissionReview"),
        (review({"uid": "u"}, apiVersion="admission.k8s.io/v1beta1"), "admissionReviewVersions: [v1]"),
        (review({"uid": "u"}, kind="Pod"), "kind 'Pod' is not AdmissionReview"),
        (review(None), "no request object"),
        (review({"operation": "CREATE"}), "request.uid is missing"),
        (review({"uid": "u", "dryRun": "yes"}), "dryRun must be true or false"),
    ],
)
def test_bad_reviews_name_the_problem(body: bytes, words: str) -> None:
    with pytest.raises(ReviewError) as bad:
        parse_review(body)
    assert words in str(bad.value)


def test_answers() -> None:
    ok = allowed("u1", [{"op": "add", "path": "/x", "value": 1}], ["careful"])
    assert ok["apiVersion"] == "admission.k8s.io/v1" and ok["kind"] == "AdmissionReview"
    assert ok["response"]["uid"] == "u1" and ok["response"]["allowed"] is True
    assert ok["response"]["patchType"] == "JSONPatch" and ok["response"]["warnings"] == ["careful"]
    assert json.loads(base64.b64decode(ok["response"]["patch"])) == [{"op": "add", "path": "/x", "value": 1}]
    assert "patch" not in allowed("u2")["response"] and "patchType" not in allowed("u2")["response"]
    no = denied("u3", "because", code=422, reason="Invalid")["response"]
    assert no == {
        "uid": "u3",
        "allowed": False,
        "status": {"status": "Failure", "message": "because", "reason": "Invalid", "code": 422},
    }


def test_webhook_configuration() -> None:
    cfg = webhook_configuration({"url": "https://127.0.0.1:1/mutate", "caBundle": "Q0E="})
    (hook,) = cfg["webhooks"]
    assert hook["namespaceSelector"] == {"matchLabels": {"gpushare.io/allocator": "dra"}}
    assert hook["sideEffects"] == "NoneOnDryRun" and hook["failurePolicy"] == "Fail"
    assert hook["rules"][0]["operations"] == ["CREATE"] and hook["rules"][0]["resources"] == ["pods"]
    assert hook["matchConditions"][0]["expression"] == ASKS_GPUSHARE
    for resource in ("aliyun.com/gpu-mem", "aliyun.com/gpu-core", "aliyun.com/gpu-count"):
        assert f"'{resource}'" in ASKS_GPUSHARE
