#!/usr/bin/env bash
# Prepares this machine to run docker-compose.yml with podman, as root, with no
# container registry reachable (see docs/deployment.md, "The compose check"):
#
#   1. podman, runc, debootstrap from Debian (apt-get), if missing;
#   2. a containers.conf of the check's own (runc, default ulimits, cgroupfs, file
#      events): exported as CONTAINERS_CONF by check.py, never installed system-wide
#      and never written into the compose file users run;
#   3. base images nothing can pull here, built from Debian packages:
#        debian:bookworm-slim   debootstrap --variant=minbase + podman import
#        python:3.11-slim       FROM debian:bookworm-slim + Debian's python3.11 and its
#                               headers (the exact name deploy/Dockerfile's FROM uses)
#        ferry-check/redis      FROM debian:bookworm-slim + redis-server (FERRY_REDIS_IMAGE)
#        ferry-check/prometheus FROM debian:bookworm-slim + prometheus (FERRY_PROMETHEUS_IMAGE)
#      Grafana is published neither by Debian nor as a server on PyPI or npm: no image;
#   4. podman-compose (pinned) in a tool venv under the state folder.
#
# Idempotent: an image or tool already there is kept. State: $FERRY_CHECK_STATE
# (default ~/.cache/ferry-compose-check). Prints KEY=VALUE lines for check.py last.
set -euo pipefail

HERE=$(cd "$(dirname "$0")" && pwd)
STATE=${FERRY_CHECK_STATE:-${XDG_CACHE_HOME:-$HOME/.cache}/ferry-compose-check}
PODMAN_COMPOSE_VERSION=1.6.0
MIRROR=${FERRY_CHECK_DEBIAN_MIRROR:-http://deb.debian.org/debian}
mkdir -p "$STATE"
log() { echo "prepare: $*" >&2; }

[ "$(id -u)" = 0 ] || { log "needs root (podman with runc and cgroupfs, debootstrap)"; exit 2; }

missing=()
for tool in podman:podman runc:runc debootstrap:debootstrap catatonit:/usr/libexec/podman/catatonit; do
  pkg=${tool%%:*}; bin=${tool#*:}
  command -v "$bin" >/dev/null 2>&1 || [ -x "$bin" ] || missing+=("$pkg")
done
if [ ${#missing[@]} -gt 0 ]; then
  log "apt-get install ${missing[*]}"
  apt-get update -q >&2
  DEBIAN_FRONTEND=noninteractive apt-get install -y -q "${missing[@]}" >&2
fi

# crun fails here with "cgroups in hybrid mode not supported", and setting the default
# rlimits fails with "Operation not permitted" unless they are pinned below the host's.
CONF="$STATE/containers.conf"
cat > "$CONF" <<EOF
# Written by deploy/compose-check/prepare.sh for the compose check only.
[containers]
default_ulimits = ["nofile=1024:1024", "nproc=1000:1000"]

[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"

[engine.runtimes]
runc = ["/usr/sbin/runc"]
EOF
export CONTAINERS_CONF="$CONF"

build() {  # build TAG CONTAINERFILE: host network (apt, PyPI), no registry pulls
  local tag=$1 file=$2
  if podman image exists "$tag"; then log "$tag: present"; return; fi
  log "building $tag from $file"
  podman build --pull=never --network host -f "$file" -t "$tag" "$HERE" >&2
}

if podman image exists docker.io/library/debian:bookworm-slim; then
  log "debian:bookworm-slim: present"
else
  root="$STATE/rootfs"
  rm -rf "$root"
  log "debootstrap bookworm (minbase) into $root"
  debootstrap --variant=minbase bookworm "$root" "$MIRROR" >&2
  # What the official slim images drop: package lists, docs, man pages, locales.
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb \
         "$root"/usr/share/doc/* "$root"/usr/share/man/* "$root"/usr/share/info/* "$root"/var/log/*.log
  tar -C "$root" --numeric-owner -c . | podman import \
    --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
    --change 'CMD ["bash"]' - docker.io/library/debian:bookworm-slim >&2
  rm -rf "$root"
fi
# A stand-in built before it carried CPython's headers (the kernels stage needs them) is
# built again: untagged, so the images built on it are kept.
if podman image exists docker.io/library/python:3.11-slim \
   && ! podman run --rm --pull=never --network none docker.io/library/python:3.11-slim \
        test -f /usr/include/python3.11/Python.h >&2; then
  log "python:3.11-slim: without CPython's headers, built again"
  podman untag docker.io/library/python:3.11-slim >&2
fi
build docker.io/library/python:3.11-slim "$HERE/python-slim.Containerfile"
build localhost/ferry-check/redis:bookworm "$HERE/redis.Containerfile"
build localhost/ferry-check/prometheus:bookworm "$HERE/prometheus.Containerfile"

TOOLS="$STATE/tools"
if ! "$TOOLS/bin/podman-compose" version 2>/dev/null | grep -q "$PODMAN_COMPOSE_VERSION"; then
  log "podman-compose==$PODMAN_COMPOSE_VERSION into $TOOLS"
  rm -rf "$TOOLS"
  python3 -m venv "$TOOLS"
  "$TOOLS/bin/pip" install -q "podman-compose==$PODMAN_COMPOSE_VERSION" >&2
fi

echo "CONTAINERS_CONF=$CONF"
echo "PODMAN_COMPOSE=$TOOLS/bin/podman-compose"
echo "FERRY_REDIS_IMAGE=localhost/ferry-check/redis:bookworm"
echo "FERRY_PROMETHEUS_IMAGE=localhost/ferry-check/prometheus:bookworm"
