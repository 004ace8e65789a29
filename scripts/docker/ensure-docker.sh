#!/usr/bin/env bash
# Makes sure a Docker engine answers and docker-compose exists, for `make test-container`:
# installs Debian's docker.io, docker-compose and debootstrap with apt-get where they are
# missing, and starts dockerd (overlay2) in the background when no engine answers. Its log is
# .run/dockerd.log. Safe to re-run.
set -euo pipefail
cd "$(dirname "$0")/../.."
docker=${DOCKER:-$([ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker)}
missing=()
command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
command -v docker-compose >/dev/null 2>&1 || "$docker" compose version >/dev/null 2>&1 ||
  missing+=(docker-compose)
command -v debootstrap >/dev/null 2>&1 || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" -ne 0 ]; then
    echo "ensure-docker: ${missing[*]} missing and installing needs root" >&2
    exit 1
  fi
  echo "ensure-docker: installing ${missing[*]} (apt-get)"
  apt-get update -q
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}"
  docker=${DOCKER:-$([ -x /usr/bin/docker ] && echo /usr/bin/docker || echo docker)}
fi
if "$docker" info >/dev/null 2>&1; then
  exit 0
fi
mkdir -p .run
echo "ensure-docker: starting dockerd (log: .run/dockerd.log)"
nohup dockerd --storage-driver overlay2 >.run/dockerd.log 2>&1 &
for _ in $(seq 60); do
  "$docker" info >/dev/null 2>&1 && exit 0
  sleep 1
done
echo "ensure-docker: dockerd did not answer within 60 s; see .run/dockerd.log" >&2
tail -20 .run/dockerd.log >&2
exit 1
