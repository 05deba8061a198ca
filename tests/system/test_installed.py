"""What a team installs, run for real against the shared stack: the wheel built from the
checkout, installed into a fresh virtualenv per extra set (`base`, `worker`, `agent`,
`gateway`) outside the checkout, as a user installs it; and, on the container backend
(`MEMFILTER_TEST_BACKEND=containers`), the product's image.

The parts run as `deploy/k8s/` runs them: each Deployment's command, with its ConfigMap's
settings and its Secret's values (the addresses the test's own; on the processes backend, the
ports free ones on loopback). Each answers its probes on the port its manifest names (exactly
that port, in the image), a `useChat` client (the `ai` package) gets a turn answered through
the installed gateway, and every command a user runs works from its install: publish, tail,
explain and converse from the client's; history show, import and rebuild, forget and replay
from the worker's; stack status. The client's install names the extra a command needs, and
imports nothing it does not declare."""

from __future__ import annotations

import asyncio
import concurrent.futures
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import uuid
import zipfile
from pathlib import Path

import asyncpg
import pytest
import yaml
from fake_openai import FakeOpenAI
from pipeline import REPO, WORKER_LOGS, free_port, local_get, node_test

pytestmark = pytest.mark.xdist_group("installed")  # one install and one product for the module (`--dist loadgroup`)

EXTRAS = ("base", "worker", "agent", "gateway")
JWT_KEY = uuid.uuid4().hex * 2
K8S = REPO / "deploy" / "k8s"
# Each part's port setting: what its manifest's containerPort must be.
PORT_SETTINGS = {
    "worker": "MEMFILTER_WEB_PORT",
    "agent": "MEMFILTER_AGENT_WEB_PORT",
    "sink": "MEMFILTER_SINK_WEB_PORT",
    "embedder": "MEMFILTER_EMBEDDER_WEB_PORT",
    "gateway": "MEMFILTER_GATEWAY_PORT",
}
EXTRA_OF = {"worker": "worker", "sink": "worker", "agent": "agent", "embedder": "agent", "gateway": "gateway"}


def clean_env(**extra: str) -> dict[str, str]:
    """The environment without the tests' own settings (a user's shell)."""
    return {**{k: v for k, v in os.environ.items() if not k.startswith(("MEMFILTER_", "KAFKA_", "REDIS_", "POSTGRES_", "PYTHON"))}, **extra}


class Wheel:
    """The wheel, installed per extra set into virtualenvs made side by side; commands run from
    them in a folder outside the checkout."""

    def __init__(self, folder: Path):
        built = subprocess.run(
            [sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(folder), str(REPO)], capture_output=True, text=True, timeout=600
        )
        assert built.returncode == 0, built.stderr
        [self.wheel] = folder.glob("memfilter-*.whl")
        self.cwd = folder
        with concurrent.futures.ThreadPoolExecutor(len(EXTRAS)) as pool:
            self.bins = dict(zip(EXTRAS, pool.map(self._venv, EXTRAS)))

    def _venv(self, extra: str) -> Path:
        venv = self.cwd / f"venv-{extra}"
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=300)
        what = str(self.wheel) if extra == "base" else f"memfilter[{extra}] @ {self.wheel.as_uri()}"
        constraints = str(REPO / "deploy" / "constraints.txt")
        done = subprocess.run(
            [str(venv / "bin" / "pip"), "install", "-q", "--disable-pip-version-check", "-c", constraints, what], capture_output=True, text=True, timeout=900
        )
        assert done.returncode == 0, done.stderr
        return venv / "bin"

    def run(self, extra: str, argv: list[str], env: dict[str, str], input: bytes | None = None) -> subprocess.CompletedProcess:
        done = subprocess.run(
            [str(self.bins[extra] / "memfilter"), *argv], input=input or b"", capture_output=True, env=clean_env(**env), cwd=self.cwd, timeout=120
        )
        return subprocess.CompletedProcess(argv, done.returncode, done.stdout.decode(errors="replace"), done.stderr.decode(errors="replace"))

    def start(self, extra: str, argv: list[str], env: dict[str, str], log: Path, port_setting: str):
        """A part as a process; on loopback, on a free port."""
        port = free_port()
        env = {**env, port_setting: str(port), "MEMFILTER_WEB_BIND": "127.0.0.1", "MEMFILTER_GATEWAY_BIND": "127.0.0.1"}
        process = subprocess.Popen(
            [str(self.bins[extra] / "memfilter"), *argv], env=clean_env(**env), cwd=self.cwd, stdout=open(log, "ab"), stderr=subprocess.STDOUT
        )
        process.web_port = port
        process.log_path = log
        return process


