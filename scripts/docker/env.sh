#!/usr/bin/env bash
# Writes .env beside compose.yaml with fresh secrets (docs/security.md) and one API key, unless
# it exists; docker compose reads it. The key is printed once. Mode 0600: the file is private.
#   bash scripts/docker/env.sh [TENANT]
set -euo pipefail
cd "$(dirname "$0")/../.."
if [ -e .env ]; then
  echo ".env exists; remove it to start over" >&2
  exit 1
fi
hex() { python3 -c "import secrets; print(secrets.token_hex($1))"; }
key="sk-$(hex 24)"
umask 077
cat >.env <<ENV
DEEPSERVE_API_KEYS=$key=${1:-default}
DEEPSERVE_SERVICE_TOKEN=$(hex 32)
DEEPSERVE_CACHE_SALT_SECRET=$(hex 32)
DEEPSERVE_KV_MAC_KEY=$(hex 32)
ENV
echo "wrote .env; API key for tenant ${1:-default}: $key"
