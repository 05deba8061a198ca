"""`memfilter gateway` driven by the AI SDK's own client and by a browser, on the real stack (a
worker and the echo agent runner behind it):

- `tests/node/gateway.test.mjs` runs the `ai` package (`AbstractChat`, the logic of `useChat`,
  over `DefaultChatTransport`) against a gateway with JWT identity: an answer with the stored
  id and the stored conversation on reload, a client tool round trip, regenerate and edit, a
  rejection for each reason code, a retry with the same `Idempotency-Key`, two users on one
  thread, and missing, forged and expired tokens;
- `tests/node/page.test.mjs` opens the gateway's chat page in Debian's Chromium (puppeteer-core)
  on a gateway with header identity, as `deploy/run-local.sh` runs it: a typed message gets the
  answer and a reload shows the stored history; its screenshot is kept at SCREENSHOT."""

from __future__ import annotations

import asyncio
import secrets
import shutil
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
from pipeline import REPO, WORKER_LOGS, free_port, wait_for_line

pytestmark = pytest.mark.xdist_group("gateway")  # the module's worker, agent and gateways are shared (`--dist loadgroup`)

NODE_TESTS = REPO / "tests" / "node"
SCREENSHOT = WORKER_LOGS / "memfilter-test-chat-page.png"
JWT_KEY = secrets.token_hex(32)


def start_gateway(pipeline, name: str, **env: str) -> int:
    port = free_port()
    log = WORKER_LOGS / f"memfilter-test-{pipeline.name}-gateway-{name}.log"
    gateway = subprocess.Popen(
        [sys.executable, "-m", "memfilter", "gateway", "--port", str(port)], env=pipeline.env(**env), cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT
    )
    pipeline.workers.append(gateway)  # stopped with the workers
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return port
        except (urllib.error.URLError, ConnectionError):
            assert gateway.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


@pytest.fixture(scope="module")
def gateways(services):
    """A worker, the echo agent and two gateways on a pipeline of the module's own: (JWT port, header port)."""
    pipeline = services.pipeline()
    asyncio.run(pipeline.create_topics())
    worker = pipeline.start_worker()
    pipeline.start_agent()
    wait_for_line(worker.log_path, "memfilter worker ready", timeout=60)
    reply = {"MEMFILTER_GATEWAY_REPLY_S": "30"}
    yield (
        start_gateway(pipeline, "jwt", MEMFILTER_GATEWAY_AUTH="jwt", MEMFILTER_GATEWAY_JWT_KEY=JWT_KEY, **reply),
        start_gateway(pipeline, "header", MEMFILTER_GATEWAY_AUTH="header", **reply),
    )
    pipeline.stop_all()
    asyncio.run(pipeline.delete_topics())


def node_test(file: str, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        ["node", "--test", "--test-reporter=spec", file],
        cwd=NODE_TESTS,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", **env},
        capture_output=True,
        text=True,
        timeout=300,
    )


def test_the_ai_sdks_client_gets_answers_tool_round_trips_regenerations_edits_and_rejections_through_the_gateway(gateways):
    result = node_test("gateway.test.mjs", GATEWAY_URL=f"http://127.0.0.1:{gateways[0]}", JWT_KEY=JWT_KEY)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    with urllib.request.urlopen(f"http://127.0.0.1:{gateways[0]}/metrics", timeout=5) as reply:
        metrics = reply.read().decode()
    for outcome in ("answered", "ownership", "foreign-message-id", "duplicate", "schema", "too-large", "unauthenticated"):
        assert f'memfilter_gateway_requests_total{{outcome="{outcome}"}}' in metrics, outcome
    assert 'memfilter_gateway_wait_seconds_count{for="reply"}' in metrics and "memfilter_gateway_in_flight 0.0" in metrics


def test_the_chat_page_in_a_browser_answers_a_typed_message_and_shows_the_stored_history_after_a_reload(gateways):
    chromium = shutil.which("chromium")
    assert chromium, "Debian's chromium is not installed: deploy/test.sh installs it"
    SCREENSHOT.unlink(missing_ok=True)
    result = node_test("page.test.mjs", GATEWAY_URL=f"http://127.0.0.1:{gateways[1]}", CHROMIUM=chromium, SCREENSHOT=str(SCREENSHOT), HOME="/tmp")
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert SCREENSHOT.stat().st_size > 10_000