class Image:
    """The product's image on the container backend's network: every extra is in it."""

    def __init__(self, stack):
        self.stack = stack

    def run(self, extra: str, argv: list[str], env: dict[str, str], input: bytes | None = None) -> subprocess.CompletedProcess:
        return self.stack.run(argv, env, input)

    def start(self, extra: str, argv: list[str], env: dict[str, str], log: Path, port_setting: str):
        """A part as a container: on the port its settings name, inside the container (published on loopback)."""
        return self.stack.worker(argv, env, log, port=int(env[port_setting]), web_port_flag=False)


def deployments() -> dict[str, dict]:
    """Each part's Deployment in deploy/k8s/, by its container's name."""
    docs = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d]
    return {d["spec"]["template"]["spec"]["containers"][0]["name"]: d for d in docs if d["kind"] == "Deployment"}


def config_map() -> dict[str, str]:
    [config] = [d for f in sorted(K8S.glob("*.yaml")) for d in yaml.safe_load_all(f.read_text()) if d and d["kind"] == "ConfigMap"]
    return config["data"]


def manifest_env(container: dict, secrets: dict[str, str], test_env: dict[str, str]) -> dict[str, str]:
    """A container's environment as Kubernetes gives it (its ConfigMap, its Secret's keys), with
    the test pipeline's settings on top (its services, topics, group and prefix)."""
    env = dict(config_map()) | test_env
    for e in container.get("env", []):
        if "value" in e:  # `$(NAME)` expanded from what is defined before, as Kubernetes does
            env[e["name"]] = re.sub(r"\$\((\w+)\)", lambda m: env[m.group(1)], e["value"])
        elif "fieldRef" in e["valueFrom"]:
            assert e["valueFrom"]["fieldRef"]["fieldPath"] == "status.podIP", e
            env[e["name"]] = "127.0.0.1"  # the pod's address: here, the machine's loopback
        elif (ref := e["valueFrom"]["secretKeyRef"])["key"] in secrets:
            env[e["name"]] = secrets[ref["key"]]
        else:
            assert ref.get("optional"), f"{container['name']} needs the Secret's key {ref['key']}"
    return {**env, **test_env}


@pytest.fixture(scope="module")
def installed(services, tmp_path_factory):
    if services.containers is not None:
        return Image(services.containers)
    return Wheel(tmp_path_factory.mktemp("wheel"))


@pytest.fixture(scope="module")
def product(services, installed):
    """The pipeline, and its parts started from the install as their manifests say, each ready;
    the embedder's endpoint a fake one (`fake_openai.FakeOpenAI`) the parts reach, installed
    as a wheel or as containers."""
    pipeline = services.pipeline()
    asyncio.run(pipeline.create_topics())
    embeddings = FakeOpenAI(services.containers.host_address() if services.containers is not None else "127.0.0.1")
    test_env = pipeline.settings_env(
        MEMFILTER_AGENT_GROUP=f"agent-{pipeline.name}",
        MEMFILTER_SINK_GROUP=f"sink-{pipeline.name}",
        MEMFILTER_EMBEDDER_GROUP=f"embedder-{pipeline.name}",
        MEMFILTER_EMBEDDINGS_BASE_URL=embeddings.url,
        MEMFILTER_IDLE_S="3600",
    )
    secrets = {"secret": pipeline.secret.decode(), "postgres-url": pipeline.postgres_url, "gateway-jwt-key": JWT_KEY}
    parts = {}
    try:
        for name, deployment in deployments().items():
            [container] = deployment["spec"]["template"]["spec"]["containers"]
            command = container["command"]
            assert command[0] == "memfilter", command
            log = WORKER_LOGS / f"memfilter-test-{pipeline.name}-installed-{name}.log"
            parts[name] = installed.start(EXTRA_OF[name], command[1:], manifest_env(container, secrets, test_env), log, PORT_SETTINGS[name])
            pipeline.workers.append(parts[name])
        for part in parts.values():
            ready(part, "/readyz", 120)
        yield pipeline, parts, test_env
    finally:
        pipeline.stop_all()
        embeddings.close()
        asyncio.run(pipeline.delete_topics())


