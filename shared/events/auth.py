"""How a service proves who it is to NATS: user and password, token, credentials file (JWT + NKey), NKey seed,
TLS client certificate; and the inbox prefix its replies come to.

Each gpushare service has its own NATS user in the shipped configuration (`k8s/base/nats-auth.conf`) with
publish/subscribe permissions limited to its subjects, including its own inbox prefix (`_INBOX.<user>` unless
set): a node agent then cannot read the replies meant for the binder or the extender. Settings come from
`GPUSHARE_NATS_*` (see `shared.settings.Settings`); a user and password may also be written in the URL.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import unquote, urlsplit


class NatsAuthError(SystemExit):
    """The NATS credentials are incomplete or point at files that are not there: the process stops with a message
    naming the setting (as `Settings.require_nats_url` does)."""


@dataclass(frozen=True)
class NatsAuth:
    """Credentials and client-certificate settings for one NATS connection (all optional)."""

    user: str | None = None
    password: str | None = None
    token: str | None = None
    creds_file: Path | None = None
    nkey_seed_file: Path | None = None
    tls_cert: Path | None = None
    tls_key: Path | None = None
    tls_ca: Path | None = None
    inbox_prefix: str | None = None

    @classmethod
    def from_settings(cls, settings: Any) -> NatsAuth:
        """From `shared.settings.Settings` (its `nats_*` fields)."""

        def secret(value: Any) -> str | None:
            return value.get_secret_value() if value is not None else None

        return cls(
            user=settings.nats_user,
            password=secret(settings.nats_password),
            token=secret(settings.nats_token),
            creds_file=settings.nats_creds,
            nkey_seed_file=settings.nats_nkey_seed,
            tls_cert=settings.nats_tls_cert,
            tls_key=settings.nats_tls_key,
            tls_ca=settings.nats_tls_ca,
            inbox_prefix=settings.nats_inbox_prefix,
        )

    def inbox(self, url: str | None = None) -> str | None:
        """The inbox prefix: the one set, else `_INBOX.<user>` when a user is known (set, or in the URL)."""
        if self.inbox_prefix:
            return self.inbox_prefix
        user = self.user or _url_user(url)
        return f"_INBOX.{user}" if user else None

    def options(self, url: str | None = None) -> dict[str, Any]:
        """Keyword arguments for `nats.connect` (raises NatsAuthError naming what is wrong)."""
        if bool(self.tls_cert) != bool(self.tls_key):
            raise NatsAuthError("GPUSHARE_NATS_TLS_CERT and GPUSHARE_NATS_TLS_KEY go together")
        if self.password is not None and not (self.user or _url_user(url)):
            raise NatsAuthError("GPUSHARE_NATS_PASSWORD needs GPUSHARE_NATS_USER (or a user in the NATS URL)")
        for what, path in (
            ("GPUSHARE_NATS_CREDS", self.creds_file),
            ("GPUSHARE_NATS_NKEY_SEED", self.nkey_seed_file),
            ("GPUSHARE_NATS_TLS_CERT", self.tls_cert),
            ("GPUSHARE_NATS_TLS_KEY", self.tls_key),
            ("GPUSHARE_NATS_TLS_CA", self.tls_ca),
        ):
            if path is not None and not Path(path).is_file():
                raise NatsAuthError(f"{what} names {path}, which is not a readable file")
        out: dict[str, Any] = {}
        if self.user:
            out["user"] = self.user
        if self.password is not None:
            out["password"] = self.password
        if self.token is not None:
            out["token"] = self.token
        if self.creds_file is not None:
            out["user_credentials"] = str(self.creds_file)
        if self.nkey_seed_file is not None:
            out["nkeys_seed"] = str(self.nkey_seed_file)
        if self.tls_ca is not None or self.tls_cert is not None:
            context = ssl.create_default_context(cafile=str(self.tls_ca) if self.tls_ca else None)
            if self.tls_cert is not None:
                try:
                    context.load_cert_chain(str(self.tls_cert), str(self.tls_key))
                except (ssl.SSLError, OSError) as exc:
                    raise NatsAuthError(f"the NATS client certificate could not be loaded: {exc}") from None
            out["tls"] = context
        inbox = self.inbox(url)
        if inbox:
            out["inbox_prefix"] = inbox
        return out


def _url_user(url: str | None) -> str | None:
    """The user of `nats://user:password@host` (None for a token-only URL or none at all)."""
    if not url:
        return None
    first = url.split(",", 1)[0].strip()
    parts = urlsplit(first if "://" in first else f"nats://{first}")
    if parts.username and parts.password is not None:
        return unquote(parts.username)
    return None
