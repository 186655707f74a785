"""What the binder's pod watch last saw of each GPU pod, so that binding need not GET the pod first.

On API servers that ignore a Binding's `metadata.uid` (1.20-1.22, 1.25-1.26) the binder must check that the
pod is still the one reserved for, unbound and alive before it binds. The pod watch already delivers every
GPU pod; this index keeps the few fields `decide` reads, per namespace/name, and answers only while the
watch is synced. A pod it has not seen yet (the watch may trail the scheduler by milliseconds) is read
from the API server as before, and any refusal of the Binding is still settled by reading the pod.
"""

from __future__ import annotations

from typing import Any

from shared.kube import pods
from shared.kube.pods import Pod
from shared.kube.watching import DELETED


def summary(pod: Pod) -> Pod:
    """The fields of a pod that `services.binder.decide.decide` reads (pure)."""
    meta = pods.metadata(pod)
    kept_meta: dict[str, Any] = {"uid": meta.get("uid"), "name": meta.get("name"), "namespace": meta.get("namespace")}
    if meta.get("deletionTimestamp"):
        kept_meta["deletionTimestamp"] = meta["deletionTimestamp"]
    return {
        "metadata": kept_meta,
        "spec": {"nodeName": pods.node_name(pod)},
        "status": {"phase": pods.phase(pod)},
    }


class PodIndex:
    """namespace/name -> `summary` of the pod, fed by watch events.

    Each (re)list ends with `synced()`: entries neither listed nor changed since the previous one belong to
    pods deleted while the watch was down, and are dropped. A stale entry can only make a Binding fail
    (the pod is gone, or bound elsewhere): the binder then reads the pod, as without the index.
    """

    def __init__(self) -> None:
        self.ready = False
        self._cycle = 0
        self._pods: dict[tuple[str, str], tuple[int, Pod]] = {}

    def __len__(self) -> int:
        return len(self._pods)

    def update(self, event_type: str, pod: Pod) -> None:
        """Apply one ADDED / MODIFIED / DELETED event."""
        meta = pods.metadata(pod)
        key = (str(meta.get("namespace") or ""), str(meta.get("name") or ""))
        if event_type == DELETED:
            current = self._pods.get(key)
            if current is not None and pods.pod_uid(current[1]) == pods.pod_uid(pod):
                del self._pods[key]
            return
        self._pods[key] = (self._cycle, summary(pod))

    def synced(self) -> None:
        """A (re)list finished: forget what it did not list (and nothing changed since), then answer."""
        self._pods = {k: v for k, v in self._pods.items() if v[0] >= self._cycle}
        self._cycle += 1
        self.ready = True

    def get(self, namespace: str, name: str) -> Pod | None:
        """The pod as last seen, or None when unknown (or before the first list finished)."""
        if not self.ready:
            return None
        entry = self._pods.get((namespace, name))
        return entry[1] if entry is not None else None
