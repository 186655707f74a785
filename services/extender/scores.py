"""Scores computed by filter, kept for the prioritize call that follows for the same pod and view.

kube-scheduler calls prioritize right after filter with (a subset of) the nodes filter passed; when the
view has not changed in between (same `ClusterView.version`) and the pod's demand is the same, the scores
filter computed are still exact, so prioritize answers from them instead of recomputing.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

from shared.placement import PodDemand, Policy


class NodeScores:
    """Scores in the order of `names` (the nodes filter passed); a by-name dict is built only when asked."""

    __slots__ = ("_by_name", "names", "values")

    def __init__(self, names: Sequence[str], values: list[int]) -> None:
        self.names = names
        self.values = values
        self._by_name: dict[str, int] | None = None

    def aligned(self, names: Sequence[str]) -> list[int | None]:
        """The score of each of `names` (None where unknown); no per-name work when they are filter's list."""
        if names == self.names:  # kube-scheduler sends prioritize exactly the nodes filter passed
            return self.values  # type: ignore[return-value]
        if self._by_name is None:
            self._by_name = dict(zip(self.names, self.values, strict=True))
        return list(map(self._by_name.get, names))


class ScoreCache:
    """Bounded LRU: pod UID -> (view version, policy, demand, NodeScores)."""

    def __init__(self, size: int = 256) -> None:
        self.size = size
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, tuple[int, Policy, PodDemand, NodeScores]] = OrderedDict()

    def put(self, demand: PodDemand, version: int, policy: Policy, scores: NodeScores) -> None:
        """Keep the scores computed for this pod at this view version."""
        if not demand.uid:
            return
        self._entries[demand.uid] = (version, policy, demand, scores)
        self._entries.move_to_end(demand.uid)
        while len(self._entries) > self.size:
            self._entries.popitem(last=False)

    def get(self, demand: PodDemand, version: int, policy: Policy) -> NodeScores | None:
        """The scores kept for this pod, if they were computed at this version for the same demand."""
        entry = self._entries.get(demand.uid) if demand.uid else None
        if entry is None or entry[0] != version or entry[1] is not policy or entry[2] != demand:
            self.misses += 1
            return None
        self.hits += 1
        return entry[3]
