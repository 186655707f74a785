"""`gpushare inspect` layouts (pure): gpushare's summary and `-d` detail tables, plus `-o wide`.

Input is what accounting's `/v1/nodes` (and `/v1/nodes/{name}` for details) return. Amounts are shown in
the resource unit (`memory_unit`: GiB or MiB); like gpushare, the column label says `MiB` when one GPU
holds more than 100 units and `GiB` otherwise, and percentages are truncated to integers.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from .tabwriter import tabwrite


def _unit_mib(unit: str) -> int:
    return 1024 if unit == "GiB" else 1


def _units_down(mib: int, unit_mib: int) -> int:
    return mib // unit_mib


def _units_up(mib: int, unit_mib: int) -> int:
    return -(-mib // unit_mib)


@dataclass
class NodeView:
    """One node in resource units: per GPU index allocated/total, pending, and per pod per index."""

    name: str
    address: str
    totals: dict[int, int]
    allocated: dict[int, int]
    pending: int | None
    pods: list[tuple[str, str, dict[int, int], int]] = field(default_factory=list)
    terminating: list[str] = field(default_factory=list)  # `namespace/name` of holders being deleted

    @property
    def total(self) -> int:
        return sum(self.totals.values())

    @property
    def used(self) -> int:
        return sum(self.allocated.values()) + (self.pending or 0)

    @property
    def columns(self) -> int:
        return max(self.totals, default=-1) + 1


def node_view(node: dict[str, Any], unit: str) -> NodeView:
    """Convert an API node (MiB) into gpushare's numbers (resource units)."""
    u = _unit_mib(unit)
    gpus = node.get("gpus", [])
    totals = {g["index"]: _units_down(g["memory_mib"], u) for g in gpus}
    allocated = {g["index"]: _units_up(g["allocated_memory_mib"], u) for g in gpus}
    pending_mib = node.get("pending_memory_mib", 0)
    view = NodeView(
        name=node["name"],
        address=node.get("address") or "unknown",
        totals=totals,
        allocated=allocated,
        pending=_units_up(pending_mib, u) if pending_mib else None,
    )
    seen: dict[str, tuple[str, str, dict[int, int], int]] = {}
    for a in node.get("allocations", []):
        if a.get("terminating_at"):
            view.terminating.append(f"{a['namespace']}/{a['pod_name']}")
        per_index: dict[int, int] = {}
        pending = 0
        for p in a["parts"]:
            idx = gpu_index(p, gpus)
            if idx is None:
                pending += p["memory_mib"]
            else:
                per_index[idx] = per_index.get(idx, 0) + p["memory_mib"]
        seen.setdefault(
            a["pod_uid"],
            (
                a["pod_name"],
                a["namespace"],
                {i: _units_up(m, u) for i, m in per_index.items()},
                _units_up(pending, u),
            ),
        )
    # gpushare lists pods GPU by GPU; order by the lowest GPU index a pod holds, then by name.
    view.pods = sorted(seen.values(), key=lambda p: (min(p[2], default=10**6), p[1], p[0]))
    return view


def gpu_index(part: dict[str, Any], gpus: list[dict[str, Any]]) -> int | None:
    """The index of the node's GPU a part is on (None: on no GPU the node lists, i.e. pending).

    Accounting's parts name their GPU by UUID; parts read from the API server alone (no UUIDs known) by index.
    """
    if part.get("gpu_uuid") is not None:
        return next((g["index"] for g in gpus if g["uuid"] == part["gpu_uuid"]), None)
    index = part.get("gpu_index")
    return index if index is not None and any(g["index"] == index for g in gpus) else None


def unit_label(views: list[NodeView], unit: str) -> str:
    """gpushare's label rule: `MiB` when one GPU has more than 100 units, else `GiB`."""
    for v in views:
        if v.total > 0 and v.totals:
            return "MiB" if v.total // len(v.totals) > 100 else "GiB"
    return unit


def _pct(part: int, whole: int) -> int:
    return int(part / whole * 100) if whole > 0 else 0


