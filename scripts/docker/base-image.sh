#!/usr/bin/env bash
# Builds a Debian base image locally, for machines that cannot pull from an image registry:
# debootstrap (minbase) of the suite into a scratch folder, then `docker import`. The
# Dockerfile takes it as --build-arg BASE_IMAGE=<the tag printed here>; its default is the
# public debian:bookworm-slim. Re-running with the image present does nothing.
#   bash scripts/docker/base-image.sh [TAG] [SUITE] [MIRROR]
set -euo pipefail
tag=${1:-deepserve-base:bookworm}
suite=${2:-bookworm}
mirror=${3:-http://deb.debian.org/debian}
docker=${DOCKER:-docker}
if "$docker" image inspect "$tag" >/dev/null 2>&1; then
  echo "$tag"
  exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
  echo "base-image: debootstrap needs root" >&2
  exit 1
fi
command -v debootstrap >/dev/null 2>&1 || {
  apt-get update -q && DEBIAN_FRONTEND=noninteractive apt-get install -y -q debootstrap
}
root=$(mktemp -d /var/tmp/deepserve-rootfs.XXXXXX)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase "$suite" "$root" "$mirror" >&2
# The same shape as the official slim image: no caches, no docs, apt sources for the suite.
cat >"$root/etc/apt/sources.list" <<SOURCES
deb $mirror $suite main
deb $mirror $suite-updates main
deb http://deb.debian.org/debian-security $suite-security main
SOURCES
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/* \
  "$root"/usr/share/doc/* "$root"/usr/share/man/*
tar -C "$root" -c . | "$docker" import \
  --change 'CMD ["bash"]' --change 'ENV LANG=C.UTF-8' - "$tag" >&2
echo "$tag"
