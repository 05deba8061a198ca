"""Installed from a wheel into a fresh virtualenv, as the Dockerfile does and as a user would:
the command line works outside the checkout, `memfilter stack up` keeps its stack in the
user's state folder and finds the Kafka pom in the package, and a worker from the wheel
processes a request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from pipeline import REPO, Pipeline, free_port


@pytest.fixture(scope="module")
def installed(tmp_path_factory) -> Path:
    """A virtualenv with only the wheel (and its dependencies) installed: its bin folder."""
    folder = tmp_path_factory.mktemp("wheel")
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(folder / "dist"), str(REPO)], capture_output=True, text=True, timeout=600
    )
    assert built.returncode == 0, built.stderr
    [wheel] = (folder / "dist").glob("memfilter-*.whl")
    subprocess.run([sys.executable, "-m", "venv", str(folder / "venv")], check=True, timeout=300)
    pip = subprocess.run(
        [str(folder / "venv" / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", str(wheel)], capture_output=True, text=True, timeout=900
    )
    assert pip.returncode == 0, pip.stderr
    return folder / "venv" / "bin"


def run(bin_: Path, *argv: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_ / "memfilter"), *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the tests' own settings (a user's shell)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("MEMFILTER_", "KAFKA_", "REDIS_"))}, **extra}


def test_stack_up_from_the_wheel_keeps_its_stack_in_the_users_state_folder(installed, tmp_path):
    ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT")}
    env = clean_env(XDG_STATE_HOME=str(tmp_path / "state"), MEMFILTER_PARTITIONS="2", **ports)
    folder = tmp_path / "state" / "memfilter" / "stack"
    up = run(installed, "stack", "up", env=env, cwd=tmp_path)
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{ports['MEMFILTER_KAFKA_PORT']}" in up.stdout
        status = run(installed, "stack", "status", env=env, cwd=tmp_path)
        assert status.returncode == 0 and status.stdout.startswith(f"running from {folder}")
        assert (folder / "kafka-libs" / ".complete").exists()
    finally:
        assert run(installed, "stack", "down", env=env, cwd=tmp_path).returncode == 0


def test_a_worker_from_the_wheel_processes_a_request(installed, services, tmp_path):
    pipeline = Pipeline(services.bootstrap, services.redis_url)
    import asyncio

    asyncio.run(pipeline.create_topics())
    env = clean_env(**{k: v for k, v in pipeline.env().items() if k.startswith(("MEMFILTER_", "KAFKA_", "REDIS_"))})
    assert run(installed, "--version", env=env, cwd=tmp_path).stdout.startswith("memfilter ")
    log = tmp_path / "worker.log"
    with open(log, "wb") as out:
        worker = subprocess.Popen(
            [str(installed / "memfilter"), "worker", "--web-port", str(free_port())], env=env, cwd=tmp_path, stdout=out, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + 90
        while "memfilter worker ready" not in log.read_text():
            assert worker.poll() is None and time.monotonic() < deadline, log.read_text()
            time.sleep(0.2)
        body = {
            "requestId": "wheel-r0",
            "threadId": "wheel-t",
            "resourceId": "wheel-user",
            "messages": [{"id": "wheel-u0", "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": "hi"}]}}],
        }
        (tmp_path / "one.jsonl").write_text(json.dumps(body) + "\n")
        assert run(installed, "publish", "one.jsonl", env=env, cwd=tmp_path).returncode == 0
        tail = run(installed, "tail", "--json", "--from-beginning", "--max", "1", "--idle-ms", "60000", env=env, cwd=tmp_path)
        assert json.loads(tail.stdout)["requestId"] == "wheel-r0"
    finally:
        worker.terminate()
        worker.wait(30)
        pipeline.stop_all()
