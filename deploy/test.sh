#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (deploy/setup.sh; a Docker
# engine and both Compose tools, deploy/docker.sh; the images, deploy/images.sh), then runs
# pytest twice against real services: every test on the process stack (Kafka and Redis started
# by the tests' fixtures unless KAFKA_BOOTSTRAP_SERVERS and REDIS_URL point at running ones),
# then the tests marked `containers` with Kafka, Redis and the workers in containers
# (MEMFILTER_TEST_BACKEND=containers). Extra arguments go to both pytest runs.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
./deploy/docker.sh
./deploy/images.sh
.venv/bin/python -m pytest "$@"
MEMFILTER_TEST_BACKEND=containers .venv/bin/python -m pytest "$@"
