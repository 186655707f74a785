"""RFC 6902 JSON patch, the part a mutating webhook's answer uses (add, remove, replace), applied as kube-apiserver
applies it (`gopkg.in/evanphx/json-patch.v4`, `DecodePatch` in
`apiserver/pkg/admission/plugin/webhook/mutating/dispatcher.go`): to check the
webhook's patches without a cluster. Unknown paths fail as they fail there."""

from __future__ import annotations

import copy
from typing import Any


class PatchError(ValueError):
    """A patch that does not apply."""


def _tokens(path: str) -> list[str]:
    if not path.startswith("/"):
        raise PatchError(f"path {path!r} does not start with /")
    return [t.replace("~1", "/").replace("~0", "~") for t in path[1:].split("/")]


def _parent(doc: Any, tokens: list[str]) -> Any:
    node = doc
    for t in tokens[:-1]:
        if isinstance(node, list):
            node = node[int(t)]
        elif isinstance(node, dict) and t in node:
            node = node[t]
        else:
            raise PatchError(f"no {t!r} on the way to {'/'.join(tokens)}")
    return node


def apply_patch(doc: Any, patch: list[dict[str, Any]]) -> Any:
    """The document after the patch (the input is left unchanged)."""
    out = copy.deepcopy(doc)
    for op in patch:
        tokens = _tokens(op["path"])
        parent, last = _parent(out, tokens), tokens[-1]
        kind = op["op"]
        if kind == "add":
            if isinstance(parent, list):
                parent.insert(len(parent) if last == "-" else int(last), copy.deepcopy(op["value"]))
            else:
                parent[last] = copy.deepcopy(op["value"])
        elif kind == "remove":
            if isinstance(parent, list):
                del parent[int(last)]
            elif last in parent:
                del parent[last]
            else:
                raise PatchError(f"remove of missing {op['path']}")
        elif kind == "replace":
            if isinstance(parent, list):
                parent[int(last)] = copy.deepcopy(op["value"])
            elif last in parent:
                parent[last] = copy.deepcopy(op["value"])
            else:
                raise PatchError(f"replace of missing {op['path']}")
        else:
            raise PatchError(f"op {kind!r} not supported here")
    return out
