"""kube-scheduler's extender wire format (PascalCase, nulls for unset pointers), read defensively."""

from __future__ import annotations

import json
from collections.abc import Iterable
from dataclasses import dataclass
from itertools import repeat
from json.encoder import encode_basestring  # type: ignore[attr-defined]
from operator import getitem
from typing import Any

DEFAULT_PREFIX = "/gpushare-scheduler"  # where the verbs are served (the scheduler configuration's urlPrefix)
# The largest body a real kube-scheduler sends at 5,000 nodes with nodeCacheCapable: true (the pod and every
# feasible node's name) is measured by `python -m bench --only request_size` (docs/benchmarks.md); this stays
# above it also with 253-character node names and a pod at etcd's 1.5 MiB object limit.
DEFAULT_MAX_BODY_BYTES = 4 * 1024 * 1024


class WireError(ValueError):
    """A request body that is not what kube-scheduler sends (answered 400 with the reason)."""


def load_json(body: bytes) -> dict[str, Any]:
    """Parse a request body that must be a JSON object."""
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as exc:
        raise WireError(f"body is not JSON: {exc}") from None
    if not isinstance(value, dict):
        raise WireError("body must be a JSON object")
    return value


_SCORE_TAILS = [f',"Score":{s}}}' for s in range(11)]
_HOST_ROWS: dict[str, tuple[str, ...]] = {}  # host -> its rendered {"Host": ..., "Score": s} for s in 0..10
_HOST_ROWS_MAX = 100_000


def _tail(score: int) -> str:
    if type(score) is int and 0 <= score <= 10:
        return _SCORE_TAILS[score]
    return ',"Score":' + json.dumps(score, allow_nan=False) + "}"


def _host_rows(host: str) -> tuple[str, ...]:
    head = '{"Host":' + encode_basestring(host)
    rows = tuple(head + tail for tail in _SCORE_TAILS)
    if len(_HOST_ROWS) >= _HOST_ROWS_MAX:  # node names churn only with the cluster; start over if they did
        _HOST_ROWS.clear()
    _HOST_ROWS[host] = rows
    return rows


def dump_priorities(scores: Iterable[tuple[str, int]]) -> bytes:
    """`HostPriorityList` (`[{"Host": ..., "Score": ...}]`), byte for byte what `dump_json` gives, ~10x faster.

    Each host's eleven possible entries (scores 0..10) are rendered once and kept, so an answer for 5,000
    hosts is a lookup and a join per host, at C level. Other scores are rendered per entry.
    """
    pairs = scores if isinstance(scores, list) else list(scores)
    if not pairs:
        return b"[]"
    hosts, values = zip(*pairs, strict=True)
    if not all(type(v) is int and 0 <= v <= 10 for v in set(values)):
        heads = map(str.__add__, repeat('{"Host":'), map(encode_basestring, hosts))
        return ("[" + ",".join(map(str.__add__, heads, map(_tail, values))) + "]").encode("utf-8")
    rows = list(map(_HOST_ROWS.get, hosts))
    if not all(rows):
        rows = [r if r is not None else _host_rows(h) for r, h in zip(rows, hosts, strict=True)]
    return ("[" + ",".join(map(getitem, rows, values)) + "]").encode("utf-8")  # type: ignore[arg-type]  # rows: all set


@dataclass(frozen=True)
class ExtenderArgs:
    """`ExtenderArgs`: the pod and the candidate nodes, by name (nodeCacheCapable) or as Node objects."""

    pod: dict[str, Any]
    node_names: list[str]
    nodes: list[dict[str, Any]] | None  # the Node objects when sent (nodeCacheCapable: false)


def _pod(raw: dict[str, Any]) -> dict[str, Any]:
    pod = raw.get("Pod", raw.get("pod"))
    if not isinstance(pod, dict):
        raise WireError("Pod is missing or not an object")
    meta = pod.get("metadata")
    if not isinstance(meta, dict) or not isinstance(meta.get("name"), str):
        raise WireError("Pod.metadata.name is missing")
    if not isinstance(meta.get("annotations") or {}, dict):
        raise WireError("Pod.metadata.annotations must be an object")
    return pod


