"""The filter verb: which of the offered nodes can hold the pod's GPU request, and why the others cannot."""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

from services.extender import metrics
from services.extender.pods import PodCache
from services.extender.refusals import RefusalPublisher
from services.extender.scores import NodeScores, ScoreCache
from services.extender.view import DRA_NODE, NO_INVENTORY, ClusterView
from services.extender.wire import ExtenderArgs, filter_result
from shared.placement import DemandError, PodDemand, Policy, filter_nodes, parse_pod, quota_refusal
from shared.placement.columns import columns_apply, score_list, split_fitting
from shared.settings import MemoryUnit

log = logging.getLogger(__name__)

Verdicts = tuple[list[str], dict[str, str], dict[str, str]]  # (fit, full now, never fit)


@dataclass
class Filter:
    """Answers filter calls from the view; remembers each pod for bind and keeps the scores for prioritize."""

    view: ClusterView
    scores: ScoreCache
    pods: PodCache
    refusals: RefusalPublisher
    unit: MemoryUnit
    policy: Policy

    async def __call__(self, args: ExtenderArgs) -> dict[str, Any]:
        """Answer a filter call."""
        self.pods.remember(args.pod)
        try:
            demand = parse_pod(args.pod, self.unit)
        except DemandError as exc:
            metrics.REFUSALS.labels(reason="invalid_request").inc()
            return filter_result(args, [], {}, {}, error=f"invalid GPU request: {exc}")
        if demand.gated:  # kube-scheduler does not send gated pods; whoever did gets no place and no refusal
            return filter_result(args, [], {}, {}, error=demand.gated_reason())
        if not demand.wants_gpu:
            return filter_result(args, list(args.node_names), {}, {})
        passed: list[str] = []
        failed: dict[str, str] = {}
        never: dict[str, str] = {}
        quota = self.view.quotas.get(demand.namespace)
        over = quota_refusal(demand, self.view.namespace_usage(demand.namespace), quota) if quota else None
        if over is not None:
            failed = {name: over for name in args.node_names}
            metrics.NODE_DECISIONS.labels(reason="quota").inc(len(failed))
        else:
            filtered = self._by_columns if columns_apply(demand) else self._by_nodes
            passed, failed, never = filtered(args.node_names, demand)
            metrics.NODE_DECISIONS.labels(reason="fits").inc(len(passed))
            metrics.NODE_DECISIONS.labels(reason="full").inc(len(failed))
            metrics.NODE_DECISIONS.labels(reason="never_fits").inc(len(never))
        if self.view.dra_nodes:  # one GPU, one path: the DRA path serves these nodes (docs/dra.md)
            passed, failed, never = without_dra_nodes(self.view.dra_nodes, passed, failed, never)
        if not passed:
            reason = "quota" if over else ("full" if failed else "never_fits")
            metrics.REFUSALS.labels(reason=reason).inc()
            await self.refusals.publish(demand, over, {**never, **failed})
        return filter_result(args, passed, failed, never)

    def _by_nodes(self, names: list[str], demand: PodDemand) -> Verdicts:
        """(fit, full now, never fit) by the placement core, node by node; keeps the scores for prioritize."""
        nodes, version = self.view.nodes, self.view.version
        never: dict[str, str] = {}
        if all(map(nodes.__contains__, names)):  # C-speed check (`None in` would call NodeView.__eq__)
            known = list(map(nodes.__getitem__, names))
        else:
            known = []
            for name in names:
                node = nodes.get(name)
                if node is None:
                    never[name] = NO_INVENTORY
                else:
                    known.append(node)
        passed, failed, found_never = filter_nodes(known, demand, self.policy)
        never.update(found_never)
        self._keep_scores(passed, demand, version)
        return passed, failed, never

    def _by_columns(self, names: list[str], demand: PodDemand) -> Verdicts:
        """`_by_nodes` for a one-GPU, memory-only pod, from the view's columns (same answers, C-level loops)."""
        view, version = self.view, self.view.version
        passed, rest = split_fitting(view.columns, names, demand.containers[0].memory_mib)
        failed: dict[str, str] = {}
        never: dict[str, str] = {}
        if rest:  # explained node by node (there are usually few)
            passed_too, failed, never = self._by_nodes(rest, demand)
            if passed_too:  # cannot happen (same rule); the placement core is the authority
                log.warning("node columns were stale for %d node(s), e.g. %s", len(passed_too), passed_too[0])
                passed = [*passed, *passed_too]
        self._keep_scores(passed, demand, version)
        return passed, failed, never

    def _keep_scores(self, passed: list[str], demand: PodDemand, version: int) -> None:
        if len(passed) > 1:  # kube-scheduler prioritizes only when more than one node is left
            scores = NodeScores(passed, score_list(self.view.columns, self.view.nodes, passed, demand, self.policy))
            self.scores.put(demand, version, self.policy, scores)


def without_dra_nodes(
    dra: set[str], passed: list[str], failed: dict[str, str], never: dict[str, str]
) -> tuple[list[str], dict[str, str], dict[str, str]]:
    """Verdicts with every DRA node moved to "never fits" (pure): the extender places nothing there."""
    moved = [n for n in passed if n in dra] + [n for n in failed if n in dra]
    if not moved:
        return passed, failed, never
    return (
        [n for n in passed if n not in dra],
        {n: r for n, r in failed.items() if n not in dra},
        {**never, **dict.fromkeys(moved, DRA_NODE)},
    )
