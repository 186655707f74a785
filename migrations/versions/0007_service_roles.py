"""One PostgreSQL role per service, each granted only the tables and columns its code uses.

- `gpushare_extender`: reserve (insert allocations and their parts, raise GPU counters), stage and relay
  events; read the rest of its view.
- `gpushare_binder`: what the ledger's life cycle and the node agents' gateway write (no quota changes, no
  deletes but the outbox's).
- `gpushare_accounting`: its read models, quotas (through the ledger), its idempotency claims, the outbox;
  read the ledger; prune samples, refusals and old claims (housekeeping).

The node agents have no role: they never connect to PostgreSQL (the binder's gateway writes for them). The
schema's owner (who runs this migration: `gpushare_migrate` in the shipped manifests) keeps every right; the
roles are created here with LOGIN and no password (`gpushare migrate` sets passwords from
GPUSHARE_DB_PASSWORD_<SERVICE>), or may exist already (a DBA's; then CREATEROLE is not needed). Roles are
cluster-wide: a downgrade revokes what this database granted and keeps them.

`tests/security/test_db_grants.py` derives each service's privileges from its code (`tests/security/sql_usage.py`)
and compares them with what PostgreSQL reports after this migration: a later change that needs another
privilege needs a migration that grants it.

Revision ID: 0007_service_roles
Revises: 0006_retention_indexes
Create Date: 2026-12-03
"""

from alembic import op

revision = "0007_service_roles"
down_revision = "0006_retention_indexes"
branch_labels = None
depends_on = None

GRANTS: dict[str, dict[str, str]] = {
    "gpushare_extender": {
        "nodes": "SELECT",
        "gpus": "SELECT, UPDATE (allocated_memory_mib, allocated_compute, updated_at)",
        "allocations": "SELECT, INSERT",
        "allocation_parts": "SELECT, INSERT",
        "quotas": "SELECT",
        "outbox": "SELECT, INSERT, DELETE",
    },
    "gpushare_binder": {
        "nodes": "SELECT, INSERT, UPDATE (driver_version, cuda_version, labels, retired_at, updated_at)",
        "gpus": "SELECT, INSERT, UPDATE (node, index, model, memory_mib, memory_total_mib, compute_units, "
        "allocated_memory_mib, allocated_compute, healthy, health_reason, mig_mode, numa_node, pci_bus_id, "
        "retired_at, updated_at)",
        "allocations": "SELECT, INSERT, UPDATE (state, reason, bound_at, assigned_at, ended_at, terminating_at, "
        "version)",
        "allocation_parts": "SELECT, INSERT, UPDATE (gpu_uuid, gpu_index, assigned_at)",
        "quotas": "SELECT",
        "applied_events": "SELECT, INSERT",
        "outbox": "SELECT, INSERT, DELETE",
    },
    "gpushare_accounting": {
        "nodes": "SELECT",
        "gpus": "SELECT",
        "allocations": "SELECT",
        "allocation_parts": "SELECT",
        "quotas": "SELECT, INSERT, DELETE, UPDATE (memory_mib, compute, updated_at)",
        "applied_events": "SELECT, INSERT, DELETE",  # claims past the dedupe horizon are pruned
        "outbox": "SELECT, INSERT, DELETE",
        "usage_samples": "SELECT, INSERT, DELETE",  # thinned and expired samples are pruned
        "acc_timeline": "SELECT, INSERT",
        "acc_pending": "SELECT, INSERT, DELETE, UPDATE (event_id, namespace, pod_name, summary, reasons, refused_at)",
    },
}
ROLES = tuple(GRANTS)


def upgrade() -> None:
    for role in ROLES:
        op.execute(
            f"DO $$ BEGIN IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') "
            f"THEN CREATE ROLE {role} LOGIN; END IF; END $$"
        )
    roles = ", ".join(ROLES)
    op.execute(f"DO $$ BEGIN EXECUTE format('GRANT CONNECT ON DATABASE %I TO {roles}', current_database()); END $$")
    op.execute(f"GRANT USAGE ON SCHEMA public TO {roles}")
    op.execute("REVOKE ALL ON ALL TABLES IN SCHEMA public FROM PUBLIC")
    for role, tables in GRANTS.items():
        for table, privileges in tables.items():
            op.execute(f"GRANT {privileges} ON {table} TO {role}")


def downgrade() -> None:
    roles = ", ".join(ROLES)
    op.execute(f"REVOKE ALL ON ALL TABLES IN SCHEMA public FROM {roles}")
    op.execute(f"REVOKE USAGE ON SCHEMA public FROM {roles}")
    op.execute(f"DO $$ BEGIN EXECUTE format('REVOKE CONNECT ON DATABASE %I FROM {roles}', current_database()); END $$")
