"""PodDisruptionBudgets as kube-scheduler's preemption reads them (pure).

Mirrors k8s.io/kubernetes v1.37.2 `pkg/scheduler/framework/preemption/util.go`, `FilterVictimsWithPDBViolation`
(`filterPodsWithPDBViolation` in earlier releases): victims are taken in the order given (most important first);
each budget's `status.disruptionsAllowed` is decremented by every victim it selects (in the victim's namespace, by
its label selector; a victim listed in the budget's `status.disruptedPods` is skipped: the API server already
counted it), and a victim that brings a budget below zero violates it. The selector follows
`metav1.LabelSelectorAsSelector`: `matchLabels` and `matchExpressions` (In, NotIn, Exists, DoesNotExist); a
missing, empty or unreadable selector matches nothing.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

_OPERATORS = {"In", "NotIn", "Exists", "DoesNotExist"}


@dataclass(frozen=True)
class Requirement:
    """One term of a label selector."""

    key: str
    operator: str
    values: frozenset[str] = frozenset()

    def matches(self, labels: Mapping[str, str]) -> bool:
        """Whether `labels` satisfy the term (`labels.Requirement.Matches`)."""
        if self.operator == "In":
            return self.key in labels and labels[self.key] in self.values
        if self.operator == "NotIn":
            return self.key not in labels or labels[self.key] not in self.values
        if self.operator == "Exists":
            return self.key in labels
        return self.key not in labels  # DoesNotExist


@dataclass(frozen=True)
class Budget:
    """A PodDisruptionBudget: its namespace, selector (None: matches nothing) and status."""

    namespace: str
    selector: tuple[Requirement, ...] | None
    disruptions_allowed: int
    disrupted_pods: frozenset[str] = field(default_factory=frozenset)

    def selects(self, namespace: str, labels: Mapping[str, str]) -> bool:
        """Whether the budget covers a pod of `namespace` with `labels`."""
        return (
            namespace == self.namespace and bool(self.selector) and all(r.matches(labels) for r in self.selector)  # type: ignore[union-attr]
        )


def parse_selector(raw: object) -> tuple[Requirement, ...] | None:
    """A `metav1.LabelSelector` as a list of terms; None when missing, empty or unreadable (matches nothing)."""
    if not isinstance(raw, Mapping):
        return None
    terms: list[Requirement] = []
    match_labels = raw.get("matchLabels") or {}
    expressions = raw.get("matchExpressions") or []
    if not isinstance(match_labels, Mapping) or not isinstance(expressions, list):
        return None
    for key, value in match_labels.items():
        terms.append(Requirement(str(key), "In", frozenset({str(value)})))
    for expr in expressions:
        if not isinstance(expr, Mapping) or expr.get("operator") not in _OPERATORS:
            return None
        values = expr.get("values") or []
        if not isinstance(values, list):
            return None
        operator = str(expr["operator"])
        if (operator in ("In", "NotIn")) != bool(values):  # In/NotIn need values, Exists/DoesNotExist none
            return None
        terms.append(Requirement(str(expr.get("key") or ""), operator, frozenset(str(v) for v in values)))
    return tuple(terms) or None


def parse_budget(pdb: Mapping[str, Any]) -> Budget:
    """A `policy/v1` PodDisruptionBudget (as the API's JSON) as preemption reads it."""
    meta = pdb.get("metadata") or {}
    spec = pdb.get("spec") or {}
    status = pdb.get("status") or {}
    disrupted = status.get("disruptedPods") or {}
    return Budget(
        namespace=str(meta.get("namespace") or ""),
        selector=parse_selector(spec.get("selector")),
        disruptions_allowed=int(status.get("disruptionsAllowed") or 0),
        disrupted_pods=frozenset(disrupted) if isinstance(disrupted, Mapping) else frozenset(),
    )


class Disruptable(Protocol):
    """What a victim tells the budgets: where it lives, what it is called and labelled."""

    @property
    def namespace(self) -> str: ...
    @property
    def name(self) -> str: ...
    @property
    def labels(self) -> Mapping[str, str]: ...


def violating(victims: Sequence[Disruptable], budgets: Sequence[Budget]) -> list[bool]:
    """For each victim (most important first), whether evicting it violates a budget, counting the victims
    before it as evicted (`FilterVictimsWithPDBViolation`, one pod per victim)."""
    allowed = [b.disruptions_allowed for b in budgets]
    out = []
    for victim in victims:
        hit = False
        if victim.labels:
            for i, budget in enumerate(budgets):
                if not budget.selects(victim.namespace, victim.labels) or victim.name in budget.disrupted_pods:
                    continue
                allowed[i] -= 1
                if allowed[i] < 0:
                    hit = True
                    break  # kube-scheduler stops at the first budget the pod violates
        out.append(hit)
    return out
