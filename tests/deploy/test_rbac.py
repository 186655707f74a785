"""Each ServiceAccount's RBAC rules are exactly the Kubernetes API calls its service's code makes.

The sources of `services/<svc>/` (and the `shared/kube/` helpers they call) are read with `ast`; every
reference to a kubernetes_asyncio API method (`read_namespaced_pod`, `patch_node`, `list_node` handed to a
watch, ...) becomes a `(apiGroup, resource, verb)`. The rules bound to the service's ServiceAccount in the
base kustomization must grant exactly that set: a verb nobody uses fails the test, and so does a call
without a rule.

`kubectl inspect gpushare` (services/accounting/inspect_*.py) runs with the user's own credentials, not
accounting's ServiceAccount: its calls are checked against the `gpushare-inspect` ClusterRole that admins bind
to the users who may look.
"""

from __future__ import annotations

import ast
import re
from functools import cache
from pathlib import Path
from typing import Any

import pytest
from kubernetes_asyncio import client

from tests.deploy.tools import MIGRATE_JOB, ROOT, find, key

Need = tuple[str, str, str]  # (apiGroup, resource, verb)

API_CLASSES = {
    "": client.CoreV1Api,
    "apps": client.AppsV1Api,
    "coordination.k8s.io": client.CoordinationV1Api,
    "events.k8s.io": client.EventsV1Api,
    "policy": client.PolicyV1Api,
    "resource.k8s.io": client.ResourceV1Api,
}
# Authorization that no API method names: writing a claim's status.devices also needs the synthetic subresource
# resourceclaims/driver of each driver written, verb `arbitrary-node:<verb>` (AuthorizedForDeviceStatus,
# pkg/registry/resource/utils.go, v1.37.2)
IMPLIED = {
    ("resource.k8s.io", "resourceclaims/status", "patch"): (
        "resource.k8s.io",
        "resourceclaims/driver",
        "arbitrary-node:patch",
    )
}
VERBS = (
    ("delete_collection_", "deletecollection"),
    ("read_", "get"),
    ("list_", "list"),
    ("patch_", "patch"),
    ("create_", "create"),
    ("replace_", "update"),
    ("delete_", "delete"),
)
SUBRESOURCES = {"status": "status", "binding": "binding", "eviction": "eviction", "log": "log", "scale": "scale"}
CONNECT_VERBS = {
    "get": "get",
    "head": "get",
    "options": "get",
    "post": "create",
    "put": "update",
    "patch": "patch",
    "delete": "delete",
}
CONNECT_SUBRESOURCES = ("proxy", "exec", "attach", "portforward")
PLURALS = {"endpoints": "endpoints", "binding": "bindings"}
WATCHERS = {"watch_objects", "stream"}  # call(list_method, ...) lists then watches
SERVICES = {
    "gpushare-extender": "extender",
    "gpushare-binder": "binder",
    "gpushare-node-agent": "node_agent",
    "gpushare-accounting": "accounting",
}
USER_CLIENT = "inspect_"  # services/accounting/inspect_*.py: the kubectl plugin, with the user's credentials
INSPECT_ROLE = "gpushare-inspect"


def api_method(name: str) -> Need | None:
    """`(group, resource, verb)` of a kubernetes_asyncio API method name, or None if it is not one."""
    name = name.removesuffix("_with_http_info")
    group = next((g for g, cls in API_CLASSES.items() if callable(getattr(cls, name, None))), None)
    if group is None or name.startswith("get_api_resources"):
        return None
    if name.startswith("connect_"):  # connect_<http verb>_namespaced_<resource>_<subresource>[_with_path]
        method, _, rest = name.removeprefix("connect_").removesuffix("_with_path").partition("_")
        rest = rest.removeprefix("namespaced_")
        sub = next((s for s in CONNECT_SUBRESOURCES if rest.endswith("_" + s)), None)
        if method not in CONNECT_VERBS or sub is None:
            return None
        resource = rest.removesuffix("_" + sub)
        return group, f"{PLURALS.get(resource) or resource + 's'}/{sub}", CONNECT_VERBS[method]
    verb_prefix, verb = next(((p, v) for p, v in VERBS if name.startswith(p)), (None, None))
    if verb_prefix is None:
        return None
    rest = name.removeprefix(verb_prefix).replace("namespaced_", "").removesuffix("_for_all_namespaces")
    sub = None
    for suffix, subresource in SUBRESOURCES.items():
        if rest.endswith("_" + suffix) and rest != suffix:
            rest, sub = rest.removesuffix("_" + suffix), subresource
    resource = PLURALS.get(rest) or rest.replace("_", "") + ("" if rest.endswith("s") else "s")
    return group, resource + (f"/{sub}" if sub else ""), verb


