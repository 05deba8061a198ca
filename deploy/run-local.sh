#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone: installs what it needs, starts
# Kafka and Redis (`memfilter stack up`), runs a worker, publishes a sample useChat session
# (deploy/samples/conversation.jsonl, on a thread of this run's own) and shows the filtered
# inputs it produced. Exits 1 if the worker stops on the way.
# The stack keeps running afterwards: `.venv/bin/memfilter stack down` stops it.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
eval "$(.venv/bin/memfilter stack up)"
.venv/bin/memfilter stack status
log="${MEMFILTER_STACK_DIR:-.stack}/worker.log"

.venv/bin/memfilter worker > "$log" 2>&1 &
worker=$!
trap 'kill $worker 2>/dev/null; wait $worker 2>/dev/null || true' EXIT

worker_gone() {
  if kill -0 "$worker" 2>/dev/null; then return 1; fi
  echo "run-local: the worker exited; the end of its log ($log):" >&2
  tail -n 5 "$log" >&2
}
until grep -qs "memfilter worker ready" "$log"; do
  if worker_gone; then exit 1; fi
  sleep 0.2
done

thread="demo-thread-$(date +%s)"
sed "s/demo-thread/$thread/g" deploy/samples/conversation.jsonl | .venv/bin/memfilter publish
echo "--- filtered inputs of thread $thread (memfilter tail --thread $thread --from-beginning)"
.venv/bin/memfilter tail --thread "$thread" --from-beginning --max 6 --idle-ms 30000
if worker_gone; then exit 1; fi
echo "--- the worker's log is $log; run one yourself with: .venv/bin/memfilter worker"
