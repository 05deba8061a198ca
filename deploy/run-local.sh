#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone: installs what it needs, starts
# Kafka and Redis (`memfilter stack up`), and shows the filter's decision for the sample
# conversation. Stop the stack with `.venv/bin/memfilter stack down`.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
eval "$(.venv/bin/memfilter stack up)"
.venv/bin/memfilter stack status
echo "--- memfilter explain deploy/samples/explain-case.json"
.venv/bin/memfilter explain deploy/samples/explain-case.json | .venv/bin/python -m json.tool