def _field(item: Any, *path: str) -> Any:
    """`item[path[0]][path[1]]...`, or None where an object along the way is missing or not an object."""
    for key in path:
        if not isinstance(item, dict):
            return None
        item = item.get(key)
    return item


def _all_strings(values: list[Any]) -> bool:
    """True when every item is a string (str.join checks that in C: ~20x a Python loop on 5,000 names)."""
    try:
        "".join(values)
    except TypeError:
        return False
    return True


def parse_extender_args(raw: dict[str, Any]) -> ExtenderArgs:
    """Read filter / prioritize arguments."""
    pod = _pod(raw)
    names = raw.get("NodeNames", raw.get("nodenames"))
    node_list = raw.get("Nodes", raw.get("nodes"))
    if names is not None:
        if not isinstance(names, list) or not _all_strings(names):
            raise WireError("NodeNames must be a list of strings")
        return ExtenderArgs(pod, names, None)
    if node_list is not None:
        if not isinstance(node_list, dict):
            raise WireError("Nodes must be a NodeList object")
        items = node_list.get("items") or []
        if not isinstance(items, list):
            raise WireError("Nodes.items must be a list")
        out_names = []
        for item in items:
            meta = item.get("metadata") if isinstance(item, dict) else None  # inline: runs once per node
            name = meta.get("name") if isinstance(meta, dict) else None
            if not isinstance(name, str):
                raise WireError("every node in Nodes.items needs metadata.name")
            out_names.append(name)
        return ExtenderArgs(pod, out_names, items)
    return ExtenderArgs(pod, [], None)


def filter_result(
    args: ExtenderArgs,
    passed: list[str],
    failed: dict[str, str],
    unresolvable: dict[str, str],
    error: str = "",
) -> dict[str, Any]:
    """`ExtenderFilterResult` in the same node mode as the request."""
    if args.nodes is not None:
        keep = set(passed)
        nodes: dict[str, Any] | None = {
            "metadata": {},
            "items": [n for n in args.nodes if n["metadata"]["name"] in keep],
        }
        names = None
    else:
        nodes, names = None, passed
    return {
        "Nodes": nodes,
        "NodeNames": names,
        "FailedNodes": failed,
        "FailedAndUnresolvableNodes": unresolvable,
        "Error": error,
    }


BINDING_KEYS = ("PodName", "PodNamespace", "PodUID", "Node")


@dataclass(frozen=True)
class BindingArgs:
    """`ExtenderBindingArgs`."""

    pod_name: str
    pod_namespace: str
    pod_uid: str
    node: str


def parse_binding_args(raw: dict[str, Any]) -> BindingArgs:
    """Read bind arguments: all four fields are required non-empty strings."""
    values = []
    for key in BINDING_KEYS:
        value = raw.get(key, raw.get(key.lower()))
        if not isinstance(value, str) or not value or len(value) > 253:
            raise WireError(f"{key} must be a non-empty string")
        values.append(value)
    return BindingArgs(*values)


@dataclass(frozen=True)
class PreemptionArgs:
    """`ExtenderPreemptionArgs`: candidate victims per node (UIDs), with their PDB violation counts."""

    pod: dict[str, Any]
    victims: dict[str, tuple[list[str], int]]
    meta: bool  # True when the request used NodeNameToMetaVictims