def _referenced_methods(node: ast.AST) -> set[str]:
    names = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.Attribute):
            names.add(sub.attr)
    return names


def needs_of(tree: ast.AST, helpers: dict[str, set[Need]]) -> set[Need]:
    """API calls made in `tree`, directly or through a `shared.kube` helper it imports."""
    imported: set[str] = set()
    modules: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("shared.kube"):
            for alias in node.names:
                (imported if alias.name in helpers else modules).add(alias.asname or alias.name)
    needs: set[Need] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute):
            if (need := api_method(node.attr)) is not None:
                needs.add(need)
            elif isinstance(node.value, ast.Name) and node.value.id in modules and node.attr in helpers:
                needs |= helpers[node.attr]
        elif isinstance(node, ast.Name) and node.id in imported:
            needs |= helpers[node.id]
        if isinstance(node, ast.Call):
            func = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            watched = func in WATCHERS or any(
                kw.arg == "watch" and isinstance(kw.value, ast.Constant) and kw.value.value is True
                for kw in node.keywords
            )
            if watched:
                targets = [*node.args] if func in WATCHERS else [node.func]
                for arg in targets:
                    for method in _referenced_methods(arg):
                        if (need := api_method(method)) is not None and need[2] == "list":
                            needs.add((need[0], need[1], "watch"))
    return needs


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


@cache
def shared_helpers() -> dict[str, set[Need]]:
    """Each public function and class of shared/kube/ -> the API calls it makes (a class: all its methods'),
    following calls between helpers."""
    functions: dict[str, ast.AST] = {}
    for path in sorted((ROOT / "shared" / "kube").glob("*.py")):
        for node in _parse(path).body:
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                functions[node.name] = node
    helpers: dict[str, set[Need]] = {name: set() for name in functions}
    changed = True
    while changed:
        changed = False
        for name, node in functions.items():
            found = needs_of(node, {})
            for sub in ast.walk(node):
                if isinstance(sub, ast.Name) and sub.id in helpers and sub.id != name:
                    found |= helpers[sub.id]
            if not found <= helpers[name]:
                helpers[name] |= found
                changed = True
    return helpers


def code_needs(package: str, *, user_client: bool = False) -> tuple[set[Need], int]:
    """API calls made by services/<package>/ and the number of Python files read (`user_client`: only the
    modules that run with the user's credentials, else all but those)."""
    files = sorted((ROOT / "services" / package).rglob("*.py"))
    files = [f for f in files if not f.name.endswith(("_pb2.py", "_pb2_grpc.py"))]
    files = [f for f in files if f.name.startswith(USER_CLIENT) == user_client]
    needs: set[Need] = set()
    for path in files:
        needs |= needs_of(_parse(path), shared_helpers())
    needs |= {IMPLIED[n] for n in needs if n in IMPLIED}
    return needs, len(files)


def granted(objects: list[dict[str, Any]], account: str) -> set[Need]:
    """What the (Cluster)RoleBindings of `account` grant, as `(group, resource, verb)`."""
    out: set[Need] = set()
    for binding in objects:
        if binding["kind"] not in {"RoleBinding", "ClusterRoleBinding"}:
            continue
        if not any(s["kind"] == "ServiceAccount" and s["name"] == account for s in binding.get("subjects", [])):
            continue
        role = find(objects, binding["roleRef"]["kind"], binding["roleRef"]["name"])
        for rule in role.get("rules", []):
            assert "*" not in rule["verbs"] and "*" not in rule["resources"], f"{key(role)} uses a wildcard"
            for group in rule["apiGroups"]:
                for resource in rule["resources"]:
                    out |= {(group, resource, verb) for verb in rule["verbs"]}
    return out


