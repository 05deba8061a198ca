#!/usr/bin/env bash
# Builds the product's container images from what this machine reaches (Debian's packages,
# Maven Central, PyPI; no image registry): a Debian root file system made by debootstrap and
# imported as the base, then
#   memfilter/kafka   Debian's JRE + the Kafka jars the stack uses (streams/kafka-pom.xml),
#                     configured from KAFKA_* variables as apache/kafka's image is;
#   memfilter/redis   Debian's redis-server;
#   memfilter/postgres Debian's postgresql (the history's PostgreSQL tier);
#   memfilter/memfilter the project's Dockerfile: the whole product (worker, sink, agent runner, gateway, admin commands).
# Where a registry is reachable, the same files build on the official bases instead:
#   MEMFILTER_IMAGE_BASE=debian:bookworm-slim MEMFILTER_IMAGE_PYTHON=python:3.11-slim deploy/images.sh
# Images already built are kept (Docker's cache): a second run takes seconds. `--from-nothing`
# removes these images and build/images (the collected jars) first. Prints how long it took.
# Needs a running Docker engine (deploy/docker.sh starts one) and, for the local base, root.
set -euo pipefail
cd "$(dirname "$0")/.."
start=$(date +%s)
cache=build/images
base="${MEMFILTER_IMAGE_BASE:-memfilter/debian:bookworm}"
python="${MEMFILTER_IMAGE_PYTHON:-memfilter/python:3.11}"
export DOCKER_BUILDKIT=0  # the classic builder: Debian's engine has no buildx plugin

build() {  # build TAG ARGS...: one image, quietly but for errors (not the classic builder's deprecation notice)
  echo "images: $1"
  docker build -q -t "$@" > /dev/null 2> >(grep -v -e DEPRECATED -e 'BuildKit is currently disabled' -e 'environment-variable' -e '^$' >&2)
}

if [ "${1:-}" = "--from-nothing" ]; then
  docker image rm -f memfilter/memfilter memfilter/kafka memfilter/redis memfilter/postgres memfilter/python:3.11 memfilter/debian:bookworm > /dev/null 2>&1 || true
  rm -rf "$cache"
fi
mkdir -p "$cache"

if [ "$base" = memfilter/debian:bookworm ] && ! docker image inspect "$base" > /dev/null 2>&1; then
  # Debian's minimal system, trusting what this machine trusts (its certificate authorities:
  # an egress proxy's, here), so builds on it reach PyPI and Maven Central as the machine does.
  echo "images: a Debian bookworm root file system (debootstrap)"
  rootfs="$cache/rootfs"
  rm -rf "$rootfs"
  debootstrap --variant=minbase --include=ca-certificates bookworm "$rootfs" http://deb.debian.org/debian > "$cache/debootstrap.log"
  cp /usr/local/share/ca-certificates/*.crt "$rootfs/usr/local/share/ca-certificates/" 2> /dev/null || true
  chroot "$rootfs" update-ca-certificates > /dev/null 2>&1
  rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs"/var/cache/apt/*.bin
  tar -C "$rootfs" -c . | docker import - "$base" > /dev/null
  rm -rf "$rootfs"
fi
if [ "$python" = memfilter/python:3.11 ]; then
  build "$python" --build-arg BASE="$base" -f deploy/images/python.Dockerfile deploy/images
fi

# The Kafka jars, collected by Maven as `memfilter stack up` does (with its MEMFILTER_MAVEN_SETTINGS),
# are the Kafka image's context (collected again when streams/kafka-pom.xml changes).
if ! cmp -s streams/kafka-pom.xml "$cache/kafka/kafka-pom.xml"; then
  echo "images: the Kafka jars (Maven Central)"
  rm -rf "$cache/kafka"
  mvn -B ${MEMFILTER_MAVEN_SETTINGS:+-s "$MEMFILTER_MAVEN_SETTINGS"} -f streams/kafka-pom.xml dependency:copy-dependencies -DincludeScope=runtime -DoutputDirectory="$PWD/$cache/kafka/libs" \
    > "$cache/maven.log" 2>&1 || { grep ERROR "$cache/maven.log" >&2; exit 1; }
  cp streams/kafka-pom.xml "$cache/kafka/"
fi
cp deploy/images/kafka-start.sh "$cache/kafka/"
for name in kafka redis postgres; do
  context=deploy/images
  [ $name = kafka ] && context="$cache/kafka"
  build memfilter/$name --build-arg BASE="$base" -f deploy/images/$name.Dockerfile "$context"
done
build memfilter/memfilter --build-arg PYTHON="$python" .
echo "images: memfilter/kafka, memfilter/redis, memfilter/postgres, memfilter/memfilter built in $(( $(date +%s) - start )) s"
