#!/usr/bin/env bash
# Installs what the product, its tests and its benchmarks need into .venv (Python packages from
# PyPI, at the versions deploy/constraints.txt pins). Kafka's jars (Maven Central) and Redis
# (Debian's redis-server) come with `memfilter stack up`.
# Builds the gateway's chat page (the AI SDK's client bundled by esbuild: npm ci and npm run build
# in streams/gateway/page). Needs: python3 >= 3.11, Node 20+ and npm, and for the stack Java 17+ and Maven.
set -euo pipefail
cd "$(dirname "$0")/.."
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
.venv/bin/python -m pip install -q --disable-pip-version-check -c deploy/constraints.txt -e '.[dev]'
npm ci --prefix streams/gateway/page --no-audit --no-fund --loglevel=error
npm run --prefix streams/gateway/page --silent build >/dev/null
