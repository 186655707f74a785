# Sourced by the postgres image's entrypoint on the first start (empty data directory), in Kubernetes
# (ConfigMap postgres-init) and docker-compose alike: the migration Job's user, which owns database gpushare and
# creates the services' roles (migration 0007_service_roles). GPUSHARE_MIGRATE_PASSWORD comes from the Secret.
psql -v ON_ERROR_STOP=1 --username "${POSTGRES_USER:-postgres}" --dbname postgres \
  --set=pw="$GPUSHARE_MIGRATE_PASSWORD" <<'SQL'
CREATE ROLE gpushare_migrate LOGIN CREATEROLE PASSWORD :'pw';
CREATE DATABASE gpushare OWNER gpushare_migrate;
SQL
