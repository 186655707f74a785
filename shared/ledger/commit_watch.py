"""Whether the ledger can commit, and the COMMIT of every ledger connection, with its deadline.

`db.make_engine` gives each engine one `CommitWatch`; every connection of the engine (`LedgerConnection`) sends
its COMMIT through it (`commit`):

* The COMMIT gets `Deadlines.commit_s`. At the deadline the connection is closed without a cancel request (see
  `deadlines` for why a cancel would be wrong), the server's session is asked what it waits for (from another
  connection: `pg_stat_activity.wait_event` 'SyncRep' is a synchronous standby that does not confirm) and the
  caller gets `CommitUnconfirmed` naming that cause. The outcome is left to the caller's retry.
* From then on, until the ledger commits again, every COMMIT is refused at once (the transaction rolled back,
  `CommitsRefused` with the same cause): callers hear why in milliseconds instead of after a deadline each, and no
  more sessions pile up on the server waiting for the same standby. `Ledger` checks before it even begins a write
  (`refuse_if_held`).
* A probe tells when it commits again: a transaction holding nothing but a transactional logical message (it
  writes WAL, so its COMMIT waits for a synchronous standby as a ledger write does; no table, no privilege beyond
  the login). Its held COMMIT is not abandoned: it completes the moment the server can commit again, which reopens
  the gate. A service also probes every `probe_interval_s` while all is well (`run`), so an idle process notices
  too; without `run` the probe starts when a real COMMIT misses its deadline, and stops once one completes.

`can_commit` and `reason` feed the services' `/readyz` (`shared.runtime`), `collector` the metrics; the watch logs
one line when the ledger stops committing, a reminder every `REMIND_S`, and one when it commits again.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, ClassVar

import asyncpg
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from sqlalchemy.engine import Engine
from sqlalchemy.ext.asyncio import AsyncEngine

from shared.ledger.deadlines import CommitsRefused, CommitUnconfirmed, Deadlines

log = logging.getLogger(__name__)

COMMIT = "COMMIT;"  # what asyncpg's Transaction sends (SQLAlchemy's adapter commits through it)
NO_CLIENT_TIMEOUT = 365 * 86_400.0  # a COMMIT's own wait: the watch keeps the deadline, never asyncpg (it cancels)
PROBE_SQL = "SELECT pg_logical_emit_message(true, 'gpushare', 'commit probe')"
ACTIVITY_SQL = (
    "SELECT (SELECT state || coalesce(', waiting on ' || wait_event_type || ':' || wait_event, '')"
    " FROM pg_stat_activity WHERE pid = $1), current_setting('synchronous_standby_names')"
)
SYNC_REP = "active, waiting on IPC:SyncRep"
REMIND_S = 30.0

# why the ledger cannot commit (the metric's `reason` label)
SYNCHRONOUS_STANDBY = "synchronous_standby"
SLOW_COMMIT = "slow_commit"
UNREACHABLE = "unreachable"


@dataclass(frozen=True)
class Blocked:
    """Why the ledger cannot commit, of which kind, since when (monotonic), and whether COMMITs are held (the gate
    is closed) or only the probe failed (the server unreachable: commits fail by themselves)."""

    reason: str
    kind: str
    since: float
    held: bool


class LedgerConnection(asyncpg.Connection):
    """asyncpg's connection, its COMMIT sent through the engine's `CommitWatch` (one subclass per engine)."""

    watch: ClassVar[CommitWatch]

    async def execute(self, query: str, *args: Any, timeout: float | None = None) -> str:  # noqa: ASYNC109 (asyncpg's)
        if query == COMMIT and not args:
            return await self.watch.commit(self)
        return await super().execute(query, *args, timeout=timeout)

    async def send_commit(self) -> str:
        """COMMIT, with no client-side timeout (the caller keeps the deadline)."""
        return await super().execute(COMMIT, timeout=NO_CLIENT_TIMEOUT)

    async def send_rollback(self) -> None:
        """ROLLBACK (the statement deadline applies)."""
        await super().execute("ROLLBACK;")


_WATCHES: weakref.WeakKeyDictionary[Engine, CommitWatch] = weakref.WeakKeyDictionary()


def watch_of(engine: AsyncEngine | Engine) -> CommitWatch | None:
    """The watch of an engine made by `db.make_engine` (None for any other engine)."""
    return _WATCHES.get(engine.sync_engine if isinstance(engine, AsyncEngine) else engine)


class CommitWatch:
    """The COMMIT rule of one engine's connections, and whether that engine's ledger can commit."""

    def __init__(self, deadlines: Deadlines, *, probe_interval_s: float = 5.0, recheck_s: float = 1.0) -> None:
        self.deadlines = deadlines
        self.probe_interval_s = probe_interval_s
        self.recheck_s = recheck_s
        self.blocked: Blocked | None = None
        self.unconfirmed = 0  # COMMITs that missed their deadline (outcome left to the retry)
        self.refused = 0  # transactions refused while the ledger could not commit
        self.probes = 0
        self.connection_class: type[LedgerConnection] = type(
            "LedgerConnection", (LedgerConnection,), {"watch": self, "__slots__": ()}
        )
        self._engine: weakref.ref[Engine] | None = None
        self._probe_conn: LedgerConnection | None = None
        self._probe_enabled = True
        self._prober: asyncio.Task[None] | None = None
        self._periodic = False
        self._wake = asyncio.Event()
        self._closed = False
        self._said = 0.0

    def attach(self, engine: AsyncEngine) -> None:
        """Bind the watch to the engine whose connections use it (`db.make_engine` does)."""
        self._engine = weakref.ref(engine.sync_engine)
        _WATCHES[engine.sync_engine] = self

    def attach_reader(self, reader: AsyncEngine) -> None:
        """The engine's autocommit face for reads (`db.reading`, the same pool) answers to this watch too."""
        _WATCHES[reader.sync_engine] = self

    # ---- state -------------------------------------------------------------------------------------------
    @property
    def can_commit(self) -> bool:
        """Whether the last word on commits (a real one or the probe's) is that they complete in time."""
        return self.blocked is None

    @property
    def reason(self) -> str | None:
        """Why the ledger cannot commit (None while it can)."""
        return self.blocked.reason if self.blocked is not None else None

    @property
    def holding(self) -> bool:
        """Whether COMMITs are refused now: they are held, and the probe will tell when they pass (without a probe
        the server refused, real COMMITs are the only way to find out, so none is refused)."""
        return self.blocked is not None and self.blocked.held and self._probe_enabled

    def refuse_if_held(self) -> None:
        """Raise `CommitsRefused` while COMMITs are held: a write begun now could only wait too."""
        if self.blocked is not None and self.holding:
            self.refused += 1
            raise CommitsRefused(self.blocked.reason)

    def _block(self, reason: str, kind: str, *, held: bool) -> None:
        """Note why the ledger cannot commit. Held COMMITs stay held until one completes (a probe that cannot
        reach the server meanwhile changes the reason, not that)."""
        now = time.monotonic()
        first = self.blocked is None
        since = now if self.blocked is None else self.blocked.since
        held = held or (self.blocked is not None and self.blocked.held)
        self.blocked = Blocked(reason, kind, since, held)
        if first:
            self._said = now
            log.warning(
                "the ledger cannot commit: %s; %s until it can, and /readyz answers 503",
                reason,
                "writes are refused at once" if held else "writes fail",
                extra={"ledger_commit": "blocked", "reason": kind},
            )
        elif now - self._said >= REMIND_S:
            self._said = now
            log.warning(
                "the ledger still cannot commit after %.0fs: %s",
                now - since,
                reason,
                extra={"ledger_commit": "blocked", "reason": kind, "blocked_s": round(now - since, 1)},
            )
        self._ensure_prober()

    def _committed(self, *, started: float | None = None) -> None:
        """A COMMIT completed: the ledger commits again. A real one that began before the block counts not (a
        read-only transaction commits even while writes are held); the probe's, which writes, counts always."""
        blocked = self.blocked
        if blocked is None or (started is not None and started < blocked.since):
            return
        self.blocked = None
        log.warning(
            "the ledger commits again, after %.1fs (%s)",
            time.monotonic() - blocked.since,
            blocked.reason,
            extra={"ledger_commit": "committing", "reason": blocked.kind},
        )

    # ---- the COMMIT rule ---------------------------------------------------------------------------------
    async def commit(self, conn: LedgerConnection) -> str:
        """COMMIT `conn`'s transaction within the deadline, or refuse it while COMMITs are held (see the module)."""
        if self.blocked is not None and self.holding:
            await conn.send_rollback()
            self.refused += 1
            raise CommitsRefused(self.blocked.reason)
        started = time.monotonic()
        sending = asyncio.ensure_future(conn.send_commit())
        if not await _within(sending, self.deadlines.commit_s, conn):
            pid = conn.get_server_pid()
            await _abandon(conn, sending)
            self.unconfirmed += 1
            reason, kind = await self._diagnose(pid)
            self._block(reason, kind, held=True)
            raise CommitUnconfirmed(reason)
        result = sending.result()  # the connection's own failure (lost, ...) is raised as it came
        self._committed(started=started)
        return result

    async def _diagnose(self, pid: int) -> tuple[str, str]:
        """Why the session `pid` has not finished its COMMIT, asked from another connection: a sentence and a kind."""
        waited = f"{self.deadlines.commit_s:g}s"
        try:
            async with asyncio.timeout(self.deadlines.commit_s):
                activity, standbys = await self._activity(pid)
        except Exception as exc:
            return (
                f"the ledger's commit did not finish within {waited} and its server does not answer ({_short(exc)})",
                UNREACHABLE,
            )
        if activity == SYNC_REP:
            names = f"synchronous_standby_names = '{standbys}'"
            return (
                f"the ledger's commit is waiting for a synchronous standby: none of {names} confirmed it within "
                f"{waited} (is a standby down?)",
                SYNCHRONOUS_STANDBY,
            )
        where = f"the server lists its session as {activity}" if activity else "the server no longer lists its session"
        return f"the ledger's commit did not finish within {waited} ({where})", SLOW_COMMIT

    async def _activity(self, pid: int) -> tuple[str | None, str]:
        engine = self._async_engine()
        async with engine.connect() as conn:
            row = (await conn.exec_driver_sql(ACTIVITY_SQL, (pid,))).one()
        return row[0], row[1]

    def _async_engine(self) -> AsyncEngine:
        sync = self._engine() if self._engine is not None else None
        if sync is None:
            raise RuntimeError("the engine of this commit watch is gone")
        return AsyncEngine(sync)

    # ---- the probe ---------------------------------------------------------------------------------------
    async def run(self, stop: asyncio.Event) -> None:
        """Probe every `probe_interval_s` (every `recheck_s` while the ledger cannot commit) until `stop`."""
        self._periodic = True
        try:
            while not stop.is_set() and not self._closed:
                await self.probe()
                self._wake.clear()
                waits = {asyncio.ensure_future(stop.wait()), asyncio.ensure_future(self._wake.wait())}
                delay = self.probe_interval_s if self.blocked is None else self.recheck_s
                await asyncio.wait(waits, timeout=delay, return_when=asyncio.FIRST_COMPLETED)
                for task in waits:
                    task.cancel()
        finally:
            self._periodic = False

    def _ensure_prober(self) -> None:
        """Have a probe running while the ledger cannot commit: the periodic one woken, or one of its own."""
        if self._closed:
            return
        if self._periodic:
            self._wake.set()
            return
        if self._prober is None or self._prober.done():
            with contextlib.suppress(RuntimeError):  # no running loop: the next commit starts it
                self._prober = asyncio.get_running_loop().create_task(self._until_committing(), name="ledger-probe")

    async def _until_committing(self) -> None:
        while self.blocked is not None and self._probe_enabled and not self._closed and not self._periodic:
            if not await self.probe():
                await asyncio.sleep(self.recheck_s)

    async def probe(self) -> bool:
        """One probe transaction (see the module); True when it committed within the deadline, or once its held
        COMMIT completed. Updates `blocked` either way."""
        if not self._probe_enabled:
            return self.blocked is None
        self.probes += 1
        conn = await self._begin_probe()
        if conn is None:
            return self.blocked is None
        sending = asyncio.ensure_future(conn.send_commit())
        if not await _within(sending, self.deadlines.commit_s, conn):
            if not await self._held(conn, sending):
                return False
        try:
            sending.result()
        except Exception as exc:
            await self._drop_connection()
            self._block(f"the ledger cannot be reached: {_short(exc)}", UNREACHABLE, held=False)
            return False
        self._committed()
        return True

    async def _begin_probe(self) -> LedgerConnection | None:
        """The probe's connection inside its transaction, the message written; None when that failed (blocked as
        unreachable, or the probe disabled where the server refuses the function). A kept connection the server
        dropped meanwhile (a restart) is replaced once before that counts."""
        for attempt in (1, 2):
            kept = self._probe_conn is not None and not self._probe_conn.is_closed()
            try:
                conn = await self._connection()
                await conn.execute("BEGIN;")
                await conn.execute(PROBE_SQL)
                return conn
            except (asyncpg.InsufficientPrivilegeError, asyncpg.UndefinedFunctionError) as exc:
                self._probe_enabled = False
                await self._drop_connection()
                log.warning("the ledger's commit probe cannot run (%s): only real commits tell whether it commits", exc)
                return None
            except Exception as exc:
                await self._drop_connection()
                if kept and attempt == 1:
                    continue
                self._block(f"the ledger cannot be reached: {_short(exc)}", UNREACHABLE, held=False)
                return None
        return None

    async def _held(self, conn: LedgerConnection, sending: asyncio.Future[str]) -> bool:
        """The probe's COMMIT missed its deadline: block, then wait for that same COMMIT (it completes when the
        server can commit again), asking the server every deadline what it waits for. A COMMIT the server does
        not say it holds for a standby is given up after three deadlines (False: the next probe starts over)."""
        pid = conn.get_server_pid()
        unexplained = 0.0
        while not sending.done():
            reason, kind = await self._diagnose(pid)
            self._block(reason, kind, held=True)
            unexplained = 0.0 if kind == SYNCHRONOUS_STANDBY else unexplained + self.deadlines.commit_s
            if unexplained > 3 * self.deadlines.commit_s:
                await _abandon(conn, sending)
                self._probe_conn = None
                return False
            await _within(sending, self.deadlines.commit_s, conn)
        return True

    async def _connection(self) -> LedgerConnection:
        """The probe's own connection, outside the pool (made through it: the same URL, settings and deadlines)."""
        if self._probe_conn is None or self._probe_conn.is_closed():
            raw = await self._async_engine().raw_connection()
            conn = raw.driver_connection  # (none once detached)
            raw.detach()
            assert isinstance(conn, LedgerConnection)
            self._probe_conn = conn
        return self._probe_conn

    async def _drop_connection(self) -> None:
        conn, self._probe_conn = self._probe_conn, None
        if conn is not None:
            conn.terminate()

    async def close(self) -> None:
        """Stop probing and close the probe's connection (a held probe COMMIT is left to the server)."""
        self._closed = True
        self._wake.set()
        if self._prober is not None:
            self._prober.cancel()
            with contextlib.suppress(BaseException):
                await self._prober
        await self._drop_connection()

    # ---- metrics -----------------------------------------------------------------------------------------
    def collector(self) -> Collector:
        """Prometheus metrics of this watch (register it in the service's registry)."""
        return _Metrics(self)


