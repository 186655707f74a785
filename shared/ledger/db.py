"""Database connections: plain `postgresql://` URLs in, an async SQLAlchemy engine out."""

from __future__ import annotations

from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from sqlalchemy.ext.asyncio import AsyncEngine, create_async_engine


def async_url(url: str) -> str:
    """Turn any PostgreSQL URL into one for SQLAlchemy's asyncpg driver.

    Accepts `postgres://`, `postgresql://` and `postgresql+<driver>://`; maps libpq's `sslmode` to
    asyncpg's `ssl`. A `host=` query parameter (a Unix socket directory) is kept.
    """
    parts = urlsplit(url)
    if parts.scheme not in {"postgres", "postgresql"} and not parts.scheme.startswith("postgresql+"):
        raise ValueError(f"not a PostgreSQL URL (scheme {parts.scheme!r}); expected postgresql://...")
    query = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        query.append(("ssl", value) if key == "sslmode" else (key, value))
    return urlunsplit(("postgresql+asyncpg", parts.netloc, parts.path, urlencode(query), parts.fragment))


def make_engine(url: str, *, pool_size: int = 10, max_overflow: int = 10) -> AsyncEngine:
    """An async engine with a pool sized for one service process.

    No pre-ping on checkout (it costs three round trips per transaction on the hot path): after a database
    restart the first statement on each stale connection fails, SQLAlchemy then invalidates the pool, and
    the caller's retry (consumer redelivery, kube-scheduler's retry) runs on fresh connections.
    """
    return create_async_engine(
        async_url(url),
        pool_size=pool_size,
        max_overflow=max_overflow,
        pool_recycle=1800,
    )
