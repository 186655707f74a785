"""Our kubelet DRA protos carry exactly kubelet's wire facts: package, services and methods, and for every message
each field's name, number, type and label, compared with the upstream `.proto` files of k8s.io/kubelet v0.37.2 in
the Go module cache (read, never copied)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest
from google.protobuf.descriptor import FieldDescriptor

from shared.kubelet_api import load
from tests import system_tools

KUBELET = "k8s.io/kubelet@v0.37.2/pkg/apis"
UPSTREAM = {
    "pluginregistration": "pluginregistration/v1/api.proto",
    "dra_v1": "dra/v1/api.proto",
    "dra_v1beta1": "dra/v1beta1/api.proto",
    "drahealth_v1": "dra-health/v1/api.proto",
    "drahealth_v1alpha1": "dra-health/v1alpha1/api.proto",
}
_SCALARS = {
    FieldDescriptor.TYPE_STRING: "string",
    FieldDescriptor.TYPE_BOOL: "bool",
    FieldDescriptor.TYPE_INT64: "int64",
}


def module_cache() -> Path:
    return Path(os.environ.get("GOMODCACHE") or Path.home() / "go" / "pkg" / "mod")


def upstream_facts(text: str) -> tuple[str, dict[str, set[tuple[str, str, int, str]]], set[str]]:
    """(package, {message: {(field, type, number, label)}}, {service.method}) of a .proto file, comments dropped."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    text = re.sub(r"//[^\n]*", "", text)
    package = re.search(r"\bpackage\s+([\w.]+)\s*;", text).group(1)  # type: ignore[union-attr]
    messages: dict[str, set[tuple[str, str, int, str]]] = {}
    for name, body in re.findall(r"\bmessage\s+(\w+)\s*\{([^}]*)\}", text):
        fields = set()
        for label, ftype, fname, number in re.findall(
            r"(repeated\s+|optional\s+)?(map<\s*\w+\s*,\s*\w+\s*>|[\w.]+)\s+(\w+)\s*=\s*(\d+)\s*;", body
        ):
            fields.add((fname, re.sub(r"\s+", "", ftype), int(number), label.strip()))
        messages[name] = fields
    methods = set()
    for service, body in re.findall(r"\bservice\s+(\w+)\s*\{(.*?)\n\}", text, flags=re.S):
        methods |= {f"{service}.{m}" for m in re.findall(r"\brpc\s+(\w+)", body)}
    return package, messages, methods


def our_facts(name: str) -> tuple[str, dict[str, set[tuple[str, str, int, str]]], set[str]]:
    pb2, _ = load(name)
    fd = pb2.DESCRIPTOR
    messages: dict[str, set[tuple[str, str, int, str]]] = {}
    for mname, msg in fd.message_types_by_name.items():
        fields = set()
        for f in msg.fields:
            if f.message_type is not None and f.message_type.GetOptions().map_entry:
                key, value = f.message_type.fields_by_name["key"], f.message_type.fields_by_name["value"]
                vtype = value.message_type.name if value.message_type else _SCALARS[value.type]
                fields.add((f.name, f"map<{_SCALARS[key.type]},{vtype}>", f.number, ""))
                continue
            if f.message_type is not None:
                ftype = f.message_type.name
            elif f.enum_type is not None:
                ftype = f.enum_type.name
            else:
                ftype = _SCALARS[f.type]
            repeated = f.is_repeated
            optional = f.has_presence and f.containing_oneof is not None  # proto3 `optional`
            fields.add((f.name, ftype, f.number, "repeated" if repeated else "optional" if optional else ""))
        messages[mname] = fields
    methods = {f"{s.name}.{m.name}" for s in fd.services_by_name.values() for m in s.methods}
    return fd.package, messages, methods


@pytest.mark.parametrize("name", sorted(UPSTREAM))
def test_our_proto_has_kubelets_wire_facts(name: str) -> None:
    path = module_cache() / KUBELET / UPSTREAM[name]
    if not path.exists():
        message = f"the k8s.io/kubelet sources are not in the Go module cache ({path})"
        if system_tools.in_ci():
            pytest.fail(message)
        pytest.skip(message)
    assert our_facts(name) == upstream_facts(path.read_text())
