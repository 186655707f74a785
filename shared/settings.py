"""Configuration shared by every gpushare command: flags override `GPUSHARE_*` environment variables."""

from __future__ import annotations

from enum import StrEnum
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from shared.quantities import parse_duration, parse_size

DEFAULT_STREAM = "GPUSHARE"
DEFAULT_SUBJECT_PREFIX = "gpushare"
ACCOUNTING_PORT = 8080  # accounting's default listen port


class MemoryUnit(StrEnum):
    """The unit of `aliyun.com/gpu-mem` quantities (gpushare's convention: GiB unless configured)."""

    GIB = "GiB"
    MIB = "MiB"

    @property
    def mib(self) -> int:
        """How many MiB one unit holds."""
        return 1024 if self is MemoryUnit.GIB else 1


class Settings(BaseSettings):
    """Settings common to all services. Each field is also `GPUSHARE_<NAME>` in the environment."""

    model_config = SettingsConfigDict(env_prefix="GPUSHARE_", extra="ignore")

    database_url: SecretStr | None = Field(
        default=None, description="PostgreSQL URL, e.g. postgresql://gpushare_binder@db:5432/gpushare"
    )
    database_password: SecretStr | None = Field(
        default=None, description="password for the URL's user, when the URL carries none (from a Secret)"
    )
    nats_url: str | None = Field(
        default=None,
        description="NATS URL, e.g. nats://nats:4222; a cluster's servers comma-separated "
        "(nats://nats-0:4222,nats://nats-1:4222,nats://nats-2:4222)",
    )
    nats_user: str | None = Field(default=None, description="NATS user (its password: GPUSHARE_NATS_PASSWORD)")
    nats_password: SecretStr | None = Field(default=None, description="NATS password of GPUSHARE_NATS_USER")
    nats_token: SecretStr | None = Field(default=None, description="NATS authentication token")
    nats_creds: Path | None = Field(default=None, description="NATS credentials file (user JWT and NKey seed)")
    nats_nkey_seed: Path | None = Field(default=None, description="file holding a NATS user NKey seed")
    nats_tls_cert: Path | None = Field(default=None, description="TLS client certificate for NATS")
    nats_tls_key: Path | None = Field(default=None, description="private key of GPUSHARE_NATS_TLS_CERT")
    nats_tls_ca: Path | None = Field(default=None, description="CA bundle that signs the NATS server's certificate")
    nats_inbox_prefix: str | None = Field(
        default=None, description="subject prefix of this client's replies (default _INBOX.<user> when a user is set)"
    )
    accounting_url: str = Field(
        default=f"http://127.0.0.1:{ACCOUNTING_PORT}", description="Where clients reach accounting"
    )
    log_level: str = Field(default="INFO", description="DEBUG, INFO, WARNING or ERROR")
    log_format: str = Field(default="json", description="json (one object a line) or text")
    resource_memory_unit: MemoryUnit = Field(default=MemoryUnit.GIB, description="Unit of aliyun.com/gpu-mem")
    stream_name: str = Field(default=DEFAULT_STREAM, description="JetStream stream holding every event")
    subject_prefix: str = Field(default=DEFAULT_SUBJECT_PREFIX, description="First token of every event subject")
    stream_replicas: int = Field(
        default=1,
        ge=1,
        le=5,
        description="JetStream copies of every stream and of the snapshot store: 1 for a single NATS server, 3 for "
        "a 3-server cluster (a stream with fewer is raised to it at start; never lowered)",
    )
    db_pool_size: int | None = Field(
        default=None,
        ge=1,
        le=200,
        description="PostgreSQL connections one service process keeps at most (default per service: extender 6, "
        "binder 5, accounting 3)",
    )
    db_idle_transaction_timeout: float = Field(
        default=10.0,
        ge=0,
        description="Seconds PostgreSQL lets a service's session sit inside a transaction before ending it, so a "
        "stalled process cannot hold ledger locks for ever (0: no limit)",
    )
    db_timeout: float = Field(
        default=5.0,
        gt=0,
        le=300,
        description="Seconds a service waits for PostgreSQL to connect, lend a pooled connection, grant a lock or "
        "confirm a COMMIT before it answers that the ledger cannot (and why); a statement gets 6 times that",
    )
    samples_max_age: float = Field(
        default=86_400.0, description="How long the samples stream keeps usage and refused events (24h; 0: no limit)"
    )
    samples_max_bytes: int = Field(default=0, description="Size cap of the samples stream (e.g. 2GiB; 0: none)")
    ledger_max_age: float = Field(
        default=0.0,
        description="Age limit of the ledger stream (0: none; the snapshot job trims what a snapshot covers). "
        "Keep it well above the snapshot interval",
    )
    ledger_max_bytes: int = Field(default=0, description="Size cap of the ledger stream (0: none)")
    snapshot_interval: float = Field(
        default=3_600.0, description="How often accounting writes a ledger snapshot and trims the streams (0: never)"
    )
    snapshot_keep: int = Field(default=3, ge=1, le=100, description="Ledger snapshots kept in the object store")
    dedupe_horizon: float = Field(
        default=7 * 86_400.0,
        description="How long consumers remember applied event ids (applied_events rows, ids in snapshots)",
    )
    usage_full_resolution: float = Field(
        default=86_400.0, description="Usage samples younger than this are kept as sampled (24h)"
    )
    usage_downsample_interval: float = Field(
        default=300.0,
        description="Older usage samples are thinned to one sample time per node per interval (5m; 0: not thinned)",
    )
    usage_retention: float = Field(default=30 * 86_400.0, description="Usage samples older than this are deleted (30d)")
    data_dir: Path = Field(default=Path(".gpushare"), description="Where `gpushare up` keeps its data")
    admin_token: SecretStr | None = Field(default=None, description="Bearer token required by mutating REST endpoints")
    allow_dev_secrets: bool = Field(
        default=False,
        description="start even with the shipped placeholder secrets (change-me...): local development only",
    )

    @field_validator(
        "samples_max_age",
        "ledger_max_age",
        "snapshot_interval",
        "dedupe_horizon",
        "usage_full_resolution",
        "usage_downsample_interval",
        "usage_retention",
        mode="before",
    )
    @classmethod
    def _duration(cls, value: object) -> float:
        return parse_duration(value)

    @field_validator("samples_max_bytes", "ledger_max_bytes", mode="before")
    @classmethod
    def _size(cls, value: object) -> int:
        return parse_size(value)

    @field_validator("log_level")
    @classmethod
    def _upper_level(cls, value: str) -> str:
        value = value.upper()
        if value not in {"DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"}:
            raise ValueError(f"unknown log level {value!r}")
        return value

    def require_database_url(self) -> str:
        """The database URL, or a clear error naming the setting when it is missing."""
        if self.database_url is None:
            raise SystemExit("no database configured: set GPUSHARE_DATABASE_URL or pass --database-url")
        url = self.database_url.get_secret_value()
        if self.database_password is None:
            return url
        return with_password(url, self.database_password.get_secret_value())

    def require_nats_url(self) -> str:
        """The NATS URL, or a clear error naming the setting when it is missing."""
        if not self.nats_url:
            raise SystemExit("no NATS server configured: set GPUSHARE_NATS_URL or pass --nats-url")
        return self.nats_url


def with_password(url: str, password: str) -> str:
    """`url` with `password` for its user (quoted for the URL); a URL that has a password keeps it."""
    parts = urlsplit(url)
    if parts.password is not None:
        return url
    if not parts.username:
        raise SystemExit("GPUSHARE_DATABASE_PASSWORD needs a user in GPUSHARE_DATABASE_URL (postgresql://USER@host/db)")
    host = parts.netloc.rsplit("@", 1)[-1]
    netloc = f"{parts.username}:{quote(password, safe='')}@{host}"
    return urlunsplit((parts.scheme, netloc, parts.path, parts.query, parts.fragment))
