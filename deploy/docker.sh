#!/usr/bin/env bash
# A Docker engine and both Compose tools, for the container tests and `docker compose up`:
# Debian's docker.io (the engine), docker-compose 1.29 and debootstrap (deploy/images.sh),
# installed when missing; dockerd started when no engine answers (its log: build/dockerd.log);
# and Compose v2 (`docker compose`), which Debian does not package, built from the Go module
# proxy into /usr/local/lib/docker/cli-plugins when `docker compose` is missing. Needs root
# for what it installs or starts; does nothing where everything is already there.
set -euo pipefail
cd "$(dirname "$0")/.."
COMPOSE_VERSION=v2.40.3
mkdir -p build  # the logs of what this runs

missing=()
command -v dockerd > /dev/null || missing+=(docker.io)
command -v docker-compose > /dev/null || missing+=(docker-compose)
command -v debootstrap > /dev/null || missing+=(debootstrap)
if [ ${#missing[@]} -gt 0 ]; then
  [ "$(id -u)" = 0 ] || { echo "docker: ${missing[*]} missing; install them as root: apt-get install ${missing[*]}" >&2; exit 1; }
  echo "docker: installing ${missing[*]} (Debian)"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive NEEDRESTART_SUSPEND=1 apt-get install -y -qq "${missing[@]}"; } > build/apt.log 2>&1 \
    || { tail -n 5 build/apt.log >&2; exit 1; }
fi

if ! docker info > /dev/null 2>&1; then
  echo "docker: starting dockerd"
  setsid dockerd > build/dockerd.log 2>&1 < /dev/null &
  for _ in $(seq 60); do docker info > /dev/null 2>&1 && break; sleep 0.5; done
  docker info > /dev/null 2>&1 || { echo "docker: dockerd did not start; see build/dockerd.log" >&2; exit 1; }
fi

if ! docker compose version > /dev/null 2>&1; then
  echo "docker: building Compose $COMPOSE_VERSION from the Go module proxy (first time only)"
  src=$(go mod download -json "github.com/docker/compose/v2@$COMPOSE_VERSION" | sed -n 's/.*"Dir": "\(.*\)",/\1/p')
  mkdir -p /usr/local/lib/docker/cli-plugins
  (cd "$src" && go build -trimpath -ldflags "-X github.com/docker/compose/v2/internal.Version=$COMPOSE_VERSION" \
    -o /usr/local/lib/docker/cli-plugins/docker-compose ./cmd) > build/compose-build.log 2>&1 || { tail -n 5 build/compose-build.log >&2; exit 1; }
fi
