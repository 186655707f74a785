"""Which failures pass on their own: a database that is down, restarting or out of connections, a bus that is
reconnecting, a connection refused or timed out. They are retried with capped backoff for as long as they last;
anything else is an error of the work itself (a bad event, a constraint, a bug)."""

from __future__ import annotations

import nats.errors
import nats.js.errors

from shared.ledger.db import LedgerUnavailable, is_transient

BUS_TRANSIENT: tuple[type[BaseException], ...] = (
    nats.errors.TimeoutError,
    nats.errors.NoRespondersError,
    nats.errors.StaleConnectionError,
    nats.errors.OutboundBufferLimitError,
    nats.errors.ConnectionClosedError,
    nats.errors.ConnectionDrainingError,
    nats.errors.ConnectionReconnectingError,
    nats.errors.NoServersError,
    nats.js.errors.ServiceUnavailableError,
    nats.js.errors.NoStreamResponseError,
)


def is_transient_failure(exc: BaseException) -> bool:
    """True for a database or bus failure that may pass (this exception or one it was raised from)."""
    seen = 0
    current: BaseException | None = exc
    while current is not None and seen < 5:
        if isinstance(current, (LedgerUnavailable, *BUS_TRANSIENT)) or is_transient(current):
            return True
        current, seen = current.__cause__, seen + 1
    return False
