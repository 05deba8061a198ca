#!/usr/bin/env bash
# The whole test suite, from a fresh clone: installs what it needs (deploy/setup.sh; a Docker
# engine and both Compose tools, deploy/docker.sh; the images, deploy/images.sh; the AI SDK's
# client for the gateway's tests, npm ci in tests/node; Debian's chromium, faketime and nftables), checks lint,
# format and types (deploy/lint.sh), then runs the tiers (tests/conftest.py says what each
# needs): the redis, postgres, kafka and system tiers against real services the fixtures start
# (unless KAFKA_BOOTSTRAP_SERVERS and REDIS_URL point at running ones), then the tests marked
# `containers` with Kafka, Redis and the workers in containers (MEMFILTER_TEST_BACKEND=containers)
# and the unit tier, and beside those two the Jepsen tier's network tests and short schedule
# (as root: network namespaces). Extra arguments go to every pytest run.
set -euo pipefail
cd "$(dirname "$0")/.."
./deploy/setup.sh
./deploy/docker.sh
./deploy/images.sh
./deploy/lint.sh
npm ci --prefix tests/node --no-audit --no-fund --loglevel=error  # the AI SDK's client and puppeteer-core, for the gateway's tests
command -v chromium >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null  # the browser the chat page is tested in
command -v faketime >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q faketime >/dev/null  # the Jepsen tier moves workers' clocks with it
command -v nft >/dev/null || DEBIAN_FRONTEND=noninteractive apt-get install -y -q nftables >/dev/null  # and cuts its hosts' links with nft
# Three xdist workers on two cores: the tests mostly wait (on brokers, timeouts, Docker), so a
# third keeps the cores busier (docs/testing.md: 675-723 s against 796 s for two).
.venv/bin/python -m pytest tests/redis tests/postgres tests/kafka tests/system -n 3 --dist loadgroup --durations=25 "$@"  # the slowest printed: the suite keeps within 15 minutes
# The Jepsen tier's network (its faults do what they say) and short schedule (every fault kind
# once, on hosts in network namespaces of its own: no port is shared) run beside the container
# tier, which mostly waits on Docker, and the unit tier after it (pure: it starts nothing).
jepsen_log=$(mktemp)
.venv/bin/python -m pytest tests/jepsen/test_net.py tests/jepsen/test_nemesis.py -s "$@" >"$jepsen_log" 2>&1 &
jepsen=$!
{ MEMFILTER_TEST_BACKEND=containers .venv/bin/python -m pytest "$@" && .venv/bin/python -m pytest tests/unit -n 2 --dist worksteal "$@"; } ||
  { kill -INT "$jepsen"; wait "$jepsen" || true; cat "$jepsen_log"; exit 1; }
jepsen_rc=0
wait "$jepsen" || jepsen_rc=$?
cat "$jepsen_log"
exit "$jepsen_rc"
