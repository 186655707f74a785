"""The tables the migrations create, as SQLAlchemy metadata: the ledger's and accounting's (autogenerate's
target, and what `tests/foundation/test_migrations.py` compares with a migrated database)."""

from __future__ import annotations

from sqlalchemy import MetaData

from services.accounting.tables import metadata as accounting_metadata
from shared.ledger.models import metadata as ledger_metadata
from shared.ledger.schema_version import metadata as schema_version_metadata

METADATA: tuple[MetaData, ...] = (ledger_metadata, accounting_metadata, schema_version_metadata)
