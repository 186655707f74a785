"""Migrations are additive across one release (expand, then contract in the next): every migration after the
baseline only adds, so the previous release's services keep running while the new one migrates and rolls out
(docs/operations.md, "Upgrades"). Read from the migrations' sources with `ast`:

- additive: `op.create_table`, `op.create_index`, `op.add_column` of a nullable column or one with a server
  default, `op.execute` of GRANT / CREATE / COMMENT / INSERT / UPDATE (a backfill) statements;
- anything else (drops, renames, type changes, NOT NULL, new constraints old writers may break, REVOKE, DELETE)
  is a contraction: allowed only in a migration that says so (`contract = "<which release stopped using what
  it removes>"`) and names the oldest build that still runs on it (`services_from`, explicitly);
- a migration's `services_from` (default: the revision before it) is older than it, and every migration
  between the two only adds: the services of `services_from` run on everything in between.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import ModuleType

import pytest
from alembic.script import ScriptDirectory

from shared.ledger import migrate

# 0.1.0's head (the first release): every migration after it is additive unless it declares a contraction.
BASELINE = "0007_service_roles"
ADDITIVE_OPS = {"create_table", "create_index"}
ADDITIVE_SQL = re.compile(r"^\s*(GRANT|CREATE|COMMENT\s+ON|INSERT\s+INTO|UPDATE)\b", re.IGNORECASE)
GRANT_SQL = re.compile(r"^\s*GRANT\b", re.IGNORECASE)
CONTRACTING_SQL = re.compile(
    r"\b(DROP|RENAME|REVOKE|TRUNCATE|DELETE|ALTER\s+COLUMN|SET\s+NOT\s+NULL|ADD\s+CONSTRAINT)\b", re.IGNORECASE
)


def _string(node: ast.AST) -> str | None:
    """The text of a string constant or f-string (placeholders as `{}`)."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if isinstance(node, ast.JoinedStr):
        return "".join(v.value if isinstance(v, ast.Constant) else "{}" for v in node.values)
    return None


def _keyword(call: ast.Call, name: str) -> ast.AST | None:
    return next((k.value for k in call.keywords if k.arg == name), None)


def _column_addable(call: ast.Call) -> bool:
    """`op.add_column(table, sa.Column(...))` of a column old writers may leave out."""
    column = call.args[1] if len(call.args) > 1 else None
    if not isinstance(column, ast.Call):
        return False
    nullable = _keyword(column, "nullable")
    default = _keyword(column, "server_default")
    return default is not None or nullable is None or (isinstance(nullable, ast.Constant) and nullable.value is True)


def _statements(sql: str) -> list[str]:
    """The statements of `sql`, a PL/pgSQL `DO $$ BEGIN ... END $$` block's unwrapped (its IF guards and
    `EXECUTE format('...')` taken apart)."""
    sql = re.sub(r"\bDO\s+\$\$\s*BEGIN\b|\bEND\s+IF\b|\bEND\s+\$\$", ";", sql, flags=re.I)
    sql = re.sub(r"\bIF\b.*?\bTHEN\b", ";", sql, flags=re.I | re.S)
    sql = re.sub(r"\bEXECUTE\s+format\(\s*'(.*?)'.*?\)", r"\1", sql, flags=re.I | re.S)
    return [s.strip() for s in sql.split(";") if s.strip()]


def contractions(source: str) -> list[str]:
    """What `upgrade()` in a migration's source does that is not additive, one line each (empty: additive)."""
    tree = ast.parse(source)
    upgrade = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "upgrade"), None)
    if upgrade is None:
        return ["no upgrade()"]
    found = []
    for call in (n for n in ast.walk(upgrade) if isinstance(n, ast.Call)):
        func = call.func
        if not (isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "op"):
            continue
        where = f"line {call.lineno}: op.{func.attr}"
        if func.attr in ADDITIVE_OPS:
            continue
        if func.attr == "add_column":
            if not _column_addable(call):
                found.append(f"{where} adds a NOT NULL column without a server default")
            continue
        if func.attr == "execute":
            sql = _string(call.args[0]) if call.args else None
            if sql is None:
                found.append(f"{where} of SQL this check cannot read")
                continue
            for statement in _statements(sql):
                if GRANT_SQL.match(statement):  # a privilege given (of any kind, DELETE included) takes nothing away
                    continue
                if CONTRACTING_SQL.search(statement) or not ADDITIVE_SQL.match(statement):
                    found.append(f"{where}: {' '.join(statement.split())[:120]}")
            continue
        found.append(where)
    return found