def parse_preemption_args(raw: dict[str, Any]) -> PreemptionArgs:
    """Read preempt arguments from NodeNameToMetaVictims or, failing that, NodeNameToVictims."""
    pod = _pod(raw)
    meta = raw.get("NodeNameToMetaVictims")
    full = raw.get("NodeNameToVictims")
    source, is_meta = (meta, True) if meta is not None else (full, False)
    if source is None:
        return PreemptionArgs(pod, {}, True)
    if not isinstance(source, dict):
        raise WireError("NodeNameToMetaVictims / NodeNameToVictims must be an object")
    victims: dict[str, tuple[list[str], int]] = {}
    for node, entry in source.items():
        if not isinstance(entry, dict):
            raise WireError(f"victims of node {node} must be an object")
        pods = entry.get("Pods") or []
        pdb = entry.get("NumPDBViolations") or 0
        if not isinstance(pods, list) or not isinstance(pdb, int) or isinstance(pdb, bool):
            raise WireError(f"victims of node {node}: Pods must be a list, NumPDBViolations an integer")
        uids = []
        for p in pods:
            uid = _field(p, "UID") if is_meta else _field(p, "metadata", "uid")
            if not isinstance(uid, str) or not uid:
                raise WireError(f"a victim on node {node} has no UID")
            uids.append(uid)
        victims[node] = (uids, pdb)
    return PreemptionArgs(pod, victims, is_meta)


# ----------------------------------------------------------------------------------------- OpenAPI
# The wire format as JSON Schema, for the extender's OpenAPI document (/openapi.json) and schemathesis.
# Documentation only: the parsers above stay the authority (they also take kube-scheduler's lower-case
# aliases, and refuse an unreadable GPU request in-band, in the answer's `Error`).

_STRING_MAP = {"type": "object", "additionalProperties": {"type": "string"}}
_QUANTITIES = {"type": ["object", "null"], "additionalProperties": {"type": ["string", "integer"]}}
_CONTAINER = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "restartPolicy": {"type": ["string", "null"], "description": "Always on an init container: a sidecar"},
        "resources": {
            "type": ["object", "null"],
            "properties": {"limits": _QUANTITIES, "requests": _QUANTITIES},
        },
    },
}
_OBJECT_META = {
    "type": "object",
    "required": ["name"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": ["string", "null"]},
        "uid": {"type": ["string", "null"]},
        "annotations": {"type": ["object", "null"], "additionalProperties": {"type": "string"}},
    },
}
POD_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "The core/v1 Pod being scheduled; only metadata, the containers' resources and restartPolicy, "
    "and the scheduling gates are read.",
    "required": ["metadata"],
    "properties": {
        "metadata": _OBJECT_META,
        "spec": {
            "type": ["object", "null"],
            "properties": {
                "containers": {"type": ["array", "null"], "items": _CONTAINER},
                "initContainers": {"type": ["array", "null"], "items": _CONTAINER},
                "schedulingGates": {
                    "type": ["array", "null"],
                    "items": {"type": "object", "required": ["name"], "properties": {"name": {"type": "string"}}},
                },
            },
        },
    },
}
_NODE_LIST = {
    "type": ["object", "null"],
    "description": "A core/v1 NodeList (nodeCacheCapable: false); every item needs metadata.name.",
    "properties": {
        "items": {
            "type": ["array", "null"],
            "items": {"type": "object", "required": ["metadata"], "properties": {"metadata": _OBJECT_META}},
        }
    },
}
_NODE_NAMES = {"type": ["array", "null"], "items": {"type": "string"}}

EXTENDER_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderArgs: the pod and the candidate nodes, by name (NodeNames) or as a NodeList (Nodes).",
    "required": ["Pod"],
    "properties": {"Pod": POD_SCHEMA, "Nodes": _NODE_LIST, "NodeNames": _NODE_NAMES},
}
BINDING_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderBindingArgs: which pod to bind to which node.",
    "required": ["PodName", "PodNamespace", "PodUID", "Node"],
    "properties": {key: {"type": "string", "minLength": 1, "maxLength": 253} for key in BINDING_KEYS},
}


def _victims(pod: dict[str, Any]) -> dict[str, Any]:
    """The victims of one node (MetaVictims or Victims), with `pod` as the schema of each victim."""
    return {
        "type": "object",
        "properties": {
            "Pods": {"type": ["array", "null"], "items": pod},
            "NumPDBViolations": {"type": ["integer", "null"]},
        },
    }


