"""What PostgreSQL privileges a service's code needs, read from its sources with `ast` (no database involved).

The code reaches the database through SQLAlchemy Core over the tables of `shared/ledger/models.py` and
`services/accounting/tables.py` (and a few `text()` statements), and on the hot path through raw SQL constants
handed to `shared/ledger/driver.py`. Starting from a service's command
(`services/<svc>/cli.py`), every function it can reach is followed by name (calls and callbacks alike, through
`shared/` and its own package; never another service's), and each statement becomes privileges as PostgreSQL
checks them:

| statement | needs |
|---|---|
| `insert(T)` | INSERT on T (and SELECT when it names a conflict target or returns columns) |
| `update(T).values(c=...)`, `on_conflict_do_update(set_={c: ...})` | UPDATE on those columns of T |
| `delete(T)` | DELETE on T |
| `T.c.x` read anywhere (select list, WHERE, RETURNING, SET expressions), `select(T)` | SELECT on T |
| `.with_for_update()` over T | LOCK: UPDATE on at least one column of T (PostgreSQL's rule for row locks) |
| `text("... FROM t JOIN u ...")`, `text("TRUNCATE ...")` | SELECT on t, u; TRUNCATE |
| `driver.fetch(conn, SQL, ...)`, `driver.execute_many(conn, SQL, rows)`, SQL a module constant | as it reads: |
| `INSERT INTO t` | INSERT on t (and SELECT with `ON CONFLICT (...)` or `RETURNING`) |
| `UPDATE t SET c = ...` | UPDATE on those columns of t (and SELECT with `WHERE` or `RETURNING`) |
| `DELETE FROM t` | DELETE on t (and SELECT with `WHERE` or `RETURNING`) |
| `FROM t`, `JOIN t`; `... FOR UPDATE` | SELECT on t; LOCK on the tables read |

A ledger event recorded through `Ledger.record` / `record_once` / `apply_event` needs what `apply_event`'s
branch for that event class does; the event classes are the ones the recording function constructs or names
(also through a module-level tuple of classes, as the binder's gateway does). A function that records without
naming its events, or updates columns this reading cannot name, is reported as an error: the grants must be
derivable. Matching by name over-approximates (two functions of the same name both count), never under.
"""

from __future__ import annotations

import ast
import re
from dataclasses import dataclass, field
from functools import cache, cached_property
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SA_MODULES = ("sqlalchemy", "sqlalchemy.dialects.postgresql")
SA_VERBS = {"insert", "update", "delete", "select", "text"}
RECORDERS = {"record", "record_once", "apply_event"}
ENTRY_METHODS = ("__init__", "__aenter__", "__aexit__", "__call__")
_SQL_TABLES = re.compile(r"(?i)\b(?:FROM|JOIN)\s+([a-z_][a-z0-9_]*)")
DRIVER_MODULE = REPO / "shared" / "ledger" / "driver.py"
DRIVER_CALLS = {"fetch", "execute_many"}

Need = tuple[str, str]  # (table, "SELECT" | "INSERT" | "DELETE" | "TRUNCATE" | "LOCK" | "UPDATE:<column>")


class AnalysisError(AssertionError):
    """The code does something whose privileges cannot be read from it."""


@dataclass
class Function:
    name: str
    path: Path
    node: ast.FunctionDef | ast.AsyncFunctionDef
    owner: str | None  # class name for methods


@dataclass
class Module:
    path: Path
    tree: ast.Module
    sa_names: dict[str, str] = field(default_factory=dict)  # local name -> insert/update/delete/select/text


@dataclass
class Index:
    """Every module of `shared/` and one service's package: tables, constants, functions, classes."""

    modules: dict[Path, Module]
    tables: dict[str, str]  # variable name -> table name
    table_tuples: dict[str, list[str]]
    event_tuples: dict[str, list[str]]
    string_dicts: dict[str, list[str]]  # module-level dict constants -> their string values
    functions: dict[str, list[Function]]
    classes: dict[str, list[str]]  # class name -> method names
    dispatch: dict[str, set[str]]  # event class -> names of the functions apply_event calls for it
    sql_constants: dict[tuple[Path, str], str]  # (module, constant) -> its SQL text (f-string parts left out)

    @cached_property
    def table_names(self) -> set[str]:
        """Every table the code defines."""
        return set(self.tables.values())


