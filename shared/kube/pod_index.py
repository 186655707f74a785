"""Pods as a list-then-watch last showed them, by namespace/name (pure: fed `shared.kube.watching` events).

Each (re)list ends with `synced()`: entries neither listed nor changed since the previous one belong to pods
deleted while the watch was down, and are dropped. Until the first list completes the index answers nothing,
so a caller falls back to reading the pod. What is kept of each pod is the caller's choice (`keep`: a summary,
the whole object, or None for a pod not worth keeping), and `max_entries` bounds the index: past it, new pods
are not kept (their readers fall back to the API server) until entries leave.
"""

from __future__ import annotations

from collections.abc import Callable

from shared.kube import pods
from shared.kube.pods import Pod
from shared.kube.watching import DELETED


class PodIndex:
    """namespace/name -> `keep(pod)`, fed by watch events. A stale entry can only make a later API call fail
    (the pod is gone, or bound elsewhere), and every reader settles that by reading the pod."""

    def __init__(self, keep: Callable[[Pod], Pod | None], *, max_entries: int | None = None) -> None:
        self.keep = keep
        self.max_entries = max_entries
        self.ready = False
        self.skipped = 0  # pods not kept because the index was full
        self._cycle = 0
        self._pods: dict[tuple[str, str], tuple[int, Pod]] = {}
        self._uids: dict[str, tuple[str, str]] = {}  # pod UID -> namespace/name (of the entry kept, or a stale one)

    def __len__(self) -> int:
        return len(self._pods)

    def update(self, event_type: str, pod: Pod) -> None:
        """Apply one ADDED / MODIFIED / DELETED event."""
        meta = pods.metadata(pod)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        kept = None if event_type == DELETED else self.keep(pod)
        if kept is None:
            current = self._pods.get(key)
            # a same-named replacement may arrive before the old pod's DELETED: that event removes nothing
            if current is not None and (event_type != DELETED or pods.pod_uid(current[1]) == pods.pod_uid(pod)):
                del self._pods[key]
            self._uids.pop(pods.pod_uid(pod), None)
            return
        if key not in self._pods and self.max_entries is not None and len(self._pods) >= self.max_entries:
            self.skipped += 1
            return
        self._pods[key] = (self._cycle, kept)
        self._uids[pods.pod_uid(pod)] = key

    def synced(self) -> None:
        """A (re)list finished: forget what it did not list (and nothing changed since), then answer."""
        self._pods = {k: v for k, v in self._pods.items() if v[0] >= self._cycle}
        self._uids = {u: k for u, k in self._uids.items() if k in self._pods}
        self._cycle += 1
        self.ready = True

    def reset(self) -> None:
        """Forget everything and answer nothing until the next list finishes (the watch stopped)."""
        self._pods = {}
        self._uids = {}
        self.ready = False

    def get(self, namespace: str, name: str) -> Pod | None:
        """The pod as last seen, or None when unknown (or before the first list finished)."""
        if not self.ready:
            return None
        entry = self._pods.get((namespace, name))
        return entry[1] if entry is not None else None

    def by_uid(self, uid: str) -> Pod | None:
        """The pod with this UID as last seen (what `keep` kept of it), or None when unknown."""
        key = self._uids.get(uid)
        pod = self.get(*key) if key is not None else None
        return pod if pod is not None and pods.pod_uid(pod) == uid else None
