"""A ledger snapshot as bytes: the folded `LedgerState` and the ledger stream sequence it covers (no I/O).

`decode_snapshot(encode_snapshot(s)).state` equals `s.state` exactly: `differences()` finds nothing and every
field that `canonical()` leaves out (the allocations waiting for their reservation, the live allocation per
pod, the ids of recent events for recognising copies, the counters) comes back too. The format is compressed
JSON with a format number; a reader refuses a format it does not know instead of guessing.
"""

from __future__ import annotations

import json
import uuid
import zlib
from dataclasses import dataclass
from datetime import datetime
from typing import Any

from shared.events.catalogue import AllocationPart, EventDecodeError, decode_event, encode_event
from shared.ledger.rules import AllocationState
from shared.ledger.state import AllocationRow, GpuRow, LedgerState, NodeRow

FORMAT = 1
_NODE_FIELDS = ("driver_version", "cuda_version", "retired", "address", "allocator")
_TIMES = ("reserved_at", "bound_at", "assigned_at", "ended_at", "terminating_at", "pod_created_at")
_ALLOCATION_FIELDS: tuple[str, ...] = ("pod_uid", "namespace", "pod_name", "owner_kind", "owner_name", "node")
_ALLOCATION_FIELDS += ("memory_mib", "compute", "reason", "version")
_CLAIM_FIELDS = ("claim_uid", "claim_name")  # DRA allocations; absent from snapshots taken before them


class SnapshotError(ValueError):
    """Bytes that are not a snapshot this build can read."""


@dataclass
class Snapshot:
    """The ledger folded from the ledger stream up to and including stream sequence `sequence`."""

    state: LedgerState
    stream: str
    sequence: int
    taken_at: datetime

    @property
    def name(self) -> str:
        """The object name it is stored under (names sort by sequence)."""
        return snapshot_name(self.sequence)


def snapshot_name(sequence: int) -> str:
    """`ledger-<sequence, 20 digits>`."""
    return f"ledger-{sequence:020d}"


def _time(value: datetime | None) -> str | None:
    return value.isoformat() if value is not None else None


def _parse_time(value: str | None) -> datetime | None:
    return datetime.fromisoformat(value) if value is not None else None


def _allocation(a: AllocationRow) -> dict[str, Any]:
    out: dict[str, Any] = {name: getattr(a, name) for name in _ALLOCATION_FIELDS}
    out.update({name: getattr(a, name) for name in _CLAIM_FIELDS if getattr(a, name) is not None})
    out.update({name: _time(getattr(a, name)) for name in _TIMES})
    out["state"] = a.state.value
    out["parts"] = [p.model_dump(mode="json") for p in a.parts]
    out["assigned_containers"] = {c: _time(t) for c, t in a.assigned_containers.items()}
    return out


def _allocation_row(d: dict[str, Any]) -> AllocationRow:
    return AllocationRow(
        **{name: d[name] for name in _ALLOCATION_FIELDS},
        **{name: d.get(name) for name in _CLAIM_FIELDS},  # type: ignore[arg-type]
        **{name: _parse_time(d[name]) for name in _TIMES},  # type: ignore[arg-type]
        state=AllocationState(d["state"]),
        parts=tuple(AllocationPart.model_validate(p) for p in d["parts"]),
        assigned_containers={c: _parse_time(t) for c, t in d["assigned_containers"].items()},  # type: ignore[misc]
    )


def encode_snapshot(snapshot: Snapshot) -> bytes:
    """The snapshot as compressed JSON."""
    s = snapshot.state
    body = {
        "format": FORMAT,
        "stream": snapshot.stream,
        "sequence": snapshot.sequence,
        "taken_at": _time(snapshot.taken_at),
        "applied": s.applied,
        "duplicates": s.duplicates,
        "nodes": {name: [getattr(n, f) for f in _NODE_FIELDS] for name, n in s.nodes.items()},
        "gpus": {gpu_uuid: vars(g) for gpu_uuid, g in s.gpus.items()},
        "allocations": {str(a_id): _allocation(a) for a_id, a in s.allocations.items()},
        "quotas": {ns: list(limits) for ns, limits in s.quotas.items()},
        "live_by_pod": {pod: str(a_id) for pod, a_id in s.live_by_pod.items()},
        "early": {str(a_id): [encode_event(e).decode() for e in events] for a_id, events in s.early.items()},
        "seen": [[str(event_id), _time(at)] for event_id, at in s.seen.items()],
    }
    return zlib.compress(json.dumps(body, separators=(",", ":")).encode(), 6)


def decode_snapshot(data: bytes) -> Snapshot:
    """Read a snapshot; `SnapshotError` says what is wrong with bytes that are not one."""
    try:
        body = json.loads(zlib.decompress(data))
    except (zlib.error, ValueError) as exc:
        raise SnapshotError(f"not a ledger snapshot: {exc}") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT:
        found = body.get("format") if isinstance(body, dict) else None
        raise SnapshotError(f"unsupported ledger snapshot format {found!r} (this build reads {FORMAT})")
    try:
        state = LedgerState(
            nodes={name: NodeRow(*row) for name, row in body["nodes"].items()},
            gpus={gpu_uuid: GpuRow(**row) for gpu_uuid, row in body["gpus"].items()},
            allocations={uuid.UUID(a_id): _allocation_row(a) for a_id, a in body["allocations"].items()},
            quotas={ns: (limits[0], limits[1]) for ns, limits in body["quotas"].items()},
            live_by_pod={pod: uuid.UUID(a_id) for pod, a_id in body["live_by_pod"].items()},
            early={uuid.UUID(a_id): [decode_event(e) for e in events] for a_id, events in body["early"].items()},
            applied=int(body["applied"]),
            seen={uuid.UUID(event_id): datetime.fromisoformat(at) for event_id, at in body["seen"]},
            duplicates=int(body["duplicates"]),
        )
        return Snapshot(state, str(body["stream"]), int(body["sequence"]), datetime.fromisoformat(body["taken_at"]))
    except (KeyError, TypeError, ValueError, EventDecodeError) as exc:
        raise SnapshotError(f"damaged ledger snapshot: {exc!r}") from None