def _files(package: str) -> list[Path]:
    roots = [REPO / "shared", REPO / "services" / package]
    return sorted(p for root in roots for p in root.rglob("*.py") if not p.name.endswith(("_pb2.py", "_pb2_grpc.py")))


def _is_table_call(value: ast.AST) -> str | None:
    if isinstance(value, ast.Call) and getattr(value.func, "id", None) == "Table" and value.args:
        first = value.args[0]
        if isinstance(first, ast.Constant) and isinstance(first.value, str):
            return first.value
    return None


@cache
def index(package: str) -> Index:
    """Index `shared/` and `services/<package>/`."""
    modules: dict[Path, Module] = {}
    tables: dict[str, str] = {}
    assigns: list[tuple[Path, str, ast.AST]] = []
    functions: dict[str, list[Function]] = {}
    classes: dict[str, list[str]] = {}
    dispatch: dict[str, set[str]] = {}
    for path in _files(package):
        tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
        module = Module(path, tree)
        modules[path] = module
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.module in SA_MODULES:
                for alias in node.names:
                    if alias.name in SA_VERBS:
                        module.sa_names[alias.asname or alias.name] = alias.name
        for node in tree.body:
            targets: list[tuple[str, ast.AST]] = []
            if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                targets.append((node.targets[0].id, node.value))
            elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
                targets.append((node.target.id, node.value))
            for name, value in targets:
                if (table := _is_table_call(value)) is not None:
                    tables[name] = table
                else:
                    assigns.append((path, name, value))
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                functions.setdefault(node.name, []).append(Function(node.name, path, node, None))
            if isinstance(node, ast.ClassDef):
                for item in node.body:
                    if isinstance(item, ast.FunctionDef | ast.AsyncFunctionDef):
                        functions.setdefault(item.name, []).append(Function(item.name, path, item, node.name))
                        classes.setdefault(node.name, []).append(item.name)
            if isinstance(node, ast.AsyncFunctionDef) and node.name == "apply_event":
                for match in (n for n in ast.walk(node) if isinstance(n, ast.Match)):
                    for case in match.cases:
                        called = {_callee(c) for c in ast.walk(ast.Module(case.body, [])) if isinstance(c, ast.Call)}
                        for cls in _case_classes(case.pattern):
                            dispatch.setdefault(cls, set()).update(c for c in called if c)
    table_tuples: dict[str, list[str]] = {}
    event_tuples: dict[str, list[str]] = {}
    string_dicts: dict[str, list[str]] = {}
    sql_constants: dict[tuple[Path, str], str] = {}
    for path, name, value in assigns:
        if (sql := _literal_sql(value)) is not None:
            sql_constants[(path, name)] = sql
        if isinstance(value, ast.Tuple | ast.List):
            names = [e.id for e in value.elts if isinstance(e, ast.Name)]
            if names and all(n in tables for n in names):
                table_tuples[name] = [tables[n] for n in names]
            elif names and all(n.endswith("Event") for n in names):
                event_tuples[name] = names
        if isinstance(value, ast.Dict) and value.values:
            strings = [v.value for v in value.values if isinstance(v, ast.Constant) and isinstance(v.value, str)]
            if len(strings) == len(value.values):
                string_dicts[name] = strings
    return Index(modules, tables, table_tuples, event_tuples, string_dicts, functions, classes, dispatch, sql_constants)


def _literal_sql(value: ast.AST) -> str | None:
    """The text of a string constant (an f-string's literal parts: what it interpolates is a condition such as
    LIVE_SQL, never a table)."""
    if isinstance(value, ast.Constant) and isinstance(value.value, str):
        return value.value
    if isinstance(value, ast.JoinedStr):
        return "".join(v.value for v in value.values if isinstance(v, ast.Constant))
    return None


