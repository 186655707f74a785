"""Per-node columns for the common case at thousands of nodes: filter and score without a Python loop.

kube-scheduler sends every candidate node's name with each filter and prioritize call (NodeNames mode),
so at 5,000 nodes a per-node Python step costs milliseconds. For a pod with one container asking memory
only on one GPU (the usual gpushare pod), fitting depends on a node's freest healthy GPU alone and the
score on its (allocated, total) healthy memory, so both are kept as columns keyed by node name and
evaluated with C-level `map` / `compress`. Everything else goes through `filter_nodes` / `score_nodes`.
The answers are the same (`tests/placement/test_columns.py` checks it).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from itertools import compress, repeat

from shared.placement.demand import PodDemand
from shared.placement.hints import Policy
from shared.placement.plan import score_nodes, score_value
from shared.placement.view import NodeView

_KEY_BITS = 42
_TOTAL_MASK = (1 << _KEY_BITS) - 1
_UNKNOWN = -1  # max free memory of a name the columns do not hold: below any need


class NodeColumns:
    """`max_free` (MiB on the freest healthy GPU) and `score_key` of each node, kept beside the node views."""

    def __init__(self, nodes: Iterable[NodeView] = ()) -> None:
        self.max_free: dict[str, int] = {}
        self.score_key: dict[str, int | None] = {}
        for node in nodes:
            self.put(node)

    def put(self, node: NodeView) -> None:
        """Add or replace a node's entries."""
        self.max_free[node.name] = node.max_free_memory_mib
        self.score_key[node.name] = node.score_key

    def drop(self, name: str) -> None:
        """Forget a node."""
        self.max_free.pop(name, None)
        self.score_key.pop(name, None)


def columns_apply(demand: PodDemand) -> bool:
    """True when `split_fitting` decides this pod exactly: one container, one GPU, memory only, no hints."""
    return demand.wants_gpu and demand.memory_only


def split_fitting(columns: NodeColumns, names: Sequence[str], need_mib: int) -> tuple[list[str], list[str]]:
    """(names whose freest healthy GPU holds `need_mib`, the others in order) for a `columns_apply` pod.

    The others include names the columns do not hold; the caller explains each of them.
    """
    fits = list(map(need_mib.__le__, map(columns.max_free.get, names, repeat(_UNKNOWN))))
    passed = list(compress(names, fits))
    if len(passed) == len(names):
        return passed, []
    return passed, [n for n, ok in zip(names, fits, strict=True) if not ok]


def score_list(
    columns: NodeColumns,
    nodes: Mapping[str, NodeView],
    names: Sequence[str],
    demand: PodDemand,
    policy: Policy = Policy.BINPACK,
) -> list[int]:
    """`score_nodes` for `names`, in their order (0 for a name with no node), once per distinct score key."""
    keys = list(map(columns.score_key.get, names))
    distinct = set(keys)
    if None in distinct:  # an unknown name or a key out of range: the per-node path decides
        scored = dict(score_nodes([nodes[n] for n in names if n in nodes], demand, policy))
        return [scored.get(n, 0) for n in names]
    need = demand.memory_mib if demand.wants_gpu else 0
    binpack = (demand.hints.policy or policy) is Policy.BINPACK
    table = {k: score_value(k >> _KEY_BITS, k & _TOTAL_MASK, need, binpack) for k in distinct}  # type: ignore[operator]
    return list(map(table.__getitem__, keys))
