"""The services' PostgreSQL roles (created by migration 0007_service_roles) and their passwords.

`gpushare migrate` sets each role's password from `GPUSHARE_DB_PASSWORD_<SERVICE>` when given. The password
is sent as a SCRAM-SHA-256 verifier computed here, as `psql`'s `\\password` does, so the clear text never reaches
the server or its statement log.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import os
from collections.abc import Mapping

import asyncpg

from shared.ledger.db import async_url

SERVICE_ROLES = {
    "extender": "gpushare_extender",
    "binder": "gpushare_binder",
    "accounting": "gpushare_accounting",
}
PASSWORD_ENV = "GPUSHARE_DB_PASSWORD_{}"  # .format(SERVICE.upper())
SCRAM_ITERATIONS = 4096


def scram_verifier(password: str, *, salt: bytes | None = None, iterations: int = SCRAM_ITERATIONS) -> str:
    """PostgreSQL's stored form of a SCRAM-SHA-256 password (RFC 5802 / 7677)."""
    salt = salt if salt is not None else os.urandom(16)
    salted = hashlib.pbkdf2_hmac("sha256", password.encode("utf-8"), salt, iterations)
    client_key = hmac.new(salted, b"Client Key", hashlib.sha256).digest()
    stored_key = hashlib.sha256(client_key).digest()
    server_key = hmac.new(salted, b"Server Key", hashlib.sha256).digest()

    def b64(raw: bytes) -> str:
        return base64.b64encode(raw).decode("ascii")

    return f"SCRAM-SHA-256${iterations}:{b64(salt)}${b64(stored_key)}:{b64(server_key)}"


def passwords_from_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """{role: password} for every `GPUSHARE_DB_PASSWORD_<SERVICE>` that is set."""
    env = os.environ if env is None else env
    out = {}
    for service, role in SERVICE_ROLES.items():
        value = env.get(PASSWORD_ENV.format(service.upper()))
        if value:
            out[role] = value
    return out


async def set_passwords(database_url: str, passwords: Mapping[str, str]) -> None:
    """Give each role its password (the caller must own the roles or hold CREATEROLE with admin on them)."""
    if not passwords:
        return
    unknown = set(passwords) - set(SERVICE_ROLES.values())
    if unknown:
        raise ValueError(f"not gpushare service roles: {sorted(unknown)}")
    url = async_url(database_url).replace("postgresql+asyncpg://", "postgresql://", 1)
    conn = await asyncpg.connect(url)
    try:
        for role, password in passwords.items():
            # the verifier is base64, digits and `$:` only: safe inside a literal; role names are ours
            await conn.execute(f"ALTER ROLE {role} WITH LOGIN PASSWORD '{scram_verifier(password)}'")
    finally:
        await conn.close()