def _top_level_split(text: str) -> list[str]:
    """`text` split at the commas outside parentheses."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        depth += {"(": 1, ")": -1}.get(ch, 0)
        if ch == "," and depth == 0:
            parts.append(text[start:i])
            start = i + 1
    return [*parts, text[start:]]


def raw_sql_needs(sql: str, known: set[str]) -> set[Need]:
    """The privileges one raw SQL statement needs, as PostgreSQL checks them (see the module's table)."""
    needs: set[Need] = set()
    reads = re.search(r"(?is)\b(WHERE|RETURNING)\b", sql) is not None
    body = sql
    if m := re.search(r"(?is)\bINSERT\s+INTO\s+([a-z_][a-z0-9_]*)", sql):
        needs.add((m.group(1), "INSERT"))
        if re.search(r"(?is)\bON\s+CONFLICT\s*\(|\bRETURNING\b", sql):
            needs.add((m.group(1), "SELECT"))
    if m := re.search(
        r"(?is)\bUPDATE\s+([a-z_][a-z0-9_]*)(?:\s+AS\s+[a-z_]+)?\s+SET\s+(.*?)(?:\bFROM\b|\bWHERE\b|\bRETURNING\b|$)",
        sql,
    ):
        columns = [re.match(r"\s*([a-z_][a-z0-9_]*)\s*=", part) for part in _top_level_split(m.group(2))]
        if not all(columns):
            raise AnalysisError(f"cannot tell which columns this UPDATE sets: {sql!r}")
        needs |= {(m.group(1), f"UPDATE:{c.group(1)}") for c in columns if c}
        if reads:
            needs.add((m.group(1), "SELECT"))
    if m := re.search(r"(?is)\bDELETE\s+FROM\s+([a-z_][a-z0-9_]*)", sql):
        needs.add((m.group(1), "DELETE"))
        if reads:
            needs.add((m.group(1), "SELECT"))
        body = sql[: m.start()] + sql[m.end() :]  # DELETE FROM t is not a read of t
    read = {t for t in _SQL_TABLES.findall(body) if t in known}
    needs |= {(t, "SELECT") for t in read}
    if re.search(r"(?is)\bFOR\s+UPDATE\b", sql):
        needs |= {(t, "LOCK") for t in read}
    return needs


def _callee(call: ast.Call) -> str | None:
    func = call.func
    return func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)


def _case_classes(pattern: ast.AST) -> list[str]:
    if isinstance(pattern, ast.MatchOr):
        return [c for p in pattern.patterns for c in _case_classes(p)]
    if isinstance(pattern, ast.MatchClass) and isinstance(pattern.cls, ast.Name):
        return [pattern.cls.id]
    return []


def _without_annotations(node: ast.AST) -> list[ast.AST]:
    """Every node under `node` except type annotations (a type hint reaches nothing)."""
    skip: set[int] = set()
    for sub in ast.walk(node):
        if isinstance(sub, ast.arg) and sub.annotation is not None:
            skip.update(id(n) for n in ast.walk(sub.annotation))
        elif isinstance(sub, ast.AnnAssign):
            skip.update(id(n) for n in ast.walk(sub.annotation))
        elif isinstance(sub, ast.FunctionDef | ast.AsyncFunctionDef) and sub.returns is not None:
            skip.update(id(n) for n in ast.walk(sub.returns))
    return [n for n in ast.walk(node) if id(n) not in skip]


