"""Retrying Kubernetes API calls that failed for transient reasons, with bounded exponential backoff.

Transient: 429 Too Many Requests (honouring `Retry-After`), 5xx, and connection-level failures (refused,
reset, timed out), i.e. an API server that is restarting or overloaded. Everything else (404, 409, 422...)
is an answer and is raised at once for the caller to decide. When the attempts are spent the last error
is raised: a message consumer then naks and the event is redelivered later, so nothing is lost.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

import aiohttp
from kubernetes_asyncio.client.exceptions import ApiException

log = logging.getLogger(__name__)

T = TypeVar("T")

RETRYABLE_STATUSES = frozenset({429, 500, 502, 503, 504})


def is_retryable(exc: BaseException) -> bool:
    """True for errors worth retrying: 429, 5xx, and connection failures (status 0 included)."""
    if isinstance(exc, ApiException):
        return exc.status in RETRYABLE_STATUSES or not exc.status
    return isinstance(exc, aiohttp.ClientError | asyncio.TimeoutError | ConnectionError | OSError)


def retry_after_s(exc: BaseException) -> float | None:
    """The `Retry-After` seconds of a 429/503 reply, if it gave one."""
    headers = getattr(exc, "headers", None) or {}
    value = headers.get("Retry-After") if hasattr(headers, "get") else None
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None


@dataclass(frozen=True)
class RetryPolicy:
    """How often and how long to retry: `attempts` calls in all, delays doubling from `base_s` to `max_s`."""

    attempts: int = 6
    base_s: float = 0.2
    max_s: float = 5.0
    jitter: float = 0.2

    def delays(self) -> list[float]:
        """The nominal delay before each retry (pure; no jitter)."""
        return [min(self.max_s, self.base_s * (2**i)) for i in range(max(0, self.attempts - 1))]

    def budget_s(self) -> float:
        """The longest total time spent waiting between attempts."""
        return sum(self.delays()) * (1 + self.jitter)


def describe_failure(exc: BaseException) -> str:
    """`HTTP 429 Too Many Requests` for API errors (their repr shows neither), else the exception's repr."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and status:
        reason = getattr(exc, "reason", None) or ""
        return f"HTTP {status} {reason}".rstrip()
    return repr(exc)


async def call_with_retry(
    fn: Callable[[], Awaitable[T]],
    *,
    policy: RetryPolicy = RetryPolicy(),
    what: str = "Kubernetes API call",
    on_retry: Callable[[BaseException], None] | None = None,
) -> T:
    """Await `fn()` until it succeeds, retrying transient failures per `policy`; re-raise the last error."""
    delays = policy.delays()
    for attempt in range(len(delays) + 1):
        try:
            return await fn()
        except Exception as exc:
            if not is_retryable(exc) or attempt >= len(delays):
                raise
            delay = delays[attempt] * (1 + random.uniform(0, policy.jitter))
            hinted = retry_after_s(exc)
            if hinted is not None:
                delay = min(policy.max_s, max(delay, hinted))
            log.info("%s failed (%s); retry %d in %.2fs", what, describe_failure(exc), attempt + 1, delay)
            if on_retry is not None:
                on_retry(exc)
            await asyncio.sleep(delay)
    raise AssertionError("unreachable")
