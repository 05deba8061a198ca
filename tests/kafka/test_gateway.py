"""`memfilter gateway` driven by the AI SDK's own client: `tests/node/gateway.test.mjs` runs the
`ai` package (`AbstractChat`, the logic of `useChat`, over `DefaultChatTransport`) against a
gateway, a worker and the echo agent runner on the real stack. Its cases: an answer with the
stored id and the stored conversation on reload, a client tool round trip, regenerate and edit,
a rejection for each reason code, a retry with the same `Idempotency-Key`, two users on one
thread, and missing, forged and expired tokens."""

from __future__ import annotations

import secrets
import subprocess
import sys
import time
import urllib.error
import urllib.request

from pipeline import REPO, WORKER_LOGS, free_port, wait_for_line

NODE_TESTS = REPO / "tests" / "node"


def start_gateway(pipeline, key: str) -> tuple[subprocess.Popen, int]:
    port = free_port()
    log = WORKER_LOGS / f"memfilter-test-{pipeline.name}-gateway.log"
    env = pipeline.env(MEMFILTER_GATEWAY_AUTH="jwt", MEMFILTER_GATEWAY_JWT_KEY=key, MEMFILTER_GATEWAY_REPLY_S="30")
    gateway = subprocess.Popen(
        [sys.executable, "-m", "memfilter", "gateway", "--port", str(port)], env=env, cwd=REPO, stdout=open(log, "ab"), stderr=subprocess.STDOUT
    )
    pipeline.workers.append(gateway)  # stopped with the workers
    deadline = time.monotonic() + 60
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/readyz", timeout=2):
                return gateway, port
        except (urllib.error.URLError, ConnectionError):
            assert gateway.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)


def test_the_ai_sdks_client_gets_answers_tool_round_trips_regenerations_edits_and_rejections_through_the_gateway(pipeline):
    key = secrets.token_hex(32)
    worker = pipeline.start_worker()
    pipeline.start_agent()
    wait_for_line(worker.log_path, "memfilter worker ready", timeout=60)
    gateway, port = start_gateway(pipeline, key)
    result = subprocess.run(
        ["node", "--test", "--test-reporter=spec", "gateway.test.mjs"],
        cwd=NODE_TESTS,
        env={"PATH": "/usr/bin:/bin:/usr/local/bin", "GATEWAY_URL": f"http://127.0.0.1:{port}", "JWT_KEY": key},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-3000:]
    assert gateway.poll() is None
