"""Pure decisions of the binder: what to do with a reservation given the ledger and the pod as they are."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from shared.kube import pods
from shared.kube.pods import Pod
from shared.ledger.rules import AllocationState


class Action(StrEnum):
    """What the binder does with one reservation."""

    BIND = "bind"  # POST the Binding, then mark bound
    MARK_BOUND = "mark_bound"  # the pod already sits on the reserved node: record it
    FAIL = "fail"  # the Binding cannot be made: mark failed (capacity goes back)
    SKIP = "skip"  # nothing to do (duplicate delivery, or the allocation moved on)


@dataclass(frozen=True)
class Decision:
    """An action and why (`outcome` is the metric's reason label)."""

    action: Action
    outcome: str
    reason: str = ""


def decide(*, state: str | None, pod: Pod | None, pod_uid: str, node: str) -> Decision:
    """Decide from the allocation's ledger `state` and the pod as the API server returned it (None: gone)."""
    if state is None:
        return Decision(Action.SKIP, "skipped_unknown", "the ledger has no such allocation")
    if state in (AllocationState.BOUND, AllocationState.ASSIGNED):
        return Decision(Action.SKIP, "skipped_already_done", f"allocation is already {state}")
    if state != AllocationState.RESERVED:
        return Decision(Action.SKIP, "skipped_ended", f"allocation already ended ({state})")
    if pod is None:
        return Decision(Action.FAIL, "failed_pod_gone", "pod no longer exists")
    if pods.pod_uid(pod) != pod_uid:
        return Decision(Action.FAIL, "failed_uid_changed", f"pod was replaced (UID is now {pods.pod_uid(pod)})")
    current = pods.node_name(pod)
    if current == node:
        return Decision(Action.MARK_BOUND, "already_bound", f"pod is already bound to {node}")
    if current:
        return Decision(Action.FAIL, "failed_bound_elsewhere", f"pod is bound to another node ({current})")
    if pods.is_terminating(pod):
        return Decision(Action.FAIL, "failed_terminating", "pod is being deleted")
    if pods.is_terminated(pod):
        return Decision(Action.FAIL, "failed_terminated", f"pod already {pods.phase(pod)}")
    return Decision(Action.BIND, "bound", f"binding to {node}")


def binding_checks_uid(major: str, minor: str) -> bool:
    """True when an API server of this version refuses a Binding whose `metadata.uid` is not the pod's.

    The precondition came in 1.23 (kubernetes#105913), was lost in 1.25 (#110646) and restored in 1.27
    (#116550, backported to some 1.26 patches only): 1.23, 1.24 and 1.27+ enforce it. Unknown: False.
    """
    try:
        version = (int(major), int("".join(c for c in minor if c.isdigit()) or "x"))
    except ValueError:
        return False
    return (1, 23) <= version < (1, 25) or version >= (1, 27)
