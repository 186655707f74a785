"""docs/security.md's threat model is backed by tests: every row (who reaches what, with which credential) names
tests that exist; and the rows whose proof lives here."""

from __future__ import annotations

import ast
import re
from types import SimpleNamespace

from fastapi.routing import APIRoute
from prometheus_client import CollectorRegistry

from services.binder.app import make_app
from tests.reliability.harness import REPO

SECURITY = REPO / "docs" / "security.md"
HEADER = "| who | reaches | credential | may | is refused | tests |"


def rows() -> list[list[str]]:
    lines = SECURITY.read_text(encoding="utf-8").splitlines()
    start = lines.index(HEADER) + 2
    out = []
    for line in lines[start:]:
        if not line.startswith("|"):
            break
        out.append([cell.strip() for cell in line.strip().strip("|").split("|")])
    return out


def defined_tests(path: str) -> set[str]:
    tree = ast.parse((REPO / path).read_text(encoding="utf-8"))
    return {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef | ast.AsyncFunctionDef)}


def test_every_row_names_tests_that_exist() -> None:
    table = rows()
    assert len(table) >= 15, "the threat model table is missing or was cut short"
    missing = []
    for row in table:
        assert len(row) == 6, row
        refs = re.findall(r"`(tests/[\w/]+\.py)::(test_\w+)`", row[5])
        assert refs, f"the row for {row[0]!r} reaching {row[1]!r} names no test"
        for path, name in refs:
            if not (REPO / path).is_file() or name not in defined_tests(path):
                missing.append(f"{path}::{name} ({row[0]})")
    assert not missing, "rows name tests that do not exist:\n" + "\n".join(missing)


def test_the_binders_http_face_reads_only() -> None:
    """The binder takes its work from NATS: its port serves health, readiness, metrics and a status read."""
    binder = SimpleNamespace(
        ready=lambda: True,
        describe=lambda: {"role": "leader"},
        metrics=SimpleNamespace(registry=CollectorRegistry(), value=lambda name: 0),
        consumer=SimpleNamespace(applied=0, parked=0),
        reconciler=SimpleNamespace(passes=0),
    )
    app = make_app(binder)  # type: ignore[arg-type]
    routes = {(r.path, method) for r in app.routes if isinstance(r, APIRoute) for method in r.methods}
    assert routes == {("/healthz", "GET"), ("/readyz", "GET"), ("/metrics", "GET"), ("/status", "GET")}
