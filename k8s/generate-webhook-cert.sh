#!/bin/sh
# Make the serving certificate of gpushare admission (the DRA webhook the extender serves, docs/dra.md) and the CA
# that signs it, in k8s/overlays/dra/tls/ (tls.crt, tls.key, ca.crt), before the first
#   kubectl apply -k k8s/overlays/dra
# The shipped files are placeholders (change-me...): the extender refuses to start with them. A certificate
# already generated is kept (--force makes new ones; apply the overlay again and restart the extender after).
# kube-apiserver calls the webhook at gpushare-extender.<namespace>.svc (GPUSHARE_NAMESPACE, default
# gpushare-system); the CA reaches the webhook configuration's caBundle through the overlay. Valid DAYS days
# (GPUSHARE_CERT_DAYS, default 825). Keep ca.key out of shared version control; it is needed only to re-issue.
set -eu
dir="$(cd "$(dirname "$0")" && pwd)/overlays/dra/tls"
namespace="${GPUSHARE_NAMESPACE:-gpushare-system}"
days="${GPUSHARE_CERT_DAYS:-825}"
force=no
[ "${1:-}" = "--force" ] && force=yes
if [ "$force" = no ] && ! grep -q '^change-me' "$dir/tls.crt" 2>/dev/null && [ -s "$dir/tls.crt" ]; then
  echo "kept the webhook certificate in $dir (--force makes a new one)"
  exit 0
fi
command -v openssl >/dev/null || { echo "openssl is needed to make the webhook certificate" >&2; exit 1; }
host="gpushare-extender.$namespace.svc"
work="$(mktemp -d)"
trap 'rm -rf "$work"' EXIT
openssl req -x509 -newkey rsa:2048 -nodes -days "$days" -subj "/CN=gpushare-admission-ca" \
  -keyout "$dir/ca.key" -out "$dir/ca.crt" 2>/dev/null
openssl req -newkey rsa:2048 -nodes -subj "/CN=$host" -keyout "$dir/tls.key" -out "$work/tls.csr" 2>/dev/null
printf 'subjectAltName=DNS:%s,DNS:gpushare-extender.%s.svc.cluster.local\nextendedKeyUsage=serverAuth\n' \
  "$host" "$namespace" >"$work/ext"
openssl x509 -req -in "$work/tls.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" -CAcreateserial \
  -CAserial "$work/ca.srl" -days "$days" -extfile "$work/ext" -out "$dir/tls.crt" 2>/dev/null
chmod 600 "$dir/tls.key" "$dir/ca.key"
echo "generated the webhook certificate for $host (tls.crt, tls.key) and its CA (ca.crt) in $dir"