def ready(part, path: str, timeout: float) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            status, body = local_get(part.web_port, path)
            if status == 200:
                return body
        except (urllib.error.URLError, ConnectionError, OSError):
            status, body = 0, "no answer"
        assert part.poll() is None, f"{part.log_path} exited: {part.log_path.read_text()[-3000:] if part.log_path.exists() else ''}"
        assert time.monotonic() < deadline, f"{path} of {part.log_path.name} answered {status} {body!r} for {timeout} s"
        time.sleep(0.5)


@pytest.mark.containers
def test_every_part_answers_its_probes_on_the_port_its_manifest_names(product, services):
    _, parts, _ = product
    for name, deployment in deployments().items():
        [container] = deployment["spec"]["template"]["spec"]["containers"]
        [port] = container["ports"]
        if services.containers is not None:  # the image: what answers below is the manifest's port inside the container
            assert int(parts[name].container.get_exposed_port(port["containerPort"])) == parts[name].web_port
        for probe in ("readinessProbe", "livenessProbe"):
            assert container[probe]["httpGet"]["port"] == port["name"]
            assert ready(parts[name], container[probe]["httpGet"]["path"], 30).strip() in ("ok", "ready")
        status, metrics = local_get(parts[name].web_port, deployment["spec"]["template"]["metadata"]["annotations"]["prometheus.io/path"])
        assert status == 200 and "process_cpu_seconds_total" in metrics


@pytest.mark.containers
def test_the_ai_sdks_client_gets_an_answer_through_the_installed_gateway(product):
    _, parts, _ = product
    config = config_map()  # the issuer and audience the manifest's gateway checks
    sent = node_test(
        "gateway.test.mjs",
        "--test-name-pattern=^a message gets the agent's answer",
        GATEWAY_URL=f"http://127.0.0.1:{parts['gateway'].web_port}",
        JWT_KEY=JWT_KEY,
        JWT_ISSUER=config["MEMFILTER_GATEWAY_ISSUER"],
        JWT_AUDIENCE=config["MEMFILTER_GATEWAY_AUDIENCE"],
    )
    assert sent.returncode == 0 and "ℹ pass 1\n" in sent.stdout, sent.stdout[-4000:] + sent.stderr[-2000:]


@pytest.mark.containers
def test_publish_tail_explain_and_converse_work_from_the_clients_install(product, installed):
    _, _, env = product
    thread = f"installed-{uuid.uuid4().hex[:8]}"
    body = {"requestId": f"{thread}-r0", "threadId": thread, "resourceId": "installed-user", "messages": [text_message(f"{thread}-u0", "hi")]}
    published = installed.run("base", ["publish"], env, input=json.dumps(body).encode())
    assert published.returncode == 0 and "published 1 request" in published.stdout, published.stderr
    tail = installed.run("base", ["tail", "--json", "--from-beginning", "--thread", thread, "--max", "1", "--idle-ms", "60000"], env)
    assert tail.returncode == 0 and json.loads(tail.stdout)["requestId"] == f"{thread}-r0", tail.stderr
    explained = installed.run("base", ["explain"], env, input=(REPO / "deploy" / "samples" / "explain-case.json").read_bytes())
    assert explained.returncode == 0 and json.loads(explained.stdout)["outcome"], explained.stderr
    talk = installed.run("base", ["converse", "--thread", f"{thread}-talk", "--resource", "installed-user", "first", "second"], env)
    assert talk.returncode == 0, talk.stdout + talk.stderr
    assert "< assistant: echo: first" in talk.stdout and "< assistant: echo: second" in talk.stdout


