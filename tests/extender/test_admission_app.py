"""The webhook port's HTTP shell (services/extender/admission.py) for what needs no API server: every answer is an
`admission.k8s.io/v1` AdmissionReview (or a 400/413 with a JSON body), a dry run is rewritten without creating
anything, and an API server that does not answer is a refusal that says so, never a 500. The template's creation
against a real kube-apiserver is in tests/dra/test_admission.py."""

from __future__ import annotations

import base64
import json
from pathlib import Path
from typing import Any

import httpx
import pytest

from services.extender.admission import MAX_BODY_BYTES, Admission, create_webhook_app
from shared.settings import MemoryUnit


def review(obj: Any, *, dry_run: bool = False, resource: str = "pods", operation: str = "CREATE") -> dict[str, Any]:
    return {
        "apiVersion": "admission.k8s.io/v1",
        "kind": "AdmissionReview",
        "request": {
            "uid": "u-1",
            "operation": operation,
            "namespace": "team",
            "resource": {"group": "", "version": "v1", "resource": resource},
            "object": obj,
            "dryRun": dry_run,
        },
    }


def gpu_pod(**limits: str) -> dict[str, Any]:
    return {
        "metadata": {"generateName": "bert-"},
        "spec": {"containers": [{"name": "main", "resources": {"limits": limits}}]},
    }


@pytest.fixture
def dead_kubeconfig(tmp_path: Path) -> str:
    """A kubeconfig whose API server is a closed port."""
    path = tmp_path / "kubeconfig"
    path.write_text(
        json.dumps(
            {
                "apiVersion": "v1",
                "kind": "Config",
                "clusters": [
                    {"name": "c", "cluster": {"server": "https://127.0.0.1:9", "insecure-skip-tls-verify": True}}
                ],
                "users": [{"name": "u", "user": {"token": "t"}}],
                "contexts": [{"name": "c", "context": {"cluster": "c", "user": "u"}}],
                "current-context": "c",
            }
        )
    )
    return str(path)


@pytest.fixture
async def http(dead_kubeconfig: str):  # type: ignore[no-untyped-def]
    admission = Admission(MemoryUnit.GIB, kubeconfig=dead_kubeconfig)
    app = create_webhook_app(admission)
    async with httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="https://webhook") as client:
        yield client
    await admission.close()


async def test_a_dry_run_is_rewritten_without_the_api(http: httpx.AsyncClient) -> None:
    answer = await http.post("/mutate", json=review(gpu_pod(**{"aliyun.com/gpu-mem": "4"}), dry_run=True))
    assert answer.status_code == 200
    body = answer.json()
    assert (body["apiVersion"], body["kind"], body["response"]["uid"]) == (
        "admission.k8s.io/v1",
        "AdmissionReview",
        "u-1",
    )
    assert body["response"]["allowed"] is True and body["response"]["patchType"] == "JSONPatch"
    ops = json.loads(base64.b64decode(body["response"]["patch"]))
    assert {"op": "remove", "path": "/spec/containers/0/resources/limits/aliyun.com~1gpu-mem"} in ops


async def test_what_is_not_a_gpu_pod_creation_passes_unchanged(http: httpx.AsyncClient) -> None:
    for body in (review(gpu_pod(cpu="1")), review({}, resource="services"), review({}, operation="UPDATE")):
        response = (await http.post("/mutate", json=body)).json()["response"]
        assert response == {"uid": "u-1", "allowed": True}


async def test_an_api_server_that_does_not_answer_is_a_refusal_that_says_so(http: httpx.AsyncClient) -> None:
    answer = await http.post("/mutate", json=review(gpu_pod(**{"aliyun.com/gpu-mem": "4"})))
    assert answer.status_code == 200
    response = answer.json()["response"]
    assert response["allowed"] is False and response["status"]["code"] == 503
    assert "did not answer" in response["status"]["message"] and "try again" in response["status"]["message"]


async def test_refusals_and_bad_bodies(http: httpx.AsyncClient) -> None:
    refused = (await http.post("/mutate", json=review(gpu_pod(**{"aliyun.com/gpu-core": "30"})))).json()["response"]
    assert refused["allowed"] is False and refused["status"]["code"] == 422
    assert "Write aliyun.com/gpu-mem as well" in refused["status"]["message"]
    malformed = (await http.post("/mutate", json=review(["not", "a", "pod"]))).json()["response"]
    assert malformed["allowed"] is False and malformed["status"]["code"] == 400
    wrong = await http.post("/mutate", json={**review({}), "apiVersion": "admission.k8s.io/v1beta1"})
    assert wrong.status_code == 400 and "admissionReviewVersions" in wrong.json()["error"]
    huge = await http.post("/mutate", content=b"{" + b" " * MAX_BODY_BYTES + b"}")
    assert huge.status_code == 413 and huge.json()
