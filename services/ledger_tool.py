"""`gpushare ledger rebuild` and `gpushare ledger snapshot`: replay the ledger stream from the newest snapshot,
compare with (or replace) the live ledger; fold the stream into a new snapshot and trim what it covers."""

from __future__ import annotations

import functools
import logging
import sys
import time
from collections.abc import Awaitable, Callable
from typing import TypeVar

from shared.events.auth import NatsAuth
from shared.events.bus import BusNames, EventBus
from shared.ledger.db import LedgerUnavailable, make_engine, retry_transient
from shared.ledger.replay import differences, read_live_state, write_state
from shared.ledger.snapshots import SnapshotStore, StreamGap, replay_tail, snapshot_from_database, take_snapshot
from shared.optional import optional_module
from shared.settings import Settings
from shared.transient import is_transient_failure

log = logging.getLogger(__name__)

# Projections other than the ledger that can rebuild themselves from the stream:
# modules exposing `async def rebuild_projections(engine, bus, progress) -> int`.
PROJECTION_MODULES = ("services.accounting.projections",)

GAP_EXIT = 3  # the stream lost events no snapshot covers
UNAVAILABLE_EXIT = 4  # NATS or PostgreSQL did not answer within --wait
WAIT_S = 60.0  # how long a passing failure is waited out (a stream electing a leader after a server was lost)

T = TypeVar("T")


class Unavailable(Exception):
    """NATS or PostgreSQL kept failing in a way that passes (no answer, no leader yet) for the whole wait."""


async def patiently(what: str, call: Callable[[], Awaitable[T]], wait_s: float) -> T:
    """`call()`, retried while it fails in a way that passes (`is_transient_failure`: a timeout, a JetStream 503
    while a stream or its object store elects a leader, a database restarting) for `wait_s` (`retry_transient`);
    then `Unavailable` naming `what` and the last failure. Any other failure is raised at once."""
    try:
        return await retry_transient(call, budget_s=wait_s, what=what, transient=is_transient_failure)
    except LedgerUnavailable as exc:
        raise Unavailable(f"{what}: no answer for {wait_s:g}s ({exc.__cause__!r})") from exc


def _progress(label: str):  # type: ignore[no-untyped-def]
    started = time.monotonic()

    def report(done: int, total: int) -> None:
        rate = done / max(time.monotonic() - started, 1e-6)
        print(
            f"\r{label}: {done}/{total} ({100 * done // max(total, 1)}%, {rate:,.0f}/s)",
            end="" if done < total else "\n",
            file=sys.stderr,
            flush=True,
        )

    return report


async def _connect(settings: Settings, name: str) -> EventBus:
    """The bus; stream limits are left as the services set them (a tool run from a workstation without the
    services' settings must not change them)."""
    return await EventBus.connect(
        settings.require_nats_url(),
        BusNames(settings.stream_name, settings.subject_prefix),
        name=name,
        replicas=settings.stream_replicas,
        auth=NatsAuth.from_settings(settings),
    )


async def rebuild(
    settings: Settings, *, apply: bool, verify: bool, from_start: bool = False, wait_s: float = WAIT_S
) -> int:
    """Replay the ledger stream from the newest snapshot (or from its first event); returns a process exit code
    (1 when verification finds differences, 3 when the stream lost events no snapshot covers, 4 when NATS or
    PostgreSQL did not answer within `wait_s`)."""
    try:
        return await _rebuild(settings, apply=apply, verify=verify, from_start=from_start, wait_s=wait_s)
    except Unavailable as exc:
        print(f"cannot rebuild: {exc}", file=sys.stderr)
        return UNAVAILABLE_EXIT


async def _rebuild(settings: Settings, *, apply: bool, verify: bool, from_start: bool, wait_s: float) -> int:
    engine = make_engine(settings.require_database_url(), pool_size=2)
    bus = await patiently("connecting to NATS", lambda: _connect(settings, "gpushare-rebuild"), wait_s)
    try:
        base = None if from_start else await patiently("the newest snapshot", SnapshotStore(bus).newest, wait_s)
        try:
            replayed, stats = await patiently(
                "replaying the ledger stream",
                lambda: replay_tail(bus, base, progress=_progress("replaying ledger events")),
                wait_s,
            )
        except StreamGap as exc:
            print(f"cannot rebuild: {exc}", file=sys.stderr)
            return GAP_EXIT
        start = f"snapshot {base.name} (taken {base.taken_at:%Y-%m-%d %H:%M:%S %Z})" if base else "the first event"
        log.info(
            "replayed %d events (%d undecodable skipped) from %s up to sequence %d",
            stats.events,
            stats.skipped,
            start,
            stats.last_sequence,
        )
        code = 0
        if verify:
            live = await patiently("reading the live ledger", functools.partial(read_live_state, engine), wait_s)
            diffs = differences(live, replayed)
            if diffs:
                code = 1
                print("the replayed ledger differs from the live one:", *diffs, sep="\n  ", file=sys.stderr)
            else:
                print(
                    f"ledger verified: {len(live.allocations)} allocations, {len(live.gpus)} GPUs "
                    f"match {start} and a replay of {stats.events} events",
                    file=sys.stderr,
                )
        if apply:
            await write_state(engine, replayed)
            print(
                f"ledger tables replaced by the replayed state ({len(replayed.allocations)} allocations)",
                file=sys.stderr,
            )
        for module_name in PROJECTION_MODULES:
            module = optional_module(module_name)
            if module is None:
                continue
            count = await module.rebuild_projections(engine, bus, _progress(f"rebuilding {module_name}"))
            print(f"{module_name}: rebuilt from {count} events", file=sys.stderr)
        return code
    finally:
        await bus.close()
        await engine.dispose()


async def snapshot(settings: Settings, *, from_database: bool, trim: bool) -> int:
    """Write a ledger snapshot (folded from the stream, or from the live tables); returns an exit code."""
    bus = await _connect(settings, "gpushare-snapshot")
    try:
        if from_database:
            engine = make_engine(settings.require_database_url(), pool_size=1)
            try:
                result = await snapshot_from_database(bus, engine, keep=settings.snapshot_keep)
            finally:
                await engine.dispose()
        else:
            try:
                result = await take_snapshot(
                    bus,
                    keep=settings.snapshot_keep,
                    dedupe_horizon_s=settings.dedupe_horizon,
                    trim=trim,
                    progress=_progress("folding ledger events"),
                )
            except StreamGap as exc:
                print(f"cannot take a snapshot: {exc}", file=sys.stderr)
                return GAP_EXIT
        if result.written:
            print(
                f"ledger snapshot at sequence {result.sequence}: {result.allocations} allocations, "
                f"{result.events} events folded, {result.bytes} bytes; {result.trimmed} events trimmed from the "
                f"stream; {len(result.deleted)} older snapshots deleted",
                file=sys.stderr,
            )
        else:
            print(
                f"no new events since the snapshot at sequence {result.sequence}; "
                f"{result.trimmed} events trimmed from the stream",
                file=sys.stderr,
            )
        return 0
    finally:
        await bus.close()
