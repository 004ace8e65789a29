#!/usr/bin/env bash
# Creates the virtualenv and installs the project with its test extras. Safe to re-run.
set -euo pipefail
venv=${1:-.venv}
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# torch==2.13.0 (CPU) installs from this machine's disk; see pyproject.toml.
"$venv/bin/python" -m pip install -q -e '.[test]'
