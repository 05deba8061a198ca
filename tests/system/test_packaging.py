"""Installed from a wheel into a fresh virtualenv, as the Dockerfile does and as a user would:
the wheel adds one import name, `memfilter`, and works beside an application with modules of
its own named `schemas` and `streams`; the base install is a client's (no Faust, no openai, no
Redis client); the command line works outside the checkout, `memfilter stack up` keeps its
stack in the user's state folder and finds the Kafka pom in the package, and a worker from the
wheel with its extra processes a request."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from pipeline import REPO, Pipeline, free_port

pytestmark = pytest.mark.xdist_group("packaging")  # one installed wheel for the module (`--dist loadgroup`)


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    folder = tmp_path_factory.mktemp("wheel")
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(folder), str(REPO)], capture_output=True, text=True, timeout=600)
    assert built.returncode == 0, built.stderr
    [found] = folder.glob("memfilter-*.whl")
    return found


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    """A virtualenv with only the wheel (and its base dependencies) installed: its bin folder.
    Tests that need the worker install its extra into it (`with_extra`)."""
    venv = tmp_path_factory.mktemp("venv")
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
    pip_install(venv / "bin", str(wheel))
    return venv / "bin"


def pip_install(bin_: Path, *what: str) -> None:
    constraints = str(REPO / "deploy" / "constraints.txt")
    done = subprocess.run(
        [str(bin_ / "pip"), "install", "-q", "--disable-pip-version-check", "-c", constraints, *what], capture_output=True, text=True, timeout=900
    )
    assert done.returncode == 0, done.stderr


def with_extra(bin_: Path, wheel: Path, extra: str) -> Path:
    pip_install(bin_, f"memfilter[{extra}] @ {wheel.as_uri()}")
    return bin_


def test_the_wheel_adds_one_import_name_and_the_client_install_needs_no_worker_parts(wheel, installed, tmp_path):
    with zipfile.ZipFile(wheel) as z:
        top = {name.split("/")[0] for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert top == {"memfilter"}
    listed = subprocess.run([str(installed / "pip"), "list", "--format", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    for absent in ("faust-streaming", "openai", "redis", "mode-streaming", "prometheus-client"):
        assert f"{absent}==" not in listed, f"{absent} comes with the client's install"
    # An application with its own `schemas` and `streams` modules, in its own folder, as FastAPI code has.
    (tmp_path / "schemas.py").write_text("ITEM = 'the application'\n")
    (tmp_path / "streams.py").write_text("ITEM = 'the application'\n")
    code = (
        "import schemas, streams\n"
        "from memfilter.client import Client\n"
        "from memfilter.schemas.wire import ChatRequest\n"
        "from memfilter.core.explain import explain\n"
        "assert schemas.ITEM == streams.ITEM == 'the application'\n"
        "print(Client.__name__, ChatRequest(threadId='t', resourceId='r', messages=[]).threadId)\n"
    )
    app = {**clean_env(), "PYTHONPATH": str(tmp_path)}  # the application's folder first, as a script of it has
    done = subprocess.run([str(installed / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=app, timeout=120)
    assert done.returncode == 0 and done.stdout.split() == ["Client", "t"], done.stderr
    case = (REPO / "deploy" / "samples" / "explain-case.json").read_bytes()
    explained = subprocess.run([str(installed / "memfilter"), "explain"], input=case, capture_output=True, cwd=tmp_path, timeout=120)
    assert explained.returncode == 0 and json.loads(explained.stdout)["outcome"], explained.stderr


def run(bin_: Path, *argv: str, env: dict[str, str], cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run([str(bin_ / "memfilter"), *argv], capture_output=True, text=True, env=env, cwd=cwd, timeout=timeout)


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the tests' own settings (a user's shell)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("MEMFILTER_", "KAFKA_", "REDIS_"))}, **extra}


def test_stack_up_from_the_wheel_keeps_its_stack_in_the_users_state_folder(installed, tmp_path):
    ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT", "MEMFILTER_POSTGRES_PORT")}
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


def test_a_worker_from_the_wheel_with_its_extra_processes_a_request(wheel, installed, services, tmp_path):
    installed = with_extra(installed, wheel, "worker")
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
