"""The prioritize verb: a 0..10 score per node, reusing the scores filter kept for the same pod and view."""

from __future__ import annotations

from services.extender.scores import ScoreCache
from services.extender.view import ClusterView
from services.extender.wire import ExtenderArgs
from shared.placement import DemandError, Policy, parse_pod
from shared.placement.columns import score_list
from shared.settings import MemoryUnit


def prioritize(
    view: ClusterView, scores: ScoreCache, args: ExtenderArgs, *, unit: MemoryUnit, policy: Policy
) -> list[tuple[str, int]]:
    """Answer a prioritize call: (host, score) for every node asked about (the wire's [{Host, Score}])."""
    try:
        demand = parse_pod(args.pod, unit)
    except DemandError:
        return [(n, 0) for n in args.node_names]
    names = args.node_names
    nodes = view.nodes
    cached = scores.get(demand, view.version, policy)
    if cached is None:
        return list(zip(names, score_list(view.columns, nodes, names, demand, policy), strict=True))
    found = cached.aligned(names)
    if None in found:  # nodes filter did not pass (or did not see) are scored now
        missing = [n for n, s in zip(names, found, strict=True) if s is None]
        more = dict(zip(missing, score_list(view.columns, nodes, missing, demand, policy), strict=True))
        found = [more[n] if s is None else s for n, s in zip(names, found, strict=True)]
    return list(zip(names, found, strict=True))  # type: ignore[arg-type]  # every None was scored above
