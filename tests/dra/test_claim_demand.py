"""What a gpushare claim can take at most, counted at creation (pure): kube-scheduler's rounding over the request
policies gpushare publishes, counts, whole GPUs, alternatives, and what cannot be counted; the claim webhook's
configuration and what its answers look like."""

from __future__ import annotations

from typing import Any

import pytest

from services.extender.claim_admission import owner_pod
from shared.dra.claim_demand import ClaimDemand, ClaimDemandError, asks_gpushare, asks_whole_gpu, claim_demand
from shared.dra.webhook import ASKS_GPUSHARE_CLASS, CLAIM_PATH, claim_webhook_configuration
from shared.settings import MemoryUnit

GIB = MemoryUnit.GIB


def claim(*requests: dict[str, Any]) -> dict[str, Any]:
    return {"metadata": {"name": "c"}, "spec": {"devices": {"requests": list(requests)}}}


def exactly(name: str, memory: str | None = None, compute: str | None = None, **more: Any) -> dict[str, Any]:
    option: dict[str, Any] = {"deviceClassName": more.pop("device_class", "gpushare-gpu"), **more}
    wanted = {k: v for k, v in (("memory", memory), ("compute", compute)) if v is not None}
    if wanted:
        option["capacity"] = {"requests": wanted}
    return {"name": name, "exactly": option}


def test_memory_is_rounded_up_to_whole_units_and_compute_to_whole_percent() -> None:
    assert claim_demand(claim(exactly("a", "4Gi", "30")), GIB, 16384) == ClaimDemand(4096, 30, 1)
    assert claim_demand(claim(exactly("a", "1500Mi", "12.5")), GIB, 16384) == ClaimDemand(2048, 13, 1)
    assert claim_demand(claim(exactly("a", "1Mi")), GIB, 16384) == ClaimDemand(1024, 0, 1)  # at least one unit
    assert claim_demand(claim(exactly("a", "1500Mi")), MemoryUnit.MIB, 16384) == ClaimDemand(1500, 0, 1)


def test_counts_requests_whole_gpus_and_alternatives_add_up() -> None:
    two = exactly("a", "4Gi", "30", allocationMode="ExactCount", count=2)
    whole = exactly("b")  # no memory: the whole GPU (the slice's default), the largest one known
    assert asks_whole_gpu(claim(whole)) and not asks_whole_gpu(claim(two))
    assert claim_demand(claim(two, whole), GIB, 16384) == ClaimDemand(8192 + 16384, 60, 3)
    alternatives = {
        "name": "x",
        "firstAvailable": [
            {"name": "big", "deviceClassName": "gpushare-gpu", "capacity": {"requests": {"memory": "8Gi"}}},
            {
                "name": "small",
                "deviceClassName": "gpushare-gpu",
                "capacity": {"requests": {"memory": "2Gi", "compute": "50"}},
            },
            {"name": "other", "deviceClassName": "someone-elses-gpu"},
        ],
    }
    assert claim_demand(claim(alternatives), GIB, 16384) == ClaimDemand(8192, 50, 1)  # each at its largest
    other = exactly("o", "4Gi", device_class="someone-elses-gpu")
    assert not asks_gpushare(claim(other)) and asks_gpushare(claim(alternatives))
    assert claim_demand(claim(other), GIB, 16384) == ClaimDemand(0, 0, 0)


@pytest.mark.parametrize(
    ("request_", "words"),
    [
        (exactly("a", "4Gi", allocationMode="All"), "allocationMode All"),
        (exactly("a", "4Gi", count=0), "count 0"),
        (exactly("a", "four"), "not a Kubernetes quantity"),
        (exactly("a", "0"), "not positive"),
        (exactly("a", "4Gi", "-5"), "negative"),
    ],
)
def test_what_cannot_be_counted_says_what_to_write(request_: dict[str, Any], words: str) -> None:
    with pytest.raises(ClaimDemandError, match=words):
        claim_demand(claim(request_), GIB, 16384)


def test_the_claim_webhook_is_validating_on_claim_creation_of_the_gpushare_class() -> None:
    config = claim_webhook_configuration({"url": "https://127.0.0.1:8443" + CLAIM_PATH})
    assert config["kind"] == "ValidatingWebhookConfiguration"
    (hook,) = config["webhooks"]
    assert hook["rules"] == [
        {
            "operations": ["CREATE"],
            "apiGroups": ["resource.k8s.io"],
            "apiVersions": ["v1"],
            "resources": ["resourceclaims"],
            "scope": "Namespaced",
        }
    ]
    assert hook["failurePolicy"] == "Fail" and hook["sideEffects"] == "NoneOnDryRun"
    assert "namespaceSelector" not in hook  # a quota may be set on any namespace
    assert hook["matchConditions"] == [{"name": "asks-gpushare-gpus", "expression": ASKS_GPUSHARE_CLASS}]
    assert "'gpushare-gpu'" in ASKS_GPUSHARE_CLASS


def test_a_templates_claim_names_its_pod() -> None:
    owned = {
        "metadata": {
            "ownerReferences": [{"apiVersion": "v1", "kind": "Pod", "name": "p", "uid": "u", "controller": True}]
        }
    }
    assert owner_pod(owned) == ("p", "u")
    assert owner_pod({"metadata": {}}) is None
