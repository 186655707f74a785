"""The layering table of docs/architecture.md is the rule: every module's imports (read with `ast`) stay
within its own part and what its row lists under "may import".

The table is parsed here, so changing the rules means changing the document; the project's principles are
also checked on the table itself (services never import each other, `shared/` never imports `services/` or
`devstack/`, production never imports `devstack/`, `bench/` or `tests/`)."""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass
from functools import cache
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
ARCHITECTURE = REPO / "docs" / "architecture.md"
HEADER = "| part | folder | owns | may import |"
EVERYTHING = "everything"
PRODUCTION = ("services/", "shared/", "migrations/")
TOOLING = ("devstack/", "bench/", "tests/")


@dataclass(frozen=True)
class Part:
    """One row of the table: its folders (a `/`-ended folder or a file) and what it may import."""

    name: str
    folders: tuple[str, ...]
    may_import: tuple[str, ...]  # folders or files, or (EVERYTHING,)

    def allows(self, target: str) -> bool:
        return EVERYTHING in self.may_import or any(_within(target, entry) for entry in self.may_import)


def _within(path: str, entry: str) -> bool:
    return path.startswith(entry) if entry.endswith("/") else path == entry


@cache
def parts() -> tuple[Part, ...]:
    lines = ARCHITECTURE.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2  # the header, then the |---| line
    rows = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        name, folders, _, may = (cell.strip() for cell in line.strip("|").split("|"))
        allowed = tuple(re.findall(r"`([^`]+)`", may)) or ((EVERYTHING,) if may == EVERYTHING else ())
        rows.append(Part(name, tuple(re.findall(r"`([^`]+)`", folders)), allowed))
    return tuple(rows)


def part_of(path: str) -> Part | None:
    """The row whose folder holds `path` most specifically."""
    found = [(len(entry), p) for p in parts() for entry in p.folders if _within(path, entry)]
    return max(found, key=lambda x: x[0])[1] if found else None


def roots() -> set[str]:
    return {entry.split("/")[0] for p in parts() for entry in p.folders}


def modules() -> list[Path]:
    return sorted(f for root in roots() for f in (REPO / root).rglob("*.py"))


def _module_path(module: str) -> str | None:
    """The repository path of a module of this project (None when it is not one of ours)."""
    base = REPO.joinpath(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if candidate.is_file():
            return candidate.relative_to(REPO).as_posix()
    return None


def imports(path: Path) -> list[tuple[int, str, str]]:
    """(line, module as written, the repository path it resolves to) for each import of one of our modules."""
    rel = path.relative_to(REPO)
    package = list(rel.parent.parts)
    out = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = package[: len(package) - node.level + 1] if node.level else []
            module = ".".join([*base, *([node.module] if node.module else [])])
            # `from pkg import name`: the submodule when `name` is one, else the package itself
            names = [
                f"{module}.{alias.name}" if _module_path(f"{module}.{alias.name}") else module for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] not in roots():
                continue
            target = _module_path(name)
            while target is None and "." in name:  # `import a.b.c` of a name defined in a.b
                name = name.rsplit(".", 1)[0]
                target = _module_path(name)
            if target is not None:
                out.append((node.lineno, name, target))
    return out


def test_the_table_states_the_principles() -> None:
    by_folder = {entry: p for p in parts() for entry in p.folders}
    assert {"services/extender/", "services/binder/", "services/node_agent/", "services/accounting/"} <= set(by_folder)
    assert {"shared/ledger/", "shared/events/", "shared/placement/", "shared/kube/", "shared/kubelet_api/"} <= set(
        by_folder
    )
    assert {"devstack/", "migrations/", "bench/", "tests/"} <= set(by_folder)
    for p in parts():
        assert p.folders and p.may_import, f"row {p.name!r} names no folder or nothing it may import"
        for entry in p.folders:
            assert (REPO / entry).exists(), f"row {p.name!r}: {entry} does not exist"
        for entry in p.may_import:
            assert entry == EVERYTHING or (REPO / entry).exists(), f"row {p.name!r} allows {entry}, which is missing"
        production = any(entry.startswith(PRODUCTION) for entry in p.folders)
        if production:  # production never imports the tooling
            assert EVERYTHING not in p.may_import and not any(e.startswith(TOOLING) for e in p.may_import), p
        if any(entry.startswith("shared/") for entry in p.folders):  # shared never imports services or devstack
            assert all(e.startswith("shared/") for e in p.may_import), p
        if any(re.fullmatch(r"services/[^/]+/", entry) for entry in p.folders):  # services never import each other
            assert all(e.startswith("shared/") for e in p.may_import), p
    assert by_folder["devstack/"].may_import == (EVERYTHING,)


def test_every_module_belongs_to_a_part() -> None:
    loose = [f.relative_to(REPO).as_posix() for f in modules() if part_of(f.relative_to(REPO).as_posix()) is None]
    assert not loose, f"modules outside every part of docs/architecture.md: {loose}"


@pytest.mark.parametrize("root", sorted({entry.split("/")[0] for p in parts() for entry in p.folders}))
def test_imports_follow_the_table(root: str) -> None:
    wrong = []
    for path in modules():
        rel = path.relative_to(REPO).as_posix()
        if not rel.startswith(f"{root}/"):
            continue
        mine = part_of(rel)
        assert mine is not None
        for line, name, target in imports(path):
            if part_of(target) is mine or mine.allows(target):
                continue
            wrong.append(f"{rel}:{line} ({mine.name}) imports {name} ({target})")
    assert not wrong, "imports the layering table does not allow:\n" + "\n".join(wrong)


def test_the_walk_sees_every_kind_of_import() -> None:
    """Absolute, from-package, relative and function-local imports all resolve to our files."""
    found = {target for _, _, target in imports(REPO / "services" / "accounting" / "routes" / "cluster.py")}
    assert {"services/accounting/queries.py", "services/accounting/deps.py"} <= found  # `from .. import queries`
    found = {target for _, _, target in imports(REPO / "services" / "extender" / "pods.py")}
    assert "shared/kube/client.py" in found  # imported inside a function
    assert part_of("services/cli.py") is part_of("services/ledger_tool.py")
    assert part_of("shared/settings.py") is not part_of("shared/ledger/rules.py")
