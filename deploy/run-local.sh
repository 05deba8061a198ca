#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone, as the loop it sits in: installs
# what it needs, starts Kafka and Redis (`memfilter stack up`), a worker and the reference
# agent runner (echo model), then a scripted useChat-like client (`memfilter converse`) that
# sends each turn as a full echo of its conversation, waits for the saved reply and appends
# it, answering one client tool call, then regenerating an answer and editing a message on the
# way; it prints what the model saw at each turn,
# then the thread as it is stored (`memfilter history show`). Exits 1 if the worker or the
# agent stops on the way. The stack keeps running afterwards: `.venv/bin/memfilter stack down`.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
eval "$(.venv/bin/memfilter stack up)"
.venv/bin/memfilter stack status
dir="${MEMFILTER_STACK_DIR:-.stack}"

.venv/bin/memfilter worker > "$dir/worker.log" 2>&1 &
worker=$!
.venv/bin/memfilter agent > "$dir/agent.log" 2>&1 &
agent=$!
trap 'kill $worker $agent 2>/dev/null; wait $worker $agent 2>/dev/null || true' EXIT

gone() {  # gone PID NAME: the process exited (its log's end shown)
  if kill -0 "$1" 2>/dev/null; then return 1; fi
  echo "run-local: the $2 exited; the end of its log ($dir/$2.log):" >&2
  tail -n 5 "$dir/$2.log" >&2
}
until grep -qs "memfilter worker ready" "$dir/worker.log" && grep -qs "memfilter agent ready" "$dir/agent.log"; do
  if gone "$worker" worker || gone "$agent" agent; then exit 1; fi
  sleep 0.2
done

thread="demo-thread-$(date +%s)"
echo "--- the conversation, as the client sent it and the model saw it (memfilter converse --thread $thread)"
.venv/bin/memfilter converse --thread "$thread"
echo "--- the thread as it is stored (memfilter history show $thread)"
.venv/bin/memfilter history show "$thread"
if gone "$worker" worker || gone "$agent" agent; then exit 1; fi
echo "--- logs: $dir/worker.log, $dir/agent.log; run them yourself with .venv/bin/memfilter worker / agent"