def _migrations() -> list[tuple[str, ModuleType, str]]:
    """(revision, module, source) of every migration after the baseline, oldest first."""
    script = ScriptDirectory.from_config(migrate.alembic_config("postgresql://unused/unused"))
    history = migrate.history()
    after = history[history.index(BASELINE) + 1 :]
    out = []
    for revision in after:
        entry = script.get_revision(revision)
        out.append((revision, entry.module, Path(entry.path).read_text()))
    return out


def test_the_baseline_is_in_the_history() -> None:
    assert BASELINE in migrate.history()
    assert _migrations(), "no migration after the baseline: move the baseline forward with the next release"


@pytest.mark.parametrize("revision", [r for r, _, _ in _migrations()])
def test_every_migration_after_the_baseline_only_adds_or_says_it_contracts(revision: str) -> None:
    _, module, source = next(m for m in _migrations() if m[0] == revision)
    found = contractions(source)
    if getattr(module, "contract", None):
        assert getattr(module, "services_from", None), f"{revision} contracts: it must name services_from"
        return
    assert not found, (
        f"{revision} is not additive: {found}. The previous release's services run on this schema while it "
        "rolls out: add now, remove in the next release (a migration with `contract = ...`)."
    )


@pytest.mark.parametrize("revision", [r for r, _, _ in _migrations()])
def test_the_services_a_migration_supports_run_on_everything_in_between(revision: str) -> None:
    history = migrate.history()
    migrations = {r: (m, s) for r, m, s in _migrations()}
    module, _ = migrations[revision]
    supported = migrate.services_from(module, module.down_revision)
    assert supported in history[: history.index(revision)], f"{revision}: services_from {supported} is not older"
    between = history[history.index(supported) + 1 : history.index(revision)]
    for other in between:
        if other in migrations:
            assert not contractions(migrations[other][1]) and not getattr(migrations[other][0], "contract", None), (
                f"{revision} says the services of {supported} run on it, but {other} in between contracts"
            )


@pytest.mark.parametrize(
    ("body", "flagged"),
    [
        ('op.create_table("t", sa.Column("a", sa.Text()))', False),
        ('op.create_index("ix", "t", ["a"])', False),
        ('op.add_column("t", sa.Column("b", sa.Text(), nullable=True))', False),
        ('op.add_column("t", sa.Column("b", sa.Integer(), nullable=False, server_default="0"))', False),
        ('op.execute("GRANT SELECT ON t TO r")', False),
        ('op.execute(f"GRANT SELECT ON {T} TO r")', False),
        ('op.execute("DO $$ BEGIN IF NOT EXISTS (SELECT 1) THEN CREATE ROLE r LOGIN; END IF; END $$")', False),
        ('op.add_column("t", sa.Column("b", sa.Integer(), nullable=False))', True),
        ('op.drop_column("t", "a")', True),
        ('op.alter_column("t", "a", new_column_name="b")', True),
        ('op.create_check_constraint("ck", "t", "a > 0")', True),
        ('op.execute("ALTER TABLE t DROP COLUMN a")', True),
        ('op.execute("ALTER TABLE t ALTER COLUMN a SET NOT NULL")', True),
        ('op.execute("REVOKE SELECT ON t FROM r")', True),
        ('op.execute("DELETE FROM t")', True),
        ("op.execute(sql)", True),
        (
            "op.execute(\"DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO r', current_database()); "
            'END $$")',
            False,
        ),
        ('op.execute("DO $$ BEGIN IF true THEN DROP ROLE r; END IF; END $$")', True),
    ],
)
def test_the_check_tells_adding_from_removing(body: str, flagged: bool) -> None:
    source = f"from alembic import op\nimport sqlalchemy as sa\n\n\ndef upgrade() -> None:\n    {body}\n"
    assert bool(contractions(source)) is flagged, contractions(source)
