#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone: installs what it needs, starts
# Kafka and Redis (`memfilter stack up`), runs a worker, publishes a sample useChat session
# (deploy/samples/conversation.jsonl) and shows the filtered inputs it produced.
# The stack keeps running afterwards: `.venv/bin/memfilter stack down` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
eval "$(.venv/bin/memfilter stack up)"
.venv/bin/memfilter stack status

.venv/bin/memfilter worker > .stack/worker.log 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT

.venv/bin/memfilter publish deploy/samples/conversation.jsonl
echo "--- filtered inputs of thread demo-thread (memfilter tail --thread demo-thread --from-beginning)"
.venv/bin/memfilter tail --thread demo-thread --from-beginning --max 6 --idle-ms 60000
echo "--- the worker's log is .stack/worker.log; run one yourself with: .venv/bin/memfilter worker"
