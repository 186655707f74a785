"""gpushare admission over HTTPS: kube-apiserver's mutating webhook call in, an AdmissionReview answer out.

The extender serves it on its own port (`--webhook-port`, HTTPS with `--webhook-tls-cert`/`--webhook-tls-key`),
apart from kube-scheduler's verbs, so the verbs' plain or mutual-TLS port is unchanged and kube-apiserver needs no
client certificate. The rewrite is `shared.dra.admission` (pure); this shell reads the review, creates the
ResourceClaimTemplate the rewrite names (`409 AlreadyExists` with the same spec is success: a template is named by
a hash of its spec; nothing is created on a dry run) and answers. A template found or created is trusted for
`TEMPLATE_TRUSTED_S` without asking the API server again: every pod of a Deployment asks the same one. Every
refusal is logged and counted, and says why; a body that is not an `admission.k8s.io/v1` AdmissionReview gets a
400 with a JSON body.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from collections.abc import Awaitable, Callable
from typing import Any

import aiohttp
from fastapi import FastAPI, Request
from fastapi.responses import Response
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.extender.metrics import ADMISSION_SECONDS, ADMISSIONS
from shared.dra.admission import AdmissionRefused, Rewrite, rewrite_pod, template_matches
from shared.dra.review import Review, ReviewError, allowed, denied, parse_review
from shared.dra.webhook import CLAIM_PATH, PATH
from shared.http import BodyLimitMiddleware, dump_json, install_common
from shared.kube.client import api_client
from shared.kube.raw import read_json, status_message
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

MAX_BODY_BYTES = 4 * 1024 * 1024  # a pod is at most ~1.5 MiB in etcd; the review carries it once on CREATE
API_TIMEOUT_S = 5.0  # below the webhook's timeoutSeconds (10), so a slow API server gets our answer, not a timeout
# How long a template found or created is known to be there. Within it a pod asking the same demand costs no API
# call (it cost a create answered 409 and a read before); a template deleted by hand meanwhile is written again by
# the first admission after it.
TEMPLATE_TRUSTED_S = 30.0
TEMPLATES_REMEMBERED = 4096


class Admission:
    """The webhook's handler: review bytes in, (HTTP status, JSON body) out."""

    def __init__(
        self,
        unit: MemoryUnit,
        *,
        kubeconfig: str | None = None,
        api: Any = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.unit = unit
        self._kubeconfig = kubeconfig
        self._api = api
        self._own_api = api is None
        self._api_lock = asyncio.Lock()
        self._clock = clock
        self._present: OrderedDict[tuple[str, str], float] = OrderedDict()  # (namespace, name) -> when confirmed

    async def close(self) -> None:
        """Close the Kubernetes client this handler opened."""
        if self._own_api and self._api is not None:
            await self._api.close()
            self._api = None

    async def __call__(self, body: bytes) -> tuple[int, bytes]:
        start = time.perf_counter()
        try:
            try:
                review = parse_review(body)
            except ReviewError as exc:
                ADMISSIONS.labels(reason="malformed").inc()
                log.info("refused a malformed admission review: %s", exc, extra={"problem": str(exc)})
                return 400, dump_json({"error": str(exc)})
            answer, outcome = await self._answer(review)
            ADMISSIONS.labels(reason=outcome).inc()
            return 200, dump_json(answer)
        finally:
            ADMISSION_SECONDS.observe(time.perf_counter() - start)

    async def _answer(self, review: Review) -> tuple[dict[str, Any], str]:
        if (review.group, review.resource, review.sub_resource, review.operation) != ("", "pods", "", "CREATE"):
            log.info(
                "admission review for %s %s/%s %s passed unchanged (the webhook rewrites pod creations only)",
                review.operation,
                review.group or "core",
                review.resource,
                review.sub_resource,
            )
            return allowed(review.uid), "ignored"
        try:
            rewrite = rewrite_pod(review.object, review.namespace, self.unit)
            if rewrite is None:
                return allowed(review.uid), "unchanged"
            if not review.dry_run:
                await self._ensure_template(rewrite, review.namespace)
        except AdmissionRefused as exc:
            code = {"BadRequest": 400, "Invalid": 422, "Forbidden": 403}.get(exc.reason, 503)
            log.warning(
                "refused a pod in namespace %s: %s",
                review.namespace,
                exc.message,
                extra={"namespace": review.namespace, "reason": exc.reason, "user": review.user},
            )
            return denied(review.uid, exc.message, code=code, reason=exc.reason), (
                "failed" if code >= 500 else "refused"
            )
        log.info(
            "pod in namespace %s rewritten onto DRA with claim template %s%s",
            review.namespace,
            rewrite.template_name,
            " (dry run: template not created)" if review.dry_run else "",
            extra={"namespace": review.namespace, "template": rewrite.template_name, "dry_run": review.dry_run},
        )
        return allowed(review.uid, rewrite.patch, rewrite.warnings), "dry_run" if review.dry_run else "rewritten"

    async def _client(self) -> Any:
        async with self._api_lock:
            if self._api is None:
                self._api = await api_client(self._kubeconfig)
            return self._api

    async def _ensure_template(self, rewrite: Rewrite, namespace: str) -> None:
        """Create the rewrite's ResourceClaimTemplate, or find it there already; AdmissionRefused otherwise."""
        name = rewrite.template_name
        key, now = (namespace, name), self._clock()
        confirmed = self._present.get(key)
        if confirmed is not None and now - confirmed < TEMPLATE_TRUSTED_S:
            return
        await self._create_or_find(rewrite, namespace)
        self._present[key] = now
        self._present.move_to_end(key)
        while len(self._present) > TEMPLATES_REMEMBERED:
            self._present.popitem(last=False)

    async def _create_or_find(self, rewrite: Rewrite, namespace: str) -> None:
        name = rewrite.template_name
        try:
            resource = client.ResourceV1Api(await self._client())
            try:
                await read_json(
                    await resource.create_namespaced_resource_claim_template(
                        namespace, rewrite.template, _preload_content=False, _request_timeout=API_TIMEOUT_S
                    )
                )
                return
            except ApiException as exc:
                if exc.status != 409:
                    raise
            existing = await read_json(
                await resource.read_namespaced_resource_claim_template(
                    name, namespace, _preload_content=False, _request_timeout=API_TIMEOUT_S
                )
            )
        except ApiException as exc:
            raise _template_refusal(exc, namespace, name) from None
        except (aiohttp.ClientError, OSError, TimeoutError) as exc:
            raise AdmissionRefused(
                f"could not create ResourceClaimTemplate {namespace}/{name} for the pod's GPU claim: the Kubernetes "
                f"API did not answer ({type(exc).__name__}); the pod's controller will try again",
                "ServiceUnavailable",
            ) from None
        if not template_matches(existing, rewrite.template):
            raise AdmissionRefused(
                f"ResourceClaimTemplate {namespace}/{name} exists but asks something else than gpushare wrote under "
                "that name (it was edited); delete it and create the pod again: gpushare writes it anew",
                "Invalid",
            )


def _template_refusal(exc: ApiException, namespace: str, name: str) -> AdmissionRefused:
    """A refusal naming why the API server would not take the template."""
    why = status_message(exc) or f"HTTP {exc.status}"
    if exc.status == 403:
        return AdmissionRefused(
            f"the gpushare extender may not create ResourceClaimTemplates in namespace {namespace} ({why}); grant its "
            "ServiceAccount `create` and `get` on resourceclaimtemplates.resource.k8s.io (k8s/base/rbac.yaml)",
            "Forbidden",
        )
    if exc.status in (400, 422):
        return AdmissionRefused(f"the GPU claim gpushare wrote for the pod is not valid: {why}", "Invalid")
    if exc.status == 404:
        return AdmissionRefused(
            f"ResourceClaimTemplate {namespace}/{name} could not be created: {why} (is resource.k8s.io/v1 served? "
            "DRA needs Kubernetes 1.34 or later)",
            "Invalid",
        )
    return AdmissionRefused(
        f"could not create ResourceClaimTemplate {namespace}/{name}: {why}; the pod's controller will try again",
        "ServiceUnavailable",
    )


def create_webhook_app(
    admission: Admission,
    *,
    claims: Callable[[bytes], Awaitable[tuple[int, bytes]]] | None = None,
    ready: Any = lambda: True,
) -> FastAPI:
    """The webhook port's app: `POST /mutate` (pods), `POST /validate-claims` (gpushare claims against their
    namespace's GiB quota, `services.extender.claim_admission`), and /healthz, /readyz, /metrics."""
    app = FastAPI(title="gpushare admission", openapi_url=None, docs_url=None, redoc_url=None)
    app.add_middleware(BodyLimitMiddleware, max_bytes=MAX_BODY_BYTES)
    install_common(app, ready=ready)

    @app.post(PATH)
    async def mutate(request: Request) -> Response:
        status, body = await admission(await request.body())
        return Response(body, status_code=status, media_type="application/json")

    if claims is not None:
        count_claim = claims

        @app.post(CLAIM_PATH)
        async def validate_claim(request: Request) -> Response:
            status, body = await count_claim(await request.body())
            return Response(body, status_code=status, media_type="application/json")

    return app