class _Metrics(Collector):
    def __init__(self, watch: CommitWatch) -> None:
        self.watch = watch

    def collect(self) -> Iterable[Metric]:
        w, blocked = self.watch, self.watch.blocked
        yield GaugeMetricFamily(
            "gpushare_ledger_can_commit",
            "1 while the ledger's commits complete within their deadline, 0 while they cannot (the log and /readyz "
            "say why)",
            value=1 if blocked is None else 0,
        )
        seconds = GaugeMetricFamily(
            "gpushare_ledger_cannot_commit_seconds",
            "For how long the ledger has not been able to commit, by why (synchronous_standby, slow_commit, "
            "unreachable); no sample while it can",
            labels=["reason"],
        )
        if blocked is not None:
            seconds.add_metric([blocked.kind], time.monotonic() - blocked.since)
        yield seconds
        yield CounterMetricFamily(
            "gpushare_ledger_commits_unconfirmed_total",
            "COMMITs that missed their deadline; each is settled by the caller's idempotent retry",
            value=w.unconfirmed,
        )
        yield CounterMetricFamily(
            "gpushare_ledger_commits_refused_total",
            "Write transactions refused at once while the ledger's commits were held",
            value=w.refused,
        )


async def _within(sending: asyncio.Future[str], seconds: float, conn: LedgerConnection) -> bool:
    """Wait up to `seconds` for `sending` (a COMMIT); True when it is done. Cancelled meanwhile, the connection is
    closed first: cancelling asyncpg's wait would send the server a cancel request."""
    try:
        await asyncio.wait({sending}, timeout=seconds)
    except asyncio.CancelledError:
        await _abandon(conn, sending)
        raise
    return sending.done()


async def _abandon(conn: LedgerConnection, sending: asyncio.Future[str]) -> None:
    """Close `conn` without a cancel request (the server's session keeps its COMMIT waiting) and reap `sending`."""
    conn.terminate()
    with contextlib.suppress(BaseException):
        await asyncio.shield(sending)


def _short(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()[0] if str(exc).strip() else ""
    return f"{type(exc).__name__}: {text[:200]}" if text else type(exc).__name__
