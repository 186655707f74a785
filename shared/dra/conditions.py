"""The claim status the binder writes: per allocated gpushare device, the ledger's verdict (pure).

kube-scheduler binds a pod whose claim's devices carry binding conditions only once each condition is `True` in
the claim's `status.devices` entry for that device (driver, pool, device, shareID), and gives up the allocation
when a binding failure condition is `True` (`isClaimReadyForBinding`, pkg/scheduler/framework/plugins/
dynamicresources, v1.37.2). The binder writes the entries with server-side apply (field manager `gpushare-binder`),
so entries of other drivers are left as they are.
"""

from __future__ import annotations

import re
from collections.abc import Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from shared.dra import DRIVER, REFUSED_CONDITION, RESERVED_CONDITION

FIELD_MANAGER = "gpushare-binder"
MAX_MESSAGE = 32_768  # metav1.Condition
_REASON = re.compile(r"^[A-Za-z]([A-Za-z0-9_,:]*[A-Za-z0-9_])?$")

RESERVED = "reserved"
REFUSED = "refused"


def _now() -> str:
    return datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def _reason(reason: str) -> str:
    return reason if _REASON.match(reason) else "Refused"


def _entry_key(result: Mapping[str, Any]) -> tuple[str, str, str, str]:
    return (str(result.get("driver")), str(result.get("pool")), str(result.get("device")), str(result.get("shareID")))


def verdict(claim: Mapping[str, Any], result: Mapping[str, Any]) -> str | None:
    """What the claim's status says about one allocation result: RESERVED, REFUSED or None (nothing yet)."""
    key = _entry_key(result)
    for entry in (claim.get("status") or {}).get("devices") or []:
        if _entry_key(entry) != key:
            continue
        states = {c.get("type"): c.get("status") for c in entry.get("conditions") or []}
        if states.get(REFUSED_CONDITION) == "True":
            return REFUSED
        if states.get(RESERVED_CONDITION) == "True":
            return RESERVED
    return None


def decided(claim: Mapping[str, Any], results: Sequence[Mapping[str, Any]]) -> str | None:
    """RESERVED when every result carries the ledger's reservation, REFUSED when any carries a refusal, else None."""
    verdicts = [verdict(claim, r) for r in results]
    if REFUSED in verdicts:
        return REFUSED
    if verdicts and all(v == RESERVED for v in verdicts):
        return RESERVED
    return None


def _conditions(reserved: bool, reason: str, message: str, at: str, generation: int | None) -> list[dict[str, Any]]:
    message = message[:MAX_MESSAGE]
    out: list[dict[str, Any]] = [
        {"type": RESERVED_CONDITION, "status": "True" if reserved else "False", "reason": reason, "message": message},
        {"type": REFUSED_CONDITION, "status": "False" if reserved else "True", "reason": reason, "message": message},
    ]
    for c in out:
        c["lastTransitionTime"] = at
        if generation is not None:
            c["observedGeneration"] = generation
    return out


def status_apply(
    claim: Mapping[str, Any],
    results: Sequence[Mapping[str, Any]],
    *,
    reserved: bool,
    reason: str,
    message: str,
    data: Mapping[str, Mapping[str, Any]] | None = None,
    now: str | None = None,
) -> dict[str, Any]:
    """The server-side apply body for `resourceclaims/status`: one `status.devices` entry per gpushare result with
    the ledger's verdict (`reserved`: LedgerReserved=True; else LedgerRefused=True with `reason` and `message`).
    `data`: per device name, what the device entry's `data` carries (the GPU's UUID and index, the allocation id)."""
    meta = claim.get("metadata") or {}
    at = now or _now()
    generation = meta.get("generation")
    entries = []
    for r in results:
        if r.get("driver") != DRIVER:
            continue
        entry: dict[str, Any] = {
            "driver": DRIVER,
            "pool": r.get("pool"),
            "device": r.get("device"),
            "conditions": _conditions(reserved, _reason(reason), message, at, generation),
        }
        if r.get("shareID"):
            entry["shareID"] = r["shareID"]
        if data and str(r.get("device")) in data:
            entry["data"] = dict(data[str(r.get("device"))])
        entries.append(entry)
    return {
        "apiVersion": "resource.k8s.io/v1",
        "kind": "ResourceClaim",
        "metadata": {"name": meta.get("name"), "namespace": meta.get("namespace"), "uid": meta.get("uid")},
        "status": {"devices": entries},
    }