def test_api_method_mapping() -> None:
    assert api_method("read_namespaced_pod") == ("", "pods", "get")
    assert api_method("list_pod_for_all_namespaces") == ("", "pods", "list")
    assert api_method("patch_namespaced_pod") == ("", "pods", "patch")
    assert api_method("create_namespaced_pod_binding") == ("", "pods/binding", "create")
    assert api_method("create_namespaced_binding") == ("", "bindings", "create")
    assert api_method("patch_node_status") == ("", "nodes/status", "patch")
    assert api_method("list_node") == ("", "nodes", "list")
    assert api_method("read_namespaced_config_map") == ("", "configmaps", "get")
    assert api_method("replace_namespaced_lease") == ("coordination.k8s.io", "leases", "update")
    assert api_method("list_nodes") is None and api_method("read_text") is None
    assert api_method("connect_get_namespaced_service_proxy_with_path") == ("", "services/proxy", "get")
    assert api_method("connect_post_namespaced_pod_exec") == ("", "pods/exec", "create")
    assert api_method("connect_get_node_proxy") == ("", "nodes/proxy", "get")
    assert api_method("list_resource_claim_for_all_namespaces") == ("resource.k8s.io", "resourceclaims", "list")
    assert api_method("patch_namespaced_resource_claim_status") == ("resource.k8s.io", "resourceclaims/status", "patch")
    assert api_method("replace_resource_slice") == ("resource.k8s.io", "resourceslices", "update")


def test_scanner_sees_direct_helper_and_watch_calls() -> None:
    source = """
from kubernetes_asyncio import client
from shared.kube.watching import watch_objects
async def f(api):
    core = client.CoreV1Api(api)
    await core.patch_node("n", {})
    async for _ in watch_objects(core.list_node, what="nodes"):
        pass
    await core.list_namespaced_pod("ns", watch=True)
"""
    needs = needs_of(ast.parse(source), shared_helpers())
    assert needs == {
        ("", "nodes", "patch"),
        ("", "nodes", "list"),
        ("", "nodes", "watch"),
        ("", "pods", "list"),
        ("", "pods", "watch"),
    }


@pytest.mark.parametrize("account", sorted(SERVICES))
def test_rules_are_exactly_what_the_code_calls(rendered: dict[str, list[dict[str, Any]]], account: str) -> None:
    objects = rendered["base"]
    needs, files = code_needs(SERVICES[account])
    assert files > 1, f"services/{SERVICES[account]}/ has no code yet"
    have = granted(objects, account)
    unused = sorted(have - needs)
    missing = sorted(needs - have)
    assert not unused and not missing, f"{account}: rules nobody calls {unused}; calls without a rule {missing}"
    sa = find(objects, "ServiceAccount", account)
    if not have:
        assert sa.get("automountServiceAccountToken") is False, f"{account} needs no token: do not mount one"


def test_migration_job_has_no_api_access(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    assert granted(objects, "gpushare-migrate") == set()
    assert find(objects, "ServiceAccount", "gpushare-migrate")["automountServiceAccountToken"] is False
    job = find(objects, "Job", MIGRATE_JOB)
    assert job["spec"]["template"]["spec"]["serviceAccountName"] == "gpushare-migrate"


def test_every_workload_runs_as_its_own_account(rendered: dict[str, list[dict[str, Any]]]) -> None:
    objects = rendered["base"]
    for account in SERVICES:
        kind = "DaemonSet" if account == "gpushare-node-agent" else "Deployment"
        spec = find(objects, kind, account)["spec"]["template"]["spec"]
        assert spec["serviceAccountName"] == account
    text = (ROOT / "k8s" / "base" / "rbac.yaml").read_text()
    assert not re.search(r"\bcluster-admin\b|\"\*\"", text)


def test_the_inspect_role_is_exactly_what_the_kubectl_plugin_calls(rendered: dict[str, list[dict[str, Any]]]) -> None:
    from services.accounting.inspect_source import PORT_NAME, SERVICE

    objects = rendered["base"]
    needs, files = code_needs("accounting", user_client=True)
    assert files >= 3 and ("", "services/proxy", "get") in needs
    role = find(objects, "ClusterRole", INSPECT_ROLE)
    have = {
        (g, r, v) for rule in role["rules"] for g in rule["apiGroups"] for r in rule["resources"] for v in rule["verbs"]
    }
    assert have == needs, (
        f"{INSPECT_ROLE}: rules nobody calls {sorted(have - needs)}; calls without a rule {sorted(needs - have)}"
    )
    (proxy,) = [rule for rule in role["rules"] if "services/proxy" in rule["resources"]]
    # RBAC sees the proxied service as `<name>:<port name>`, the form the plugin asks for
    assert proxy["resourceNames"] == [f"{SERVICE}:{PORT_NAME}"] and proxy["resources"] == ["services/proxy"]
    assert not [
        b
        for b in objects
        if b["kind"] in {"RoleBinding", "ClusterRoleBinding"} and b["roleRef"]["name"] == INSPECT_ROLE
    ], "who may inspect is the admin's choice: the role ships unbound"