def summary(nodes: list[dict[str, Any]], unit: str) -> str:
    """gpushare's `kubectl inspect gpushare` table."""
    views = [node_view(n, unit) for n in nodes]
    label = unit_label(views, unit)
    max_gpus = max((v.columns for v in views), default=0)
    has_pending = any(v.pending is not None for v in views)
    text = "NAME\tIPADDRESS\t" + "".join(f"GPU{i}(Allocated/Total)\t" for i in range(max_gpus))
    if has_pending:
        text += "PENDING(Allocated)\t"
    text += f"GPU Memory({label})\n"
    line_len, used_all, total_all = 0, 0, 0
    for v in views:
        if v.total <= 0:
            continue
        row = f"{v.name}\t{v.address}\t"
        for i in range(max_gpus):
            row += f"{v.allocated[i]}/{v.totals[i]}\t" if i in v.totals else "0/0\t"
        if has_pending:
            row += f"{v.pending}\t" if v.pending is not None else "\t"
        row += f"{v.used}/{v.total}\n"
        text += row
        if line_len == 0:
            line_len = len(row) + 20
        used_all += v.used
        total_all += v.total
    text += "-" * line_len + "\n"
    text += "Allocated/Total GPU Memory In Cluster:\n"
    text += f"{used_all}/{total_all} ({_pct(used_all, total_all)}%)\t\n"
    return tabwrite(text)


def details(nodes: list[dict[str, Any]], unit: str) -> str:
    """gpushare's `kubectl inspect gpushare -d` layout (nodes need their `allocations`)."""
    text = ""
    line_len, used_all, total_all = 0, 0, 0
    for v in (node_view(n, unit) for n in nodes):
        if v.total <= 0:
            continue
        text += f"\nNAME:\t{v.name}\nIPADDRESS:\t{v.address}\n\n"
        count = v.columns
        text += "NAME\tNAMESPACE\t" + "".join(f"GPU{i}(Allocated)\t" for i in range(count))
        if v.pending is not None:
            text += "Pending(Allocated)\t"
        text += "\n"
        rows = ""
        for name, namespace, per_index, pending in v.pods:
            rows += f"{name}\t{namespace}\t" + "".join(f"{per_index.get(k, 0)}\t" for k in range(count))
            if v.pending is not None:
                rows += f"{pending}\t"
            rows += "\n"
        if line_len == 0:
            line_len = len(rows) + 10
        text += rows
        text += f"Allocated :\t{v.used} ({_pct(v.used, v.total)}%)\t\n"
        text += f"Total :\t{v.total} \t\n"
        if v.terminating:  # not in gpushare's layout: printed only when a holder is being deleted; no tab, so
            # the line is no column cell and leaves gpushare's table as it is
            text += f"Terminating (share held until gone): {', '.join(sorted(set(v.terminating)))}\n"
        text += "-" * line_len + "\n"
        used_all += v.used
        total_all += v.total
    text += "\n\nAllocated/Total GPU Memory In Cluster:\t"
    text += f"{used_all}/{total_all} ({_pct(used_all, total_all)}%)\t\n"
    return tabwrite(text)


def wide(nodes: list[dict[str, Any]], unit: str) -> str:
    """One row per GPU: model, UUID, allocated / total and used / allocated (`-o wide`)."""
    views = [node_view(n, unit) for n in nodes]
    label = unit_label(views, unit)
    u = _unit_mib(unit)
    text = f"NAME\tIPADDRESS\tGPU\tMODEL\tUUID\tALLOCATED/TOTAL({label})\tUSED/ALLOCATED({label})\tHEALTH\n"
    used_all, total_all = 0, 0
    for n, v in zip(nodes, views, strict=True):
        for g in sorted(n.get("gpus", []), key=lambda g: g["index"]):
            used = g.get("used_memory_mib")
            used_text = "n/a" if used is None else f"{_fmt_units(used, u)}/{v.allocated[g['index']]}"
            health = {True: "healthy", False: "unhealthy"}.get(g.get("healthy"), "unknown")
            text += (
                f"{n['name']}\t{v.address}\tGPU{g['index']}\t{g.get('model') or '-'}\t{g.get('uuid') or '-'}\t"
                f"{v.allocated[g['index']]}/{v.totals[g['index']]}\t{used_text}\t{health}\n"
            )
        used_all += v.used
        total_all += v.total
    text += "-" * len(tabwrite(text).split("\n", 1)[0].rstrip()) + "\n"
    text += "Allocated/Total GPU Memory In Cluster:\t"
    text += f"{used_all}/{total_all} ({_pct(used_all, total_all)}%)\t\n"
    return tabwrite(text)


def _fmt_units(mib: int, unit_mib: int) -> str:
    value = mib / unit_mib
    return f"{value:.1f}" if unit_mib > 1 and value != int(value) else str(int(value))