class _Reader:
    """Reads one function's statements into needs."""

    def __init__(self, idx: Index, fn: Function) -> None:
        self.idx = idx
        self.fn = fn
        self.sa = idx.modules[fn.path].sa_names
        self.nodes = _without_annotations(fn.node)
        self.parents: dict[int, ast.AST] = {}
        for parent in self.nodes:
            for child in ast.iter_child_nodes(parent):
                self.parents[id(child)] = parent
        self.needs: set[Need] = set()

    def where(self, node: ast.AST) -> str:
        return f"{self.fn.path.relative_to(REPO)}:{getattr(node, 'lineno', self.fn.node.lineno)} ({self.fn.name})"

    def table_of(self, node: ast.AST | None) -> str | None:
        return self.idx.tables.get(node.id) if isinstance(node, ast.Name) else None

    def verb(self, call: ast.Call) -> str | None:
        return self.sa.get(call.func.id) if isinstance(call.func, ast.Name) else None

    def chain_up(self, call: ast.Call) -> list[ast.Call]:
        """The method calls chained on `call` (`update(t).where(...).values(...)` -> where, values)."""
        out = []
        node: ast.AST = call
        while True:
            attr = self.parents.get(id(node))
            call_up = self.parents.get(id(attr)) if isinstance(attr, ast.Attribute) else None
            if not isinstance(call_up, ast.Call) or call_up.func is not attr:
                return out
            out.append(call_up)
            node = call_up

    def base_table(self, node: ast.AST) -> str | None:
        """The table of the insert/update statement a method chain (or a variable holding one) starts from."""
        while True:
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute):
                node = node.func.value
            elif isinstance(node, ast.Call) and self.verb(node) in {"insert", "update", "delete"}:
                return self.table_of(node.args[0]) if node.args else None
            elif isinstance(node, ast.Name):
                value = self.assigned(node.id, before=node.lineno)
                if value is None:
                    return None
                node = value
            else:
                return None

    def assigned(self, name: str, before: int | None = None) -> ast.AST | None:
        """The value last assigned to `name` in this function (at or before line `before`)."""
        found: list[tuple[int, ast.AST]] = []
        for node in self.nodes:
            if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
                found.append((node.lineno, node.value))
            if isinstance(node, ast.AnnAssign) and getattr(node.target, "id", None) == name and node.value:
                found.append((node.lineno, node.value))
        found = [f for f in found if before is None or f[0] <= before]
        return max(found, key=lambda f: f[0])[1] if found else None

    def dict_keys(self, node: ast.AST) -> list[str]:
        """Column names set by `node`: a dict literal, a dict variable built in this function, or a dict
        comprehension over one."""
        if isinstance(node, ast.Dict):
            keys = [k.value for k in node.keys if isinstance(k, ast.Constant) and isinstance(k.value, str)]
            if len(keys) != len(node.keys):
                raise AnalysisError(f"{self.where(node)}: a dict of columns with keys that are not literals")
            return keys
        if isinstance(node, ast.DictComp) and len(node.generators) == 1:
            gen = node.generators[0]
            dropped = {  # `for k in values if k != "pod_uid"`: that key is not set
                c.comparators[0].value
                for c in gen.ifs
                if isinstance(c, ast.Compare)
                and isinstance(c.ops[0], ast.NotEq)
                and isinstance(c.comparators[0], ast.Constant)
            }
            return [k for k in self.dict_keys(gen.iter) if k not in dropped]
        if isinstance(node, ast.Name):
            value = self.assigned(node.id, before=node.lineno)
            if value is None:
                raise AnalysisError(f"{self.where(node)}: cannot tell which columns {node.id} holds")
            keys = self.dict_keys(value)
            for sub in self.nodes:  # name[key] = ... later in the function
                if (
                    isinstance(sub, ast.Assign)
                    and isinstance(sub.targets[0], ast.Subscript)
                    and getattr(sub.targets[0].value, "id", None) == node.id
                ):
                    keys += self.key_values(sub.targets[0].slice)
            return keys
        raise AnalysisError(f"{self.where(node)}: cannot tell which columns are set")

    def key_values(self, key: ast.AST) -> list[str]:
        if isinstance(key, ast.Constant) and isinstance(key.value, str):
            return [key.value]
        if isinstance(key, ast.Name):  # e.g. stamp = STAMPS[state]: every value of the constant dict
            value = self.assigned(key.id)
            if isinstance(value, ast.Subscript) and getattr(value.value, "id", None) in self.idx.string_dicts:
                return self.idx.string_dicts[value.value.id]
        raise AnalysisError(f"{self.where(key)}: cannot tell which column this key names")

    def read(self) -> set[Need]:
        for node in self.nodes:
            if isinstance(node, ast.Attribute) and node.attr == "c" and (t := self.table_of(node.value)):
                self.needs.add((t, "SELECT"))
            if not isinstance(node, ast.Call):
                continue
            verb = self.verb(node)
            if verb == "select":
                for arg in node.args:
                    if t := self.table_of(arg):
                        self.needs.add((t, "SELECT"))
            elif verb in {"insert", "update", "delete"}:
                table = self.table_of(node.args[0]) if node.args else None
                if table is None:
                    raise AnalysisError(f"{self.where(node)}: {verb}() of something that is not a known table")
                self.needs.add((table, verb.upper()))
                if verb == "update":
                    for link in self.chain_up(node):
                        if link.func.attr == "values":  # type: ignore[attr-defined]
                            self.needs |= {(table, f"UPDATE:{c}") for c in self.values_columns(link)}
                    self.needs.discard((table, "UPDATE"))
            elif verb == "text" and node.args:
                self.text(node.args[0])
            callee = _callee(node)
            if callee in DRIVER_CALLS and self.fn.path != DRIVER_MODULE and self.is_driver(node.func):
                self.driver_sql(node)
            if callee == "on_conflict_do_update":
                table = self.base_table(node.func.value)  # type: ignore[attr-defined]
                setter = next((k.value for k in node.keywords if k.arg == "set_"), None)
                if table is None or setter is None:
                    raise AnalysisError(f"{self.where(node)}: an upsert whose table or columns cannot be told")
                self.needs |= {(table, f"UPDATE:{c}") for c in self.dict_keys(setter)} | {(table, "SELECT")}
            if callee in {"on_conflict_do_nothing", "on_conflict_do_update"} and any(
                k.arg == "index_elements" for k in node.keywords
            ):
                if table := self.base_table(node.func.value):  # type: ignore[attr-defined]
                    self.needs.add((table, "SELECT"))  # a conflict target is read
            if callee == "returning" and (table := self.base_table(node.func.value)):  # type: ignore[attr-defined]
                self.needs.add((table, "SELECT"))
            if callee == "with_for_update":
                for sub in ast.walk(node.func.value):  # type: ignore[attr-defined]
                    if isinstance(sub, ast.Attribute) and sub.attr == "c" and (t := self.table_of(sub.value)):
                        self.needs.add((t, "LOCK"))
                    elif isinstance(sub, ast.Call) and self.verb(sub) == "select":
                        self.needs |= {(t, "LOCK") for a in sub.args if (t := self.table_of(a))}
        return self.needs

    def is_driver(self, func: ast.AST) -> bool:
        """`driver.fetch` / `driver.execute_many`, with `driver` the module `shared/ledger/driver.py`."""
        return isinstance(func, ast.Attribute) and isinstance(func.value, ast.Name) and func.value.id == "driver"

    def driver_sql(self, call: ast.Call) -> None:
        """The needs of the statement a driver call runs: its second argument, a module constant."""
        arg = call.args[1] if len(call.args) > 1 else None
        sql = self.idx.sql_constants.get((self.fn.path, arg.id)) if isinstance(arg, ast.Name) else None
        if sql is None:
            raise AnalysisError(f"{self.where(call)}: driver SQL that is not a module constant")
        try:
            self.needs |= raw_sql_needs(sql, self.idx.table_names)
        except AnalysisError as exc:
            raise AnalysisError(f"{self.where(call)}: {exc}") from None

    def values_columns(self, call: ast.Call) -> list[str]:
        cols = [k.arg for k in call.keywords if k.arg is not None]
        for k in call.keywords:
            if k.arg is None:
                cols += self.dict_keys(k.value)
        for arg in call.args:
            cols += self.dict_keys(arg)
        return cols

    def text(self, arg: ast.AST) -> None:
        if isinstance(arg, ast.Name) and arg.id.isupper():
            return  # a constant condition such as LIVE_SQL (`state IN (...)`): no table of its own
        sql = _literal_sql(arg)
        if sql is None:
            raise AnalysisError(f"{self.where(arg)}: text() of SQL built at run time")
        if isinstance(arg, ast.JoinedStr) and sql.lstrip().upper().startswith("TRUNCATE"):
            names = {n.id for n in ast.walk(arg) if isinstance(n, ast.Name)}
            truncated = [t for n in names for t in self.idx.table_tuples.get(n, [])]
            if not truncated:
                raise AnalysisError(f"{self.where(arg)}: TRUNCATE of tables that cannot be told")
            self.needs |= {(t, "TRUNCATE") for t in truncated}
        self.needs |= {(t, "SELECT") for t in _SQL_TABLES.findall(sql) if t in self.idx.table_names}
        if re.match(r"(?is)\s*(insert|update|delete)\b", sql):
            raise AnalysisError(f"{self.where(arg)}: a write in text(); use insert()/update()/delete()")


