"""How long a service waits for the ledger: one deadline for each kind of wait, set where connections are made.

`db.make_engine` applies them to every connection of a process, so no caller can wait for PostgreSQL for ever:

- a new connection (every host of a multi-host URL together): `connect_s`, asyncpg's connect timeout;
- a connection from the process's pool: `checkout_s`, SQLAlchemy's pool timeout;
- a lock inside a statement (a row, an advisory lock, another transaction's insert of the same key): `lock_s`,
  PostgreSQL's `lock_timeout`;
- a statement: `statement_s`, PostgreSQL's `statement_timeout`; the client gives up `CLIENT_MARGIN_S` (at most
  `statement_s`) later, on a server that answers nothing;
- COMMIT: `commit_s`, kept by the client (`commit_watch.CommitWatch.commit`).

COMMIT needs its own rule: PostgreSQL stops the statement timer before it commits, so a COMMIT that waits for a
synchronous standby (`synchronous_standby_names` set, none connected) waits for as long as none confirms. Nor may
the client cancel that wait: PostgreSQL then ends it with "canceling wait for synchronous replication ... the
transaction has already committed locally", which makes a write visible that no standby has, exactly what
synchronous replication is there to prevent. So at its deadline the client closes the connection without a cancel
request: the server keeps the transaction waiting, invisible, and commits it once a standby confirms (or loses it
with the primary). The caller hears that the outcome is unknown (`CommitUnconfirmed`) and its retry settles it, as
after a connection lost during a COMMIT: reservations are keyed by pod, events by id.
"""

from __future__ import annotations

from dataclasses import dataclass

CLIENT_MARGIN_S = 5.0  # the client gives up on a statement up to this long after the server's statement_timeout
STATEMENT_FACTOR = 6  # statements get this many times the one knob (`Deadlines.from_seconds`): a big read is slow


@dataclass(frozen=True)
class Deadlines:
    """Seconds allowed to each kind of wait for the ledger (see the module's table)."""

    connect_s: float = 5.0
    checkout_s: float = 5.0
    lock_s: float = 5.0
    statement_s: float = 30.0
    commit_s: float = 5.0

    def __post_init__(self) -> None:
        for name in ("connect_s", "checkout_s", "lock_s", "statement_s", "commit_s"):
            if not getattr(self, name) > 0:
                raise ValueError(f"the ledger's {name.removesuffix('_s')} deadline must be positive seconds")

    @classmethod
    def from_seconds(cls, seconds: float) -> Deadlines:
        """The deadlines of one knob (`GPUSHARE_DB_TIMEOUT`): `seconds` for a connection, a lock and a COMMIT,
        `STATEMENT_FACTOR` times that for a statement."""
        return cls(
            connect_s=seconds,
            checkout_s=seconds,
            lock_s=seconds,
            statement_s=seconds * STATEMENT_FACTOR,
            commit_s=seconds,
        )

    def server_settings(self) -> dict[str, str]:
        """The session settings that make PostgreSQL end a statement (and its lock waits) at its deadline."""
        return {"lock_timeout": _ms(self.lock_s), "statement_timeout": _ms(self.statement_s)}

    @property
    def client_statement_s(self) -> float:
        """When the client stops waiting for a statement's answer (the server's own timeout fires first)."""
        return self.statement_s + min(CLIENT_MARGIN_S, self.statement_s)


def _ms(seconds: float) -> str:
    return str(max(1, round(seconds * 1000)))


class LedgerCannotCommit(Exception):
    """The ledger cannot commit now; the message says why (fit for kube-scheduler, a node agent, a log line)."""


class CommitUnconfirmed(LedgerCannotCommit):
    """A COMMIT did not finish within its deadline: the transaction may still commit (when the server can confirm
    it) or never; a retry of the same change settles which."""


class CommitsRefused(LedgerCannotCommit):
    """A transaction rolled back instead of committed, or a statement that gave up waiting for a lock, while the
    ledger is known not to commit: a COMMIT now would only wait too."""
