#!/bin/sh
# Replace the placeholder secrets of k8s/base/secrets/ (change-me-...) with random ones, before the first
#   kubectl apply -k k8s/base          (docs/install.md, step 2)
# The services refuse to start with a placeholder. Secrets already generated are kept (--force makes new ones;
# after that, re-run `gpushare migrate` (the Job) so PostgreSQL gets the new role passwords, and restart NATS and
# the services). Keep your generated copy out of shared version control (or encrypt it: SOPS, sealed-secrets).
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/base/secrets"
force=no
[ "${1:-}" = "--force" ] && force=yes
for file in "$dir"/*; do
  if [ "$force" = yes ] || grep -q '^change-me' "$file"; then
    # 32 characters from [A-Za-z0-9]: safe in URLs, NATS and PostgreSQL configuration without quoting
    LC_ALL=C tr -dc 'A-Za-z0-9' </dev/urandom | head -c 32 >"$file"
    chmod 600 "$file"
    echo "generated $(basename "$file")"
  fi
done