def _references(fn: Function, modules: set[str]) -> tuple[set[str], set[str], set[str], set[str]]:
    """What a function names: (bare names: functions and classes; attribute names: methods, or a module's
    functions when taken from a module (`inventory.apply_health`); the recorders it calls; classes it constructs
    with database=False)."""
    names: set[str] = set()
    attrs: set[str] = set()
    recorders: set[str] = set()
    without_db: set[str] = set()
    # a parameter shadows a module-level function of its name (`claim` in `verdict(claim, result)` is a dict)
    args = fn.node.args if isinstance(fn.node, ast.FunctionDef | ast.AsyncFunctionDef) else None
    params = (
        {a.arg for a in (*args.posonlyargs, *args.args, *args.kwonlyargs, args.vararg, args.kwarg) if a is not None}
        if args is not None
        else set()
    )
    for node in _without_annotations(fn.node):
        if isinstance(node, ast.Name):
            if node.id not in params:
                names.add(node.id)
        elif isinstance(node, ast.Attribute):
            (names if isinstance(node.value, ast.Name) and node.value.id in modules else attrs).add(node.attr)
        if isinstance(node, ast.Call) and _callee(node) in RECORDERS:
            recorders.add(_callee(node) or "")
        if isinstance(node, ast.Call) and any(
            k.arg == "database" and isinstance(k.value, ast.Constant) and k.value.value is False for k in node.keywords
        ):
            without_db.add(_callee(node) or "")
    return names - RECORDERS, attrs - RECORDERS, recorders, without_db


