"""The services read which schema they start on: `schema_revisions` (each applied migration and the oldest
revision whose services run on the schema it leaves) and SELECT on it and on `alembic_version` for the
services' roles.

A service compares the database's revision with its own before it starts (`shared/ledger/schema_version.py`):
older, it waits and says to run `gpushare migrate`; newer, it runs when the newer schema still supports it.
Additive only: the previous release's services run unchanged beside it (they read neither table).

Revision ID: 0010_schema_revisions
Revises: 0009_dra
Create Date: 2026-12-04
"""

import sqlalchemy as sa
from alembic import op

revision = "0010_schema_revisions"
down_revision = "0009_dra"
branch_labels = None
depends_on = None

ROLES = "gpushare_extender, gpushare_binder, gpushare_accounting"


def upgrade() -> None:
    op.create_table(
        "schema_revisions",
        sa.Column("revision", sa.Text(), primary_key=True),
        sa.Column("down_revision", sa.Text()),
        sa.Column("services_from", sa.Text(), nullable=False),
        sa.Column("applied_at", sa.DateTime(timezone=True), nullable=False, server_default=sa.func.now()),
    )
    op.execute(f"GRANT SELECT ON alembic_version, schema_revisions TO {ROLES}")


def downgrade() -> None:
    op.execute(f"REVOKE SELECT ON alembic_version FROM {ROLES}")
    op.drop_table("schema_revisions")
