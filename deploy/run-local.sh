#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone, as the loop it sits in: installs
# what it needs, starts Kafka and Redis (`memfilter stack up`), a worker and the reference
# agent runner (echo model), then a scripted useChat-like client (`memfilter converse`) that
# sends each turn as a full echo of its conversation, waits for the saved reply and appends
# it, answering one client tool call, then regenerating an answer and editing a message on the
# way; it prints what the model saw at each turn,
# then the thread as it is stored (`memfilter history show`). Then it starts the gateway
# (`memfilter gateway`, identity from a header as on loopback) and prints the chat page's
# address; at a terminal, the worker, the agent and the gateway keep serving the page until
# Ctrl-C. Exits 1 if the worker, the agent or the gateway stops on the way. The stack keeps
# running afterwards: `.venv/bin/memfilter stack down`.
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
gateway=""
trap 'kill $worker $agent $gateway 2>/dev/null; wait $worker $agent $gateway 2>/dev/null || true' EXIT

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

port="${MEMFILTER_GATEWAY_PORT:-6068}"
MEMFILTER_GATEWAY_AUTH=header .venv/bin/memfilter gateway > "$dir/gateway.log" 2>&1 &
gateway=$!
until curl -fs "http://127.0.0.1:$port/readyz" > /dev/null; do
  if gone "$gateway" gateway; then exit 1; fi
  sleep 0.2
done
curl -fs "http://127.0.0.1:$port/chat.js" > /dev/null || { echo "run-local: the gateway serves no chat page (is it built? deploy/setup.sh builds it)" >&2; exit 1; }
echo "--- the chat page: http://127.0.0.1:$port/?user=demo (memfilter gateway: the AI SDK's client, through Kafka and the workers)"
echo "--- logs: $dir/worker.log, $dir/agent.log, $dir/gateway.log; run them yourself with .venv/bin/memfilter worker / agent / gateway"
if [ -t 0 ]; then
  echo "--- serving the page until Ctrl-C"
  wait "$gateway"
fi