@pytest.mark.containers
def test_history_forget_replay_and_the_sink_work_from_the_workers_install(product, installed):
    pipeline, _, env = product
    thread, imported = f"kept-{uuid.uuid4().hex[:8]}", f"imported-{uuid.uuid4().hex[:8]}"
    assert installed.run("base", ["converse", "--thread", thread, "--resource", "installed-user", "remember me"], env).returncode == 0
    shown = installed.run("worker", ["history", "show", thread], env)
    assert shown.returncode == 0 and "remember me" in shown.stdout and "echo: remember me" in shown.stdout, shown.stderr

    export = {
        "threadId": imported,
        "resourceId": "installed-user",
        "messages": [{"id": f"{imported}-u0", "role": "user", "parts": [{"type": "text", "text": "old"}]}],
    }
    done = installed.run("worker", ["history", "import", "--wait", "60"], env, input=json.dumps(export).encode())
    assert done.returncode == 0 and "imported 1 thread" in done.stdout, done.stdout + done.stderr
    erased = installed.run("worker", ["forget", "--thread", imported, "--by", "tests", "--reason", "installed"], env)
    assert erased.returncode == 0 and f"erased thread {imported}" in erased.stdout, erased.stdout + erased.stderr

    replayed = installed.run("worker", ["replay", "--strict"], env)
    assert replayed.returncode == 0 and " 0 different" in replayed.stdout, replayed.stdout + replayed.stderr
    rebuilt = installed.run("worker", ["history", "rebuild", "--prefix", f"{pipeline.prefix}-rebuilt"], env)
    assert rebuilt.returncode == 0 and f"rebuilt history under prefix {pipeline.prefix}-rebuilt" in rebuilt.stdout, rebuilt.stdout + rebuilt.stderr
    again = installed.run("worker", ["history", "show", thread, "--prefix", f"{pipeline.prefix}-rebuilt"], env)
    assert again.stdout == shown.stdout
    dropped = installed.run("worker", ["history", "drop", "--prefix", f"{pipeline.prefix}-rebuilt"], env)
    assert dropped.returncode == 0 and f"dropped prefix {pipeline.prefix}-rebuilt" in dropped.stdout, dropped.stderr

    # the sink, from the worker's install, wrote the thread to PostgreSQL
    async def held() -> int:
        connection = await asyncpg.connect(pipeline.postgres_url)
        try:
            return await connection.fetchval(f'SELECT count(*) FROM "{pipeline.prefix}".mastra_messages WHERE thread_id = $1', thread)
        except asyncpg.UndefinedTableError:
            return 0
        finally:
            await connection.close()

    deadline = time.monotonic() + 60
    while asyncio.run(held()) != 2:
        assert time.monotonic() < deadline, "the sink did not write the thread to PostgreSQL within 60 s"
        time.sleep(0.5)

    # and the embedder, from the agent's install, kept both messages' vectors for recall, under their resource
    async def embedded() -> list:
        connection = await asyncpg.connect(pipeline.postgres_url)
        try:
            return await connection.fetch(f'SELECT message_id, "resourceId" FROM "{pipeline.prefix}".message_vectors WHERE thread_id = $1', thread)
        except asyncpg.UndefinedTableError:
            return []
        finally:
            await connection.close()

    while len(rows := asyncio.run(embedded())) != 2:
        assert time.monotonic() < deadline + 60, "the embedder did not keep the thread's vectors within 60 s of the sink"
        time.sleep(0.5)
    assert {r["resourceId"] for r in rows} == {"installed-user"}


@pytest.mark.containers
def test_stack_status_works_from_the_clients_install(installed, services, tmp_path):
    if services.containers is not None:  # no local stack in the image: it says so
        status = installed.run("base", ["stack", "status"], {})
        assert status.returncode == 3 and status.stdout.startswith("stopped (stack folder "), status.stderr
        return
    status = installed.run("base", ["stack", "status"], {"MEMFILTER_STACK_DIR": str(services.stack_dir)})
    assert status.returncode == 0 and status.stdout.startswith(f"running from {services.stack_dir}"), status.stdout + status.stderr


def text_message(id_: str, text: str) -> dict:
    return {"id": id_, "role": "user", "content": {"format": 2, "parts": [{"type": "text", "text": text}]}}


# ---- the wheel alone (the processes backend; the image carries every extra) -----------------


@pytest.fixture
def wheel(installed) -> Wheel:
    assert isinstance(installed, Wheel), "tests of the wheel alone run on the processes backend (not marked `containers`)"
    return installed


