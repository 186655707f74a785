"""The `admission.k8s.io/v1` AdmissionReview wire format of a mutating webhook (pure: bytes in, dicts out).

Facts from `k8s.io/api@v0.37.2/admission/v1/types.go` and kube-apiserver's `VerifyAdmissionResponse`
(`apiserver/pkg/admission/plugin/webhook/request/admissionreview.go`): kube-apiserver sends an AdmissionReview of
the first version in the webhook's `admissionReviewVersions` it speaks, and takes the answer only in that same
version, kind `AdmissionReview`, with `response.uid` equal to `request.uid`. A mutation is `response.patch` (a
base64 JSON patch) with `patchType: JSONPatch`, both or neither. A refusal is `allowed: false` with a `status`
whose `message` kube-apiserver prefixes with `admission webhook "<name>" denied the request: ` and whose `code`
(at least 400) becomes the HTTP status the client sees. `request.dryRun` is true for a dry-run request: a webhook
with `sideEffects: NoneOnDryRun` must then make no side effects.
"""

from __future__ import annotations

import base64
import json
from dataclasses import dataclass
from typing import Any

API_VERSION = "admission.k8s.io/v1"
KIND = "AdmissionReview"


class ReviewError(ValueError):
    """A body that is not an AdmissionReview this webhook answers (HTTP 400 with a JSON body naming why)."""


@dataclass(frozen=True)
class Review:
    """What a webhook needs of one AdmissionRequest."""

    uid: str
    operation: str
    namespace: str
    group: str
    resource: str
    sub_resource: str
    object: Any
    dry_run: bool
    user: str = ""


def parse_review(body: bytes) -> Review:
    """An `admission.k8s.io/v1` AdmissionReview request; ReviewError says what is wrong with anything else."""
    try:
        review = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ReviewError(f"the body is not JSON: {exc}") from None
    if not isinstance(review, dict):
        raise ReviewError("the body is not an AdmissionReview (a JSON object)")
    api_version, kind = review.get("apiVersion"), review.get("kind")
    if kind != KIND:
        raise ReviewError(f"kind {kind!r} is not {KIND}")
    if api_version != API_VERSION:
        raise ReviewError(
            f"apiVersion {api_version!r} is not served: this webhook answers {API_VERSION} only "
            "(set admissionReviewVersions: [v1] in the MutatingWebhookConfiguration)"
        )
    request = review.get("request")
    if not isinstance(request, dict):
        raise ReviewError("the AdmissionReview has no request object")
    uid = request.get("uid")
    if not isinstance(uid, str) or not uid:
        raise ReviewError("request.uid is missing (kube-apiserver always sends one)")
    resource = request.get("resource") or {}
    if not isinstance(resource, dict):
        raise ReviewError("request.resource must be an object {group, version, resource}")
    dry_run = request.get("dryRun")
    if dry_run is not None and not isinstance(dry_run, bool):
        raise ReviewError("request.dryRun must be true or false")
    user = request.get("userInfo") or {}
    return Review(
        uid=uid,
        operation=str(request.get("operation") or ""),
        namespace=str(request.get("namespace") or ""),
        group=str(resource.get("group") or ""),
        resource=str(resource.get("resource") or ""),
        sub_resource=str(request.get("subResource") or ""),
        object=request.get("object"),
        dry_run=bool(dry_run),
        user=str(user.get("username") or "") if isinstance(user, dict) else "",
    )


def allowed(uid: str, patch: list[dict[str, Any]] | None = None, warnings: list[str] | None = None) -> dict[str, Any]:
    """An AdmissionReview answer that admits the object (with a JSON patch when `patch` is given)."""
    response: dict[str, Any] = {"uid": uid, "allowed": True}
    if patch:
        response["patchType"] = "JSONPatch"
        response["patch"] = base64.b64encode(json.dumps(patch, separators=(",", ":")).encode()).decode()
    if warnings:
        response["warnings"] = list(warnings)
    return {"apiVersion": API_VERSION, "kind": KIND, "response": response}


def denied(uid: str, message: str, *, code: int = 400, reason: str = "Invalid") -> dict[str, Any]:
    """An AdmissionReview answer that refuses the object: `code` is the HTTP status the client gets."""
    status = {"status": "Failure", "message": message, "reason": reason, "code": code}
    return {"apiVersion": API_VERSION, "kind": KIND, "response": {"uid": uid, "allowed": False, "status": status}}
