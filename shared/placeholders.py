"""The shipped placeholder secrets (`change-me...`) are refused: a service started with one stops and says which
setting holds it, unless local development says otherwise (`GPUSHARE_ALLOW_DEV_SECRETS=true`).

The manifests in k8s/ ship placeholders so that they render; `k8s/generate-secrets.sh` replaces them
(docs/install.md, step 2). A cluster that skipped that step must not run with passwords anyone can read in the
repository.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any
from urllib.parse import unquote, urlsplit

log = logging.getLogger(__name__)

PLACEHOLDER = "change-me"


def _is_placeholder(value: str | None) -> bool:
    return value is not None and PLACEHOLDER in value.lower()


def _url_secrets(url: str | None) -> list[str]:
    """The password (or bare token) of each server in a URL (NATS takes comma-separated lists)."""
    out = []
    for server in (url or "").split(","):
        server = server.strip()
        if "://" not in server:
            continue
        parts = urlsplit(server)
        if parts.password is not None:
            out.append(unquote(parts.password))
        elif parts.username and parts.scheme in {"nats", "tls", "ws", "wss"}:
            out.append(unquote(parts.username))  # nats://TOKEN@host
    return out


def placeholder_settings(settings: Any, extra: Mapping[str, str | None] | None = None) -> list[str]:
    """Names of the settings (environment variables) that hold a placeholder secret."""

    def secret(value: Any) -> str | None:
        return value.get_secret_value() if value is not None else None

    found = []
    if any(_is_placeholder(s) for s in _url_secrets(secret(settings.database_url))):
        found.append("GPUSHARE_DATABASE_URL")
    if any(_is_placeholder(s) for s in _url_secrets(settings.nats_url)):
        found.append("GPUSHARE_NATS_URL")
    for name in ("database_password", "nats_password", "nats_token", "admin_token"):
        if _is_placeholder(secret(getattr(settings, name))):
            found.append(f"GPUSHARE_{name.upper()}")
    found += [name for name, value in (extra or {}).items() if _is_placeholder(value)]
    return found


def refuse_placeholders(settings: Any, extra: Mapping[str, str | None] | None = None) -> None:
    """Stop (SystemExit with the reason) when a secret is still the shipped placeholder; with
    `allow_dev_secrets` only warn."""
    found = placeholder_settings(settings, extra)
    if not found:
        return
    names = ", ".join(found)
    if settings.allow_dev_secrets:
        log.warning(
            "running with the shipped placeholder secrets (%s) because GPUSHARE_ALLOW_DEV_SECRETS is set: "
            "development only",
            names,
        )
        return
    raise SystemExit(
        f"refusing to start: {names} still hold the shipped placeholder secret ({PLACEHOLDER}...). Generate real "
        "secrets (k8s/generate-secrets.sh, docs/install.md step 2), or set GPUSHARE_ALLOW_DEV_SECRETS=true for "
        "local development."
    )