_UID = {"type": "string", "minLength": 1}
_META_VICTIMS = _victims({"type": "object", "required": ["UID"], "properties": {"UID": _UID}})
_FULL_VICTIMS = _victims(
    {
        "type": "object",
        "required": ["metadata"],
        "properties": {"metadata": {"type": "object", "required": ["uid"], "properties": {"uid": _UID}}},
    }
)
PREEMPTION_ARGS_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderPreemptionArgs: candidate victims per node, by UID (NodeNameToMetaVictims) or as Pods.",
    "required": ["Pod"],
    "properties": {
        "Pod": POD_SCHEMA,
        "NodeNameToMetaVictims": {"type": ["object", "null"], "additionalProperties": _META_VICTIMS},
        "NodeNameToVictims": {"type": ["object", "null"], "additionalProperties": _FULL_VICTIMS},
    },
}

ERROR_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "A refused request: `error` names the problem (`Error` repeats it where kube-scheduler reads it).",
    "required": ["error"],
    "properties": {"error": {"type": "string", "minLength": 1}, "Error": {"type": "string"}},
}
FILTER_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderFilterResult, in the request's node mode; `Error` is set when the pod cannot be read.",
    "required": ["Nodes", "NodeNames", "FailedNodes", "FailedAndUnresolvableNodes", "Error"],
    "properties": {
        "Nodes": {"type": ["object", "null"], "properties": {"items": {"type": "array", "items": {"type": "object"}}}},
        "NodeNames": {"type": ["array", "null"], "items": {"type": "string"}},
        "FailedNodes": _STRING_MAP,
        "FailedAndUnresolvableNodes": _STRING_MAP,
        "Error": {"type": "string"},
    },
}
HOST_PRIORITY_LIST_SCHEMA: dict[str, Any] = {
    "type": "array",
    "description": "HostPriorityList: a score from 0 to 10 for every node asked about.",
    "items": {
        "type": "object",
        "required": ["Host", "Score"],
        "properties": {"Host": {"type": "string"}, "Score": {"type": "integer", "minimum": 0, "maximum": 10}},
    },
}
BINDING_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderBindingResult: `Error` is empty once the pod is bound.",
    "required": ["Error"],
    "properties": {"Error": {"type": "string"}},
}
PREEMPTION_RESULT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "ExtenderPreemptionResult: the nodes where preemption helps, with the victims to evict.",
    "required": ["NodeNameToMetaVictims"],
    "properties": {"NodeNameToMetaVictims": {"type": "object", "additionalProperties": _META_VICTIMS}},
}
_INSPECT_POD = {
    "type": "object",
    "required": ["name", "namespace", "uid", "state", "usedGPU"],
    "properties": {
        "name": {"type": "string"},
        "namespace": {"type": "string"},
        "uid": {"type": "string"},
        "state": {"type": "string"},
        "usedGPU": {"type": "integer", "minimum": 0},
    },
}
_INSPECT_GPU = {
    "type": "object",
    "required": ["id", "uuid", "model", "healthy", "totalGPU", "usedGPU", "pods"],
    "properties": {
        "id": {"type": "integer", "minimum": 0},
        "uuid": {"type": "string"},
        "model": {"type": "string"},
        "healthy": {"type": "boolean"},
        "totalGPU": {"type": "integer", "minimum": 0},
        "usedGPU": {"type": "integer", "minimum": 0},
        "pods": {"type": "array", "items": _INSPECT_POD},
    },
}
INSPECT_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "gpushare's inspect JSON: GPU memory in the configured unit, per node and per GPU.",
    "required": ["nodes"],
    "properties": {
        "nodes": {
            "type": "array",
            "items": {
                "type": "object",
                "required": ["name", "totalGPU", "usedGPU", "devs"],
                "properties": {
                    "name": {"type": "string"},
                    "totalGPU": {"type": "integer", "minimum": 0},
                    "usedGPU": {"type": "integer", "minimum": 0},
                    "devs": {"type": "array", "items": _INSPECT_GPU},
                },
            },
        }
    },
}
