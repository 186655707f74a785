"""Scores kept from filter for prioritize: answered by position when kube-scheduler sends filter's list."""

from __future__ import annotations

from services.extender.scores import NodeScores


def test_the_same_names_get_the_kept_list_and_others_are_looked_up() -> None:
    scores = NodeScores(["a", "b", "c"], [3, 7, 5])
    assert scores.aligned(["a", "b", "c"]) == [3, 7, 5]
    assert scores.aligned(["c", "a"]) == [5, 3]  # another order or a subset: by name
    assert scores.aligned(["b", "zz"]) == [7, None]  # a node filter never scored
    assert scores.aligned([]) == []
