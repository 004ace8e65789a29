#!/usr/bin/env bash
# Writes .env beside compose.yaml with fresh secrets (docs/security.md) and one API key, unless
# it exists; docker compose reads it. The key is printed once. Mode 0600: the file is private.
# The secrets include one NATS password per service role (DEEPSERVE_NATS_PASSWORD_<ROLE>, the
# roles of libs/common/nats_auth.py), which compose requires: an existing .env that lacks some
# of them gets only those added, nothing else in it changes.
#   bash scripts/docker/env.sh [TENANT]
set -euo pipefail
cd "$(dirname "$0")/../.."
NATS_ROLES="recipe entrypoint balancer prefill decode aggregated kvstore tools"
hex() { python3 -c "import secrets; print(secrets.token_hex($1))"; }
nats_var() { echo "DEEPSERVE_NATS_PASSWORD_$(echo "$1" | tr '[:lower:]' '[:upper:]')"; }
umask 077
if [ -e .env ]; then
  added=""
  if [ -s .env ] && [ -n "$(tail -c1 .env)" ]; then echo >>.env; fi  # ends its last line
  for role in $NATS_ROLES; do
    var=$(nats_var "$role")
    if ! grep -Eq "^${var}=.+" .env; then
      # hex: nats-server reads a password of digits only as a number
      echo "${var}=$(hex 24)" >>.env
      added="$added $role"
    fi
  done
  if [ -n "$added" ]; then
    echo "added NATS passwords to .env for:$added"
    exit 0
  fi
  echo ".env exists; remove it to start over" >&2
  exit 1
fi
key="sk-$(hex 24)"
{
  echo "DEEPSERVE_API_KEYS=$key=${1:-default}"
  echo "DEEPSERVE_SERVICE_TOKEN=$(hex 32)"
  echo "DEEPSERVE_CACHE_SALT_SECRET=$(hex 32)"
  echo "DEEPSERVE_KV_MAC_KEY=$(hex 32)"
  echo "DEEPSERVE_TENANT_LABEL_SECRET=$(hex 32)"
  for role in $NATS_ROLES; do
    echo "$(nats_var "$role")=$(hex 24)"
  done
} >.env
echo "wrote .env; API key for tenant ${1:-default}: $key"
