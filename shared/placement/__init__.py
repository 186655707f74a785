"""Pure GPU placement: what a pod asks for, where it fits, how good a node is, which GPUs it gets.

No I/O and no asyncio: the extender, the benchmarks and the tests call the same functions.

    demand = parse_pod(pod_dict, MemoryUnit.GIB)          # DemandError on a bad request
    verdict = evaluate(node_view, demand)                  # Verdict: fits / full now / can never fit
    score = score_node(node_view, demand)                  # 0..10, binpack by default
    placement = pick(node_view, demand)                    # Placement(parts=...) or raises NoFit
    victims = select_victims(node_view, demand, candidates)  # minimal pod UIDs to evict, or None
"""

from shared.placement.demand import ContainerDemand, DemandError, PodDemand, parse_pod, parse_quantity
from shared.placement.hints import HintError, Hints, Policy, parse_hints
from shared.placement.plan import NoFit, Placement, Verdict, evaluate, filter_nodes, fits, pick, score_node, score_nodes
from shared.placement.preempt import Victim, select_victims
from shared.placement.quota import quota_refusal
from shared.placement.view import GpuView, NodeView

__all__ = [
    "ContainerDemand",
    "DemandError",
    "GpuView",
    "HintError",
    "Hints",
    "NoFit",
    "NodeView",
    "Placement",
    "PodDemand",
    "Policy",
    "Verdict",
    "Victim",
    "evaluate",
    "filter_nodes",
    "fits",
    "parse_hints",
    "parse_pod",
    "parse_quantity",
    "pick",
    "quota_refusal",
    "score_node",
    "score_nodes",
    "select_victims",
]