def test_the_clients_install_names_the_extra_each_command_needs(wheel):
    for command, extra in [("worker", "worker"), ("sink", "worker"), ("history show t", "worker"), ("forget --thread t", "worker"), ("replay", "worker")]:
        done = wheel.run("base", command.split(), {})
        assert done.returncode == 2 and f"pip install 'memfilter[{extra}]'" in done.stderr, (command, done.stderr)
    # the echo agent runs on the worker's extra; a model's client is the agent extra's
    settings = {"MEMFILTER_SECRET": "x" * 32, "MEMFILTER_GATEWAY_AUTH": "header", "OPENAI_API_KEY": "sk-none"}
    for bin_, command, extra in [("base", "agent", "agent"), ("worker", "agent --backend openai", "agent"), ("worker", "gateway", "gateway")]:
        done = wheel.run(bin_, command.split(), settings)
        assert done.returncode == 2 and f"pip install 'memfilter[{extra}]'" in done.stderr, (bin_, command, done.stderr)


def test_the_wheel_holds_every_module_and_data_file_of_the_tree(wheel):
    tracked = subprocess.run(["git", "ls-files", "streams", "schemas"], capture_output=True, text=True, cwd=REPO, check=True).stdout.split()
    page_sources = {"streams/gateway/page/chat.mjs", "streams/gateway/page/package.json", "streams/gateway/page/package-lock.json"}  # built into chat.js
    wanted = {
        ("memfilter/" + path.removeprefix("streams/")) if path.startswith("streams/") else "memfilter/" + path for path in tracked if path not in page_sources
    }
    with zipfile.ZipFile(wheel.wheel) as z:
        held = {name for name in z.namelist() if not name.split("/")[0].endswith(".dist-info")}
    assert wanted - held == set()
    assert held - wanted == {"memfilter/gateway/page/chat.js"}  # built by deploy/setup.sh, not kept in git


def test_the_wheel_adds_one_import_name_and_the_client_install_brings_no_worker_parts(wheel, tmp_path):
    listed = subprocess.run([str(wheel.bins["base"] / "pip"), "list", "--format", "freeze"], capture_output=True, text=True, check=True).stdout.lower()
    for absent in ("faust-streaming", "openai", "redis", "mode-streaming", "prometheus-client", "aiohttp", "pyjwt", "asyncpg"):
        assert f"{absent}==" not in listed, f"{absent} comes with the client's install"
    # An application with its own `schemas` and `streams` modules, in its own folder, as FastAPI code has.
    (tmp_path / "schemas.py").write_text("ITEM = 'the application'\n")
    (tmp_path / "streams.py").write_text("ITEM = 'the application'\n")
    code = (
        "import schemas, streams\n"
        "from memfilter.client import Client\n"
        "from memfilter.schemas.wire import ChatRequest\n"
        "assert schemas.ITEM == streams.ITEM == 'the application'\n"
        "print(Client.__name__, ChatRequest(threadId='t', resourceId='r', messages=[]).threadId)\n"
    )
    done = subprocess.run(
        [str(wheel.bins["base"] / "python"), "-c", code], capture_output=True, text=True, cwd=tmp_path, env=clean_env(PYTHONPATH=str(tmp_path)), timeout=120
    )
    assert done.returncode == 0 and done.stdout.split() == ["Client", "t"], done.stderr


def test_stack_up_from_the_wheel_keeps_its_stack_in_the_users_state_folder(wheel, tmp_path):
    ports = {k: str(free_port()) for k in ("MEMFILTER_KAFKA_PORT", "MEMFILTER_CONTROLLER_PORT", "MEMFILTER_REDIS_PORT", "MEMFILTER_POSTGRES_PORT")}
    env = {"XDG_STATE_HOME": str(tmp_path / "state"), "MEMFILTER_PARTITIONS": "2", **ports}
    folder = tmp_path / "state" / "memfilter" / "stack"
    up = wheel.run("base", ["stack", "up"], env)
    try:
        assert up.returncode == 0, up.stderr
        assert f"export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{ports['MEMFILTER_KAFKA_PORT']}" in up.stdout
        status = wheel.run("base", ["stack", "status"], env)
        assert status.returncode == 0 and status.stdout.startswith(f"running from {folder}")
        assert (folder / "kafka-libs" / ".complete").exists()
    finally:
        assert wheel.run("base", ["stack", "down"], env).returncode == 0
