"""GiB quotas at creation: kube-apiserver's validating webhook call for a gpushare ResourceClaim in, a verdict out.

Every ResourceClaim of the `gpushare-gpu` class being created (written by hand, or by the resourceclaim controller
from a template, gpushare admission's included) is sent here (`shared.dra.webhook.claim_webhook_configuration`).
What it can consume at most (`shared.dra.claim_demand`) is counted against its namespace's quota in the ledger by
`shared.ledger.claim_holds.admit_claim`: one transaction under the namespace's quota lock, so two creations at the
same moment cannot both pass. A claim over the quota is refused with a message naming the quota, what is held and
what is left (kube-apiserver returns it to the creator as HTTP 403; the resourceclaim controller puts it in a
`FailedResourceClaimCreation` event on the pod and tries again with backoff); for a template's claim the pod's
refusal is also published (`RefusedEvent`), so `/v1/pending` in accounting says why the pod waits.

A namespace without a quota costs no ledger query: the extender's view of the ledger follows the quota events
(`has_quota`), as kube-apiserver's own quota admission reads ResourceQuotas from an informer, so a quota applies to
the claims created once the extender has heard of it (milliseconds after it is set); where the view knows a quota,
`admit_claim` reads it again under the namespace's lock. A dry run is judged and records nothing. A ledger that
does not answer gets a refusal saying so (HTTP 503; the creator tries again): with `failurePolicy: Fail` no gpushare
claim is created uncounted. Every answer is counted (`gpushare_extender_claim_admissions_total`) and every refusal
logged.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

from sqlalchemy.exc import DBAPIError
from sqlalchemy.ext.asyncio import AsyncEngine

from services.extender.metrics import ADMISSION_SECONDS, CLAIM_ADMISSIONS
from shared.dra.claim_demand import ClaimDemandError, asks_gpushare, asks_whole_gpu, claim_demand
from shared.dra.review import Review, ReviewError, allowed, denied, parse_review
from shared.events.bus import EventBus
from shared.events.catalogue import RefusedEvent
from shared.http import dump_json
from shared.ledger.claim_holds import ClaimHold, admit_claim, has_quota, largest_dra_gpu_mib
from shared.ledger.reservations import QuotaExceeded
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

REFUSAL_THROTTLE_S = 10.0  # the controller retries a refused claim with backoff: one published refusal per pod


def owner_pod(claim: dict[str, Any]) -> tuple[str, str] | None:
    """(name, UID) of the pod a claim was made for (its controller owner), or None for a hand-written claim."""
    for ref in (claim.get("metadata") or {}).get("ownerReferences") or []:
        if ref.get("kind") == "Pod" and ref.get("apiVersion") == "v1" and ref.get("controller"):
            return str(ref.get("name") or ""), str(ref.get("uid") or "")
    return None


class ClaimAdmission:
    """The claim webhook's handler: review bytes in, (HTTP status, JSON body) out."""

    def __init__(
        self,
        engine: AsyncEngine,
        unit: MemoryUnit,
        *,
        bus: EventBus | None = None,
        has_quota: Callable[[str], bool] | None = None,
    ) -> None:
        self.engine = engine
        self.unit = unit
        self.bus = bus
        self.has_quota = has_quota  # namespace -> whether it has a GPU quota, as the view knows (None: ask the ledger)
        self._published: OrderedDict[tuple[str, str], float] = OrderedDict()  # (pod UID, message) -> when

    async def __call__(self, body: bytes) -> tuple[int, bytes]:
        start = time.perf_counter()
        try:
            try:
                review = parse_review(body)
            except ReviewError as exc:
                CLAIM_ADMISSIONS.labels(reason="malformed").inc()
                log.info("refused a malformed claim admission review: %s", exc, extra={"problem": str(exc)})
                return 400, dump_json({"error": str(exc)})
            answer, outcome = await self._answer(review)
            CLAIM_ADMISSIONS.labels(reason=outcome).inc()
            return 200, dump_json(answer)
        finally:
            ADMISSION_SECONDS.observe(time.perf_counter() - start)

    async def _answer(self, review: Review) -> tuple[dict[str, Any], str]:
        what = (review.group, review.resource, review.sub_resource, review.operation)
        if what != ("resource.k8s.io", "resourceclaims", "", "CREATE"):
            log.info("claim admission review for %s %s/%s passed unchanged", review.operation, *what[:2])
            return allowed(review.uid), "ignored"
        resource_claim = review.object
        if not isinstance(resource_claim, dict) or not asks_gpushare(resource_claim):
            return allowed(review.uid), "unchanged"
        meta = resource_claim.get("metadata") or {}
        uid, name = str(meta.get("uid") or ""), str(meta.get("name") or meta.get("generateName") or "")
        if not uid:
            return self._refuse(
                review,
                "the claim being created has no metadata.uid: gpushare counts claims in a validating webhook, where "
                "kube-apiserver has set it (register shared/dra/webhook.py's ValidatingWebhookConfiguration)",
                400,
                "BadRequest",
                "refused",
            )
        pod = owner_pod(resource_claim)
        if self.has_quota is not None and not self.has_quota(review.namespace):
            return allowed(review.uid), "no_quota"
        try:
            whole_gpu = await largest_dra_gpu_mib(self.engine) if asks_whole_gpu(resource_claim) else 0
            try:
                demand = claim_demand(resource_claim, self.unit, whole_gpu)
            except ClaimDemandError as exc:
                if not await has_quota(self.engine, review.namespace):
                    return allowed(review.uid), "no_quota"
                return self._refuse(review, f"claim {name}: {exc}", 422, "Invalid", "refused")
            hold = ClaimHold(uid, review.namespace, name, demand.memory_mib, demand.compute, pod[0] if pod else "")
            admitted = await admit_claim(self.engine, hold, self.unit, dry_run=review.dry_run)
        except QuotaExceeded as exc:
            if pod is not None and not review.dry_run:
                await self._publish(review.namespace, pod, str(exc))
            return self._refuse(review, str(exc), 403, "Forbidden", "quota")
        except (DBAPIError, OSError, TimeoutError) as exc:
            return self._refuse(
                review,
                f"the gpushare ledger did not answer ({type(exc).__name__}), so claim {name} cannot be counted "
                "against its namespace's GPU quota now; its creator will try again",
                503,
                "ServiceUnavailable",
                "failed",
            )
        if review.dry_run:
            return allowed(review.uid), "dry_run"
        if admitted.held:
            log.info(
                "claim %s/%s holds %d MiB and %d%% compute of its namespace's GPU quota until it is allocated or "
                "deleted",
                review.namespace,
                name,
                demand.memory_mib,
                demand.compute,
                extra={"namespace": review.namespace, "claim": name, "claim_uid": uid},
            )
        return allowed(review.uid), "held" if admitted.held else "no_quota"

    def _refuse(self, review: Review, message: str, code: int, reason: str, outcome: str) -> tuple[dict[str, Any], str]:
        log.warning(
            "refused a gpushare claim in namespace %s: %s",
            review.namespace,
            message,
            extra={"namespace": review.namespace, "reason": reason, "user": review.user},
        )
        return denied(review.uid, message, code=code, reason=reason), outcome

    async def _publish(self, namespace: str, pod: tuple[str, str], message: str) -> None:
        """The pod's refusal for accounting's `/v1/pending` (the same message once per REFUSAL_THROTTLE_S)."""
        pod_name, pod_uid = pod
        if self.bus is None or not pod_uid:
            return
        key, now = (pod_uid, message), time.monotonic()
        last = self._published.get(key)
        if last is not None and now - last < REFUSAL_THROTTLE_S:
            return
        self._published[key] = now
        self._published.move_to_end(key)
        while len(self._published) > 10_000:
            self._published.popitem(last=False)
        try:
            await self.bus.publish(
                RefusedEvent(
                    pod_uid=pod_uid[:253],
                    namespace=namespace[:253],
                    pod_name=pod_name[:253],
                    summary=f"gpushare admission: {message}"[:2048],
                    source="extender",
                )
            )
        except Exception as exc:  # explaining a refusal must never fail the admission
            log.warning("could not publish why pod %s/%s waits: %s", namespace, pod_name, exc)
