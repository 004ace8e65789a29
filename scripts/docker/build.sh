#!/usr/bin/env bash
# Builds the deepserve image on this machine: `deepserve:cpu` (default) or `deepserve:cuda`.
#   bash scripts/docker/build.sh [cpu|cuda]
# What a machine without registry access needs, done only where needed:
#  - BASE_IMAGE: debian:bookworm-slim if it is present or can be pulled, else one built here
#    by scripts/docker/base-image.sh (debootstrap + docker import);
#  - the CPU torch wheel from pip's --find-links folders, linked into docker/wheels/ (ignored
#    by git), when PyTorch's CPU index is what the build would otherwise need;
#  - the host's CA bundle as the build secret `ca-bundle` (a TLS-inspecting proxy), never
#    copied into a layer.
# DOCKER picks the client (default: Debian's /usr/bin/docker if present: BuildKit without
# the buildx plugin).
set -euo pipefail
cd "$(dirname "$0")/../.."
variant=${1:-cpu}
docker=${DOCKER:-$([ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker)}
tag=${IMAGE_TAG:-deepserve:$variant}
args=()
case $variant in
  cpu) ;;
  cuda)
    args+=(--build-arg "TORCH_SPEC=${TORCH_SPEC:-torch==2.11.0}"
      --build-arg TORCH_INDEX_URL=https://pypi.org/simple) ;;
  *) echo "build.sh: variant must be cpu or cuda, got $variant" >&2; exit 2 ;;
esac

base=${BASE_IMAGE:-debian:bookworm-slim}
if ! "$docker" image inspect "$base" >/dev/null 2>&1 &&
  ! timeout 60 "$docker" pull -q "$base" >/dev/null 2>&1; then
  [ -z "${BASE_IMAGE:-}" ] || { echo "build.sh: no image $base" >&2; exit 1; }
  echo "build.sh: $base cannot be pulled; building a Debian base here" >&2
  base=$(DOCKER=$docker bash scripts/docker/base-image.sh)
fi
args+=(--build-arg "BASE_IMAGE=$base")

if [ "$variant" = cpu ]; then
  # The image's Python is Debian bookworm's 3.11.
  links="${PIP_FIND_LINKS:-} $(python3 -m pip config get global.find-links 2>/dev/null || true)"
  for dir in $links; do
    for whl in "$dir"/torch-2.13.0+cpu-cp311-cp311-manylinux*_x86_64.whl; do
      [ -f "$whl" ] || continue
      ln -f "$whl" docker/wheels/ 2>/dev/null || cp -f "$whl" docker/wheels/
      echo "build.sh: torch from $whl" >&2
      break 2
    done
  done
fi

ca=${CA_BUNDLE:-/etc/ssl/certs/ca-certificates.crt}
[ -s "$ca" ] && args+=(--secret "id=ca-bundle,src=$ca")

DOCKER_BUILDKIT=1 "$docker" build -f docker/Dockerfile -t "$tag" "${args[@]}" .
echo "$tag"
