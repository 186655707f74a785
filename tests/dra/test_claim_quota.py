"""GiB quotas at claim creation and gpushare admission's templates, end to end on the real v1.37.2 kube-apiserver
(the claim webhook registered as `shared.dra.webhook` writes it, served by the extender), kube-controller-manager,
kube-scheduler, PostgreSQL, NATS and the services: racing creations through kube-apiserver and the webhook pass
exactly as many as the quota admits; holds come back when claims go; templates no pod uses are deleted and written
again under a pod that names one. docs/dra.md section 2."""

from __future__ import annotations

import asyncio
import time
from typing import Any

import httpx
from kubernetes_asyncio import client
from kubernetes_asyncio.client.exceptions import ApiException

from services.extender.admission import TEMPLATE_TRUSTED_S
from shared.dra.admission import MANAGED_BY, MANAGED_BY_LABEL, OPT_IN_LABEL, OPT_IN_VALUE
from shared.kube.raw import read_json
from tests.dra import workloads as w
from tests.dra.conftest import needs_dra
from tests.e2e import helpers
from tests.e2e.conftest import ADMIN_TOKEN
from tests.waiting import eventually

pytestmark = needs_dra

STACK_NODES = 1
STACK_DRA_NODES = 1
STACK_GPUS = "1x16GiB:Tesla-T4"
STACK_BINDER = ["--template-grace", "3"]  # templates unused for 3 s go (swept every 1.5 s)


def _claim(name: str, memory: str = "1Gi") -> dict[str, Any]:
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": name},
        "spec": w.claim_spec([("main", memory, None, 1)]),
    }


async def _create_claim(api: Any, namespace: str, body: dict[str, Any], **options: Any) -> tuple[int, str]:
    """(HTTP status, body) of creating a claim through kube-apiserver."""
    try:
        resp = await client.ResourceV1Api(api).create_namespaced_resource_claim(
            namespace, body, _preload_content=False, **options
        )
    except ApiException as exc:
        return int(exc.status), str(exc.body)
    return int(resp.status), await resp.text()


async def _holds(database_url: str, namespace: str) -> int:
    rows = await w.ledger_rows(database_url, "SELECT count(*) AS n FROM claim_holds WHERE namespace = $1", namespace)
    return int(rows[0]["n"])


async def test_fifty_claims_created_at_once_where_the_quota_admits_ten_pass_exactly_ten(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    assert (await helpers.set_quota(stack, ADMIN_TOKEN, namespace, 10)).status_code == 200
    await w.wait_quota_enforced(api, namespace)
    answers = await asyncio.gather(*(_create_claim(api, namespace, _claim(f"c{i:02d}")) for i in range(50)))
    created = [i for i, (status, _) in enumerate(answers) if status == 201]
    refused = [(status, body) for status, body in answers if status != 201]
    assert len(created) == 10, answers
    assert all(status == 403 for status, _ in refused), refused[:3]  # Forbidden, as Kubernetes' own quota
    message = refused[0][1]
    assert "claims.gpu.gpushare.io" in message and "denied the request" in message, message
    assert "GPU memory quota is 10 GiB" in message and "10 GiB held" in message and "0 GiB left" in message
    assert len(await w.claims_in(api, namespace)) == 10
    assert await _holds(stack.database_url, namespace) == 10
    # the claims go: their holds end with them (the binder's claim watch), and the quota admits ten again
    await client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(namespace)
    await eventually(lambda: _no_holds(stack.database_url, namespace), what="the holds ended", within=30)
    again = await asyncio.gather(*(_create_claim(api, namespace, _claim(f"d{i:02d}")) for i in range(12)))
    assert sum(1 for status, _ in again if status == 201) == 10
    # a dry run is judged and holds nothing
    status, body = await _create_claim(api, namespace, _claim("dry"), dry_run="All")
    assert status == 403 and "quota" in body
    await client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(namespace)


async def _no_holds(database_url: str, namespace: str) -> bool:
    return await _holds(database_url, namespace) == 0


async def test_claims_of_a_namespace_without_quota_pass_and_hold_nothing(stack, api, namespace) -> None:  # type: ignore[no-untyped-def]
    answers = await asyncio.gather(*(_create_claim(api, namespace, _claim(f"free{i}", "8Gi")) for i in range(4)))
    assert [status for status, _ in answers] == [201] * 4
    assert await _holds(stack.database_url, namespace) == 0
    async with httpx.AsyncClient(timeout=5) as http:  # and the claim webhook counted them
        text = (await http.get(f"{stack.processes['extender'].command.ready_url.rsplit('/', 1)[0]}/metrics")).text
    assert 'gpushare_extender_claim_admissions_total{reason="no_quota"}' in text
    await client.ResourceV1Api(api).delete_collection_namespaced_resource_claim(namespace)


async def test_templates_no_pod_uses_are_deleted_and_written_again_under_a_pod_that_names_one(
    stack, api, namespace
) -> None:  # type: ignore[no-untyped-def]
    """A rewritten pod's template outlives the pod by --template-grace, then goes. A pod of the same demand admitted
    right after (admission still trusts the template it saw, so it does not write it) names the deleted template:
    the binder writes it again and the pod's claim is made from it."""
    await client.CoreV1Api(api).patch_namespace(namespace, {"metadata": {"labels": {OPT_IN_LABEL: OPT_IN_VALUE}}})
    started = time.monotonic()
    await helpers.create_pod(api, namespace, helpers.gpu_pod("first", [1]))
    await helpers.wait_bound(api, namespace, ["first"], timeout_s=60)
    (template,) = await _templates(api, namespace)
    assert template["metadata"]["labels"][MANAGED_BY_LABEL] == MANAGED_BY
    name = template["metadata"]["name"]
    await helpers.delete_all_pods(api, namespace)
    await eventually(lambda: _no_templates(api, namespace), what="the unused template deleted", within=30)
    await helpers.create_pod(api, namespace, helpers.gpu_pod("second", [1]))
    trusted = time.monotonic() - started < TEMPLATE_TRUSTED_S - 2  # admission did not write the template again
    await helpers.wait_bound(api, namespace, ["second"], timeout_s=60)
    (again,) = await _templates(api, namespace)
    assert again["metadata"]["name"] == name
    binder = stack.binder_url
    async with httpx.AsyncClient(timeout=5) as http:
        text = (await http.get(f"{binder}/metrics")).text
    assert 'gpushare_binder_claim_templates_total{outcome="deleted"}' in text
    if trusted:  # then only the binder can have written it again (under a slow machine admission may have)
        assert 'gpushare_binder_claim_templates_total{outcome="written_again"}' in text, text


async def _templates(api: Any, namespace: str) -> list[dict[str, Any]]:
    body = await read_json(
        await client.ResourceV1Api(api).list_namespaced_resource_claim_template(namespace, _preload_content=False)
    )
    return list(body.get("items") or [])


async def _no_templates(api: Any, namespace: str) -> bool:
    return await _templates(api, namespace) == []
