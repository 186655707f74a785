#!/bin/sh
# The entry point of gpushare's local PostgreSQL image (Debian 12's postgresql-15, devstack/images/servers.py).
# It takes the settings the chart, the kustomize tree and docker-compose give the postgres image they name:
#   POSTGRES_PASSWORD   the superuser's password for connections over TCP (required on the first start)
#   POSTGRES_USER       the superuser's name (default postgres)
#   POSTGRES_DB         a database created on the first start (default: the superuser's name)
#   PGDATA              the data directory (default /var/lib/postgresql/data); PGPORT the port (default 5432)
# On the first start (no PG_VERSION in PGDATA) the data directory is initialised (local socket: trust; TCP:
# scram-sha-256), a server listening on its socket only runs every /docker-entrypoint-initdb.d/*.sh (sourced) and
# *.sql (psql), and stops. Then the command runs: arguments starting with "-" are the server's
# (`-c listen_addresses=127.0.0.1`). Run it as the image's user postgres (uid 999): the server refuses root.
set -eu

PGDATA="${PGDATA:-/var/lib/postgresql/data}"
export PGDATA
case "${1:-}" in
    -* | "") set -- postgres "$@" ;;
esac

say() { printf 'postgres-entrypoint: %s\n' "$*"; }

if [ "$1" = postgres ] && [ ! -s "$PGDATA/PG_VERSION" ]; then
    if [ -z "${POSTGRES_PASSWORD:-}" ]; then
        say "POSTGRES_PASSWORD is empty: set the superuser's password (the data directory $PGDATA is new)" >&2
        exit 1
    fi
    superuser="${POSTGRES_USER:-postgres}"
    say "initialising $PGDATA (superuser $superuser)"
    # the password travels on a pipe, never through a file or the command line
    printf '%s\n' "$POSTGRES_PASSWORD" | initdb --username="$superuser" --pwfile=/dev/stdin \
        --auth-local=trust --auth-host=scram-sha-256 --encoding=UTF8 --locale=C
    printf '%s\n' "host all all all scram-sha-256" >>"$PGDATA/pg_hba.conf"
    pg_ctl --pgdata="$PGDATA" --options="-c listen_addresses=''" --wait --silent start
    database="${POSTGRES_DB:-$superuser}"
    if [ "$database" != postgres ]; then
        psql -v ON_ERROR_STOP=1 --username="$superuser" --dbname=postgres --quiet \
            --command="CREATE DATABASE \"$database\""
    fi
    for script in /docker-entrypoint-initdb.d/*; do
        case "$script" in
            *.sh) say "running $script"; . "$script" ;;
            *.sql) say "running $script"; psql -v ON_ERROR_STOP=1 --username="$superuser" --dbname="$database" --file="$script" ;;
            *) if [ -e "$script" ]; then say "ignoring $script"; fi ;;
        esac
    done
    pg_ctl --pgdata="$PGDATA" --mode=fast --wait --silent stop
    say "initialised; starting the server"
fi

exec "$@"
