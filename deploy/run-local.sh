#!/usr/bin/env bash
# The product on a local default stack, from a fresh clone, as the loop it sits in: installs
# what it needs, starts Kafka, Redis and PostgreSQL (`memfilter stack up`, under .stack/), a
# worker, the sink (persist-messages into PostgreSQL) and the reference agent runner (echo
# model), then a scripted useChat-like client (`memfilter converse`) that sends each turn as a
# full echo of its conversation, waits for the saved reply and appends it, answering one client
# tool call, then regenerating an answer and editing a message on the way; it prints what the
# model saw at each turn, then the thread as it is stored (`memfilter history show`), and as
# PostgreSQL holds it (SQL). Then it starts the gateway (`memfilter gateway`, identity from a
# header as on loopback) and, at a terminal, serves the chat page until Ctrl-C.
# A stack that cannot start (a port taken: the line names the setting that moves it) stops the
# script at once with its reason; it exits 1 if the worker, the sink, the agent or the gateway
# stops on the way. The processes it started stop with it; the stack keeps running, and its
# last lines say how to stop that too.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
exports=$(.venv/bin/memfilter stack up) || exit  # a failed `up` has said why on stderr
eval "$exports"
.venv/bin/memfilter stack status
dir="${MEMFILTER_STACK_DIR:-.stack}"

.venv/bin/memfilter worker > "$dir/worker.log" 2>&1 &
worker=$!
.venv/bin/memfilter agent > "$dir/agent.log" 2>&1 &
agent=$!
.venv/bin/memfilter sink > "$dir/sink.log" 2>&1 &
sink=$!
gateway=""
trap 'kill $worker $agent $sink $gateway 2>/dev/null; wait $worker $agent $sink $gateway 2>/dev/null || true' EXIT

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
echo "--- the thread as PostgreSQL holds it (memfilter sink wrote it; psql \$POSTGRES_URL)"
schema="${MEMFILTER_REDIS_PREFIX:-mf}"
stored=$(.venv/bin/memfilter history show "$thread" --json | wc -l)  # its conversation and its superseded rows
held=0
for _ in $(seq 1 120); do
  held=$(psql "$POSTGRES_URL" -tAc "SELECT count(*) FROM \"$schema\".mastra_messages WHERE thread_id = '$thread'" 2>/dev/null || echo 0)
  [ "$held" = "$stored" ] && break
  if gone "$sink" sink; then exit 1; fi
  sleep 0.5
done
[ "$held" = "$stored" ] || { echo "run-local: PostgreSQL holds $held of the thread's $stored messages after 60 s; see $dir/sink.log" >&2; exit 1; }
psql "$POSTGRES_URL" -c "SELECT position, id, role, left(content, 70) AS content FROM \"$schema\".mastra_messages WHERE thread_id = '$thread' ORDER BY position NULLS LAST"
if gone "$worker" worker || gone "$agent" agent || gone "$sink" sink; then exit 1; fi

port="${MEMFILTER_GATEWAY_PORT:-6068}"
MEMFILTER_GATEWAY_AUTH=header .venv/bin/memfilter gateway > "$dir/gateway.log" 2>&1 &
gateway=$!
until curl -fs "http://127.0.0.1:$port/readyz" > /dev/null; do
  if gone "$gateway" gateway; then exit 1; fi
  sleep 0.2
done
curl -fs "http://127.0.0.1:$port/chat.js" > /dev/null || { echo "run-local: the gateway serves no chat page (is it built? deploy/setup.sh builds it)" >&2; exit 1; }
echo "--- logs: $dir/worker.log, $dir/agent.log, $dir/sink.log, $dir/gateway.log; run them yourself with .venv/bin/memfilter worker / agent / sink / gateway"
if [ -t 0 ]; then
  echo "--- the chat page: http://127.0.0.1:$port/?user=demo (memfilter gateway: the AI SDK's client, through Kafka and the workers)"
  echo "--- serving it until Ctrl-C, which stops the worker, the agent, the sink and the gateway; then the stack: .venv/bin/memfilter stack down"
  wait "$gateway" || true
else
  echo "--- not at a terminal: the worker, the agent, the sink and the gateway stop now; run this at a terminal to keep the chat page served"
  echo "--- the stack keeps running (memfilter stack status); stop it with: .venv/bin/memfilter stack down"
fi
