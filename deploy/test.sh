#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs, then runs pytest against
# a real Kafka broker and Redis server (started by the tests' fixtures unless
# KAFKA_BOOTSTRAP_SERVERS and REDIS_URL point at running ones). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
exec .venv/bin/python -m pytest "$@"
