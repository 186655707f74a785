"""What PostgreSQL did for the ledger's database during a benchmark phase, from `pg_stat_database`.

Committed transactions and rows written per pod show what group commit saves: one transaction per batch
instead of one per pod. The server publishes a backend's counts when its transaction ends, at most about once
a second, so a reading is taken after a pause (`settle_s`).
"""

from __future__ import annotations

import asyncio

import asyncpg

COUNTERS = ("xact_commit", "xact_rollback", "tup_inserted", "tup_updated", "tup_deleted")


async def read_counts(database_url: str, settle_s: float = 1.5) -> dict[str, int]:
    """The database's counters after `settle_s` (its own statistics, not the server's), and rows written per
    table as `rows:<table>`."""
    await asyncio.sleep(settle_s)
    conn = await asyncpg.connect(database_url)
    try:
        await conn.execute("SELECT pg_stat_clear_snapshot()")
        row = await conn.fetchrow(
            f"SELECT {', '.join(COUNTERS)} FROM pg_stat_database WHERE datname = current_database()"
        )
        tables = await conn.fetch(
            "SELECT relname, n_tup_ins + n_tup_upd + n_tup_del AS written FROM pg_stat_user_tables"
        )
    finally:
        await conn.close()
    counts = {name: int(row[name] or 0) for name in COUNTERS}
    counts.update({f"rows:{t['relname']}": int(t["written"] or 0) for t in tables})
    return counts


def tables_breakdown(before: dict[str, int], after: dict[str, int], pods: int) -> str:
    """Rows written per pod by table, largest first, as one line (pure)."""
    written = {k.removeprefix("rows:"): (after[k] - before.get(k, 0)) / pods for k in after if k.startswith("rows:")}
    return ", ".join(f"{t} {n:.2f}" for t, n in sorted(written.items(), key=lambda kv: -kv[1]) if n > 0)


def per_pod(before: dict[str, int], after: dict[str, int], pods: int, prefix: str) -> dict[str, float]:
    """`{prefix}_db_transactions_per_pod` (committed) and `{prefix}_db_rows_written_per_pod` (pure)."""
    written = sum(after[k] - before[k] for k in ("tup_inserted", "tup_updated", "tup_deleted"))
    return {
        f"{prefix}_db_transactions_per_pod": round((after["xact_commit"] - before["xact_commit"]) / pods, 2),
        f"{prefix}_db_rows_written_per_pod": round(written / pods, 2),
    }