def _events_named(idx: Index, fn: Function) -> set[str]:
    names = {n.id for n in _without_annotations(fn.node) if isinstance(n, ast.Name)}
    events = {n for n in names if n in idx.dispatch}
    for n in names & set(idx.event_tuples):
        events.update(idx.event_tuples[n])
    return events


def _entry_points(idx: Index, package: str) -> list[Function]:
    """The command's functions, and the functions a framework calls: route handlers, middleware and error
    handlers (decorated with a call such as `@router.get(...)`) of the service's package."""
    root = REPO / "services" / package
    out = []
    for fns in idx.functions.values():
        for f in fns:
            if f.path == root / "cli.py":
                out.append(f)
            elif f.path.is_relative_to(root) and any(isinstance(d, ast.Call) for d in f.node.decorator_list):
                out.append(f)
    return out


def service_needs(package: str) -> set[Need]:
    """Every privilege the code reachable from `services/<package>/cli.py` needs.

    Reachable: the command's functions and the framework's entry points, then every function they name,
    transitively; a module-level function by its bare name (or taken from its module), a method by an attribute
    of its name once its class is named (constructed, or passed on) in reached code."""
    idx = index(package)
    modules = {path.stem for path in idx.modules}
    done: set[int] = set()
    names: set[str] = set()
    attrs: set[str] = set()
    classes: set[str] = set()
    excluded: set[str] = set()
    needs: set[Need] = set()
    todo = _entry_points(idx, package)
    while todo:
        while todo:
            fn = todo.pop()
            if id(fn.node) in done:
                continue
            done.add(id(fn.node))
            needs |= _Reader(idx, fn).read()
            refs, attr_refs, recorders, without_db = _references(fn, modules)
            attrs |= attr_refs
            # a service runtime constructed with database=False opens no connection: nothing of it is reached
            excluded |= without_db
            if recorders and fn.name not in RECORDERS:
                events = _events_named(idx, fn)
                if not events:
                    raise AnalysisError(
                        f"{fn.path.relative_to(REPO)}:{fn.node.lineno} ({fn.name}) records ledger events without "
                        "naming their classes: the grants they need cannot be told"
                    )
                for event in events:
                    names.update(idx.dispatch.get(event, set()))
                names |= {"stage", "claim"} if "record_once" in recorders else {"stage"}
            for ref in refs:
                if ref in idx.classes:
                    classes.add(ref)
                    names.update(m for m in idx.classes[ref] if m in ENTRY_METHODS)
                else:
                    names.add(ref)
        live = classes - excluded
        for name in names | attrs:
            for f in idx.functions.get(name, []):
                if id(f.node) in done:
                    continue
                if (f.owner is None and name in names) or (f.owner in live and (name in attrs or name in names)):
                    todo.append(f)
    return needs
