"""The webhook configurations of gpushare admission (pure): the MutatingWebhookConfiguration that sends opted-in
namespaces' `aliyun.com/*` pods to it, and the ValidatingWebhookConfiguration that sends it every ResourceClaim of
the gpushare class being created (GiB quotas at creation, `claim_webhook_configuration` below).

One webhook, `pods.gpu.gpushare.io`, on pod CREATE only (`spec.resourceClaims` is immutable, so the rewrite must
happen at creation):

* `namespaceSelector` `gpushare.io/allocator=dra`: a namespace opts in with that label, every other namespace
  (gpushare's own included) is never sent to the webhook;
* `matchConditions`: only pods whose containers or init containers name `aliyun.com/gpu-mem`, `gpu-core` or
  `gpu-count` in their limits or requests reach it (webhook match conditions see `object`, `oldObject`, `request`
  and `authorizer`, not the namespace: `apiserver/pkg/admission/plugin/webhook/accessors.go`);
* `failurePolicy: Fail`: while the webhook cannot be reached, such pods are not created (their controllers retry)
  rather than admitted unchanged, which would leave them for the device-plugin path;
* `sideEffects: NoneOnDryRun`: the webhook creates a ResourceClaimTemplate, except for a dry-run request;
* `reinvocationPolicy: Never`: the rewrite removes what the match condition looks for.

The k8s/overlays/dra manifest and `gpushare up --dra` register exactly these objects (tests compare them).
"""

from __future__ import annotations

from typing import Any

from shared import annotations as ann
from shared.dra import DEVICE_CLASS
from shared.dra.admission import OPT_IN_LABEL, OPT_IN_VALUE

CONFIGURATION_NAME = "gpushare-dra-admission"
WEBHOOK_NAME = "pods.gpu.gpushare.io"
PATH = "/mutate"
TIMEOUT_S = 10

_RESOURCE_LIST = "[" + ", ".join(f"'{r}'" for r in ann.RESOURCES) + "]"
ASKS_GPUSHARE = (
    "['containers', 'initContainers'].exists(list, list in object.spec && object.spec[list].exists(c, "
    "'resources' in c && ['limits', 'requests'].exists(s, s in c.resources && "
    f"c.resources[s].exists(r, r in {_RESOURCE_LIST}))))"
)
"""The match condition: the pod names an `aliyun.com/*` resource gpushare serves in some container."""


def webhook_configuration(client_config: dict[str, Any]) -> dict[str, Any]:
    """The `admissionregistration.k8s.io/v1` MutatingWebhookConfiguration, calling `client_config` (a `service`
    or `url`, with the `caBundle` that signed the webhook's serving certificate)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "MutatingWebhookConfiguration",
        "metadata": {"name": CONFIGURATION_NAME},
        "webhooks": [
            {
                "name": WEBHOOK_NAME,
                "clientConfig": client_config,
                "rules": [
                    {
                        "operations": ["CREATE"],
                        "apiGroups": [""],
                        "apiVersions": ["v1"],
                        "resources": ["pods"],
                        "scope": "Namespaced",
                    }
                ],
                "namespaceSelector": {"matchLabels": {OPT_IN_LABEL: OPT_IN_VALUE}},
                "matchConditions": [{"name": "asks-aliyun-gpu-resources", "expression": ASKS_GPUSHARE}],
                "failurePolicy": "Fail",
                "matchPolicy": "Equivalent",
                "sideEffects": "NoneOnDryRun",
                "timeoutSeconds": TIMEOUT_S,
                "admissionReviewVersions": ["v1"],
                "reinvocationPolicy": "Never",
            }
        ],
    }


CLAIM_CONFIGURATION_NAME = "gpushare-dra-claims"
CLAIM_WEBHOOK_NAME = "claims.gpu.gpushare.io"
CLAIM_PATH = "/validate-claims"
ASKS_GPUSHARE_CLASS = (
    "has(object.spec.devices) && has(object.spec.devices.requests) && object.spec.devices.requests.exists(r, "
    f"(has(r.exactly) && r.exactly.deviceClassName == '{DEVICE_CLASS}') || "
    f"(has(r.firstAvailable) && r.firstAvailable.exists(s, s.deviceClassName == '{DEVICE_CLASS}')))"
)
"""The claim webhook's match condition: a request (or an alternative of it) asks the gpushare device class."""


def claim_webhook_configuration(client_config: dict[str, Any]) -> dict[str, Any]:
    """The `admissionregistration.k8s.io/v1` ValidatingWebhookConfiguration that counts every gpushare ResourceClaim
    being created against its namespace's GiB quota in the ledger (hand-written claims, and the claims the
    resourceclaim controller makes from templates).

    Validating, not mutating: only then has kube-apiserver set the claim's UID and generated name
    (`Store.create` fills them before the validating admission it runs; apiserver@v0.37.2
    pkg/registry/generic/registry/store.go). Every namespace (a quota may be set on any); `failurePolicy: Fail`, so
    no gpushare claim escapes its quota while no extender answers (the resourceclaim controller retries);
    `sideEffects: NoneOnDryRun` (the hold is recorded unless the request is a dry run)."""
    return {
        "apiVersion": "admissionregistration.k8s.io/v1",
        "kind": "ValidatingWebhookConfiguration",
        "metadata": {"name": CLAIM_CONFIGURATION_NAME},
        "webhooks": [
            {
                "name": CLAIM_WEBHOOK_NAME,
                "clientConfig": client_config,
                "rules": [
                    {
                        "operations": ["CREATE"],
                        "apiGroups": ["resource.k8s.io"],
                        "apiVersions": ["v1"],
                        "resources": ["resourceclaims"],
                        "scope": "Namespaced",
                    }
                ],
                "matchConditions": [{"name": "asks-gpushare-gpus", "expression": ASKS_GPUSHARE_CLASS}],
                "failurePolicy": "Fail",
                "matchPolicy": "Equivalent",
                "sideEffects": "NoneOnDryRun",
                "timeoutSeconds": TIMEOUT_S,
                "admissionReviewVersions": ["v1"],
            }
        ],
    }
