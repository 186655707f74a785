"""`gpushare ledger rebuild`: replay the event stream, compare with (or replace) the live ledger."""

from __future__ import annotations

import logging
import sys
import time

from shared.events.auth import NatsAuth
from shared.events.bus import BusNames, EventBus
from shared.ledger.db import make_engine
from shared.ledger.replay import differences, load_state, replay_state, write_state
from shared.optional import optional_module
from shared.settings import Settings

log = logging.getLogger(__name__)

# Projections other than the ledger that can rebuild themselves from the stream:
# modules exposing `async def rebuild_projections(engine, bus, progress) -> int`.
PROJECTION_MODULES = ("services.accounting.projections",)


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


async def rebuild(settings: Settings, *, apply: bool, verify: bool) -> int:
    """Replay the stream; returns a process exit code (1 when verification finds differences)."""
    engine = make_engine(settings.require_database_url(), pool_size=2)
    bus = await EventBus.connect(
        settings.require_nats_url(),
        BusNames(settings.stream_name, settings.subject_prefix),
        name="gpushare-rebuild",
        auth=NatsAuth.from_settings(settings),
    )
    try:
        replayed, stats = await replay_state(bus, progress=_progress("replaying ledger events"))
        log.info(
            "replayed %d events (%d undecodable skipped) up to sequence %d",
            stats.events,
            stats.skipped,
            stats.last_sequence,
        )
        code = 0
        if verify:
            async with engine.connect() as conn:
                live = await load_state(conn)
            diffs = differences(live, replayed)
            if diffs:
                code = 1
                print("the replayed ledger differs from the live one:", *diffs, sep="\n  ", file=sys.stderr)
            else:
                print(
                    f"ledger verified: {len(live.allocations)} allocations, {len(live.gpus)} GPUs "
                    f"match a replay of {stats.events} events",
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
