"""docker-compose.yml run for real, with `docker compose` (v2) and Debian's `docker-compose`
1.29, on the images `deploy/images.sh` builds: the whole product comes up (Kafka, Redis,
PostgreSQL, the topics, two workers, the sink, the agent runner, the gateway), answers the
sample session, holds it in PostgreSQL, serves the chat page and a `useChat` client from the
host (the `ai` package's client, and the page in Chromium, with Compose v2), and goes away with
its network. And the networks containers run on, compose's and the container test backend's,
reach nothing beyond the machine and publish ports on loopback only.
"""

from __future__ import annotations

import asyncio
import json
import os
import secrets
import shutil
import subprocess
import time
import urllib.request
import uuid
from pathlib import Path

import docker
import pytest
from containers import NETWORK_OPTIONS
from pipeline import REPO, WORKER_LOGS, free_port, node_test, read
from testcontainers.core.container import DockerContainer
from testcontainers.core.network import Network

pytestmark = pytest.mark.xdist_group("compose")  # one Compose project at a time on this machine's ports (`--dist loadgroup`)

TOOLS = {"compose-v2": ["docker", "compose"], "docker-compose-1.29": ["docker-compose"]}
SAMPLE = REPO / "deploy" / "samples" / "conversation.jsonl"
SERVICES = {"kafka", "redis", "postgres", "topics", "worker-1", "worker-2", "sink", "agent", "gateway"}
SCREENSHOT = WORKER_LOGS / "memfilter-test-compose-chat-page.png"

# Run inside a container: which of the given (host, port) it can open a connection to.
REACH = """
import json, socket, sys
out = {}
for host, port in json.loads(sys.argv[1]):
    try:
        socket.create_connection((host, port), 3).close()
        out[host] = True
    except OSError:
        out[host] = False
print(json.dumps(out))
"""


def beyond_the_machine() -> tuple[str, int]:
    """An address past this machine that its containers could reach by default: its name
    server (TCP 53)."""
    line = next(line for line in Path("/etc/resolv.conf").read_text().splitlines() if line.startswith("nameserver"))
    return line.split()[1], 53


def reaches(container, targets: list[tuple[str, int]]) -> dict[str, bool]:
    code, out = container.exec_run(["python3", "-c", REACH, json.dumps(targets)])
    assert code == 0, out
    return json.loads(out)


def test_a_container_on_dockers_default_network_reaches_past_the_machine():
    """The control for the tests below: without their networks' options, the same address is
    reached."""
    far = beyond_the_machine()
    out = docker.from_env().containers.run("memfilter/memfilter", ["python3", "-c", REACH, json.dumps([far])], remove=True)
    assert json.loads(out) == {far[0]: True}


def test_the_container_backends_network_reaches_no_further_than_its_containers_and_publishes_on_loopback():
    far = beyond_the_machine()
    with Network(docker_network_kw={"options": NETWORK_OPTIONS}) as network:
        peer = DockerContainer("memfilter/redis").with_network(network).with_network_aliases("peer").with_exposed_ports(6379)
        with peer:
            client = docker.from_env()
            container = client.containers.run("memfilter/memfilter", ["sleep", "60"], network=network.name, detach=True)
            try:
                assert reaches(container, [("peer", 6379), far]) == {"peer": True, far[0]: False}
            finally:
                container.remove(force=True)
            peer.get_wrapped_container().reload()
            [binding] = peer.get_wrapped_container().ports["6379/tcp"]
            assert binding["HostIp"] == "127.0.0.1"
        name = network.name
    assert not docker.from_env().networks.list(names=[name])


@pytest.mark.parametrize("tool", TOOLS)
def test_compose_brings_up_the_product_it_answers_the_sample_session_and_goes_away(tool):
    project = f"memfilter-test-{uuid.uuid4().hex[:8]}"
    kafka_port, redis_port, postgres_port, gateway_port = free_port(), free_port(), free_port(), free_port()
    env = {
        **{k: v for k, v in os.environ.items() if not k.startswith("MEMFILTER_GATEWAY_")},  # the gateway as `up` makes it
        "MEMFILTER_SECRET": secrets.token_hex(32),
        "MEMFILTER_KAFKA_PORT": str(kafka_port),
        "MEMFILTER_REDIS_PORT": str(redis_port),
        "MEMFILTER_POSTGRES_PORT": str(postgres_port),
        "MEMFILTER_GATEWAY_PORT": str(gateway_port),
    }

    def compose(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [*TOOLS[tool], "-p", project, "-f", str(REPO / "docker-compose.yml"), *args],
            env=env,
            capture_output=True,
            text=True,
            timeout=300,
        )

    client = docker.from_env()

    def containers() -> dict[str, docker.models.containers.Container]:
        found = client.containers.list(all=True, filters={"label": f"com.docker.compose.project={project}"})
        return {c.labels["com.docker.compose.service"]: c for c in found}

    try:
        up = compose("up", "-d")
        assert up.returncode == 0, up.stderr
        deadline = time.monotonic() + 180
        while not all_ready(containers()):
            assert time.monotonic() < deadline, {name: state(c) for name, c in containers().items()}
            time.sleep(1)
        running = containers()
        assert running.keys() == SERVICES

        bootstrap = f"127.0.0.1:{kafka_port}"
        published = subprocess.run(
            [str(REPO / ".venv" / "bin" / "memfilter"), "publish", str(SAMPLE)],
            env={**env, "KAFKA_BOOTSTRAP_SERVERS": bootstrap},
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert published.returncode == 0, published.stderr
        requests = [json.loads(line)["requestId"] for line in SAMPLE.read_text().splitlines()]
        records = asyncio.run(read(bootstrap, ["filtered-inputs", "persist-messages"], until=lambda recs: len(replies(recs)) >= len(requests)))
        filtered = [json.loads(r.value)["requestId"] for r in records if r.topic == "filtered-inputs"]
        assert filtered == requests  # one partition (the thread's), in the order sent
        assert replies(records) == [f"{r}/reply" for r in requests]  # the agent runner answered each, through persist-messages

        # the sink wrote the session's thread to PostgreSQL: every row Redis holds of it
        thread = json.loads(SAMPLE.read_text().splitlines()[0])["threadId"]
        sql = f"SELECT count(*) FROM mf.mastra_messages WHERE thread_id = '{thread}'"
        while (held := psql(running["postgres"], sql)) != (stored := hlen(running["redis"], f"mf:t:{{{thread}}}:rows")) or int(stored) <= len(requests):
            assert time.monotonic() < deadline + 60, f"PostgreSQL holds {held} messages of {thread}, Redis {stored}"
            time.sleep(1)

        # the chat page and a useChat client, from the host, on the gateway's published port
        gateway = f"http://127.0.0.1:{gateway_port}"
        with urllib.request.urlopen(f"{gateway}/", timeout=10) as page, urllib.request.urlopen(f"{gateway}/chat.js", timeout=10) as script:
            assert b'src="/chat.js"' in page.read() and len(script.read()) > 10_000
        if tool == "compose-v2":  # what a user runs; the client and the browser once, not once per Compose tool
            sent = node_test(
                "gateway.test.mjs", "--test-name-pattern=^a message gets the agent's answer", GATEWAY_URL=gateway, RESOURCE_HEADER="X-Memfilter-Resource"
            )
            assert sent.returncode == 0 and "ℹ pass 1\n" in sent.stdout, sent.stdout[-4000:] + sent.stderr[-2000:]
            chromium = shutil.which("chromium")
            assert chromium, "Debian's chromium is not installed: deploy/test.sh installs it"
            shown = node_test("page.test.mjs", GATEWAY_URL=gateway, CHROMIUM=chromium, SCREENSHOT=str(SCREENSHOT), HOME="/tmp")
            assert shown.returncode == 0, shown.stdout[-4000:] + shown.stderr[-2000:]

        far = beyond_the_machine()
        assert reaches(running["worker-1"], [("kafka", 19092), ("redis", 6379), far]) == {"kafka": True, "redis": True, far[0]: False}
        for service in ("kafka", "redis", "postgres", "worker-1", "agent", "sink", "gateway"):
            assert {b["HostIp"] for bindings in running[service].ports.values() if bindings for b in bindings} == {"127.0.0.1"}
    finally:
        down = compose("down", "-v")
    assert down.returncode == 0, down.stderr
    assert not containers()
    assert not client.networks.list(filters={"label": f"com.docker.compose.project={project}"})


def psql(container, sql: str) -> str:
    """One value from PostgreSQL, asked with psql in its container."""
    code, out = container.exec_run(["psql", "-U", "memfilter", "-d", "postgres", "-h", "127.0.0.1", "-tAc", sql])
    return out.decode().strip() if code == 0 else f"an error: {out.decode().strip()}"


def hlen(container, key: str) -> str:
    code, out = container.exec_run(["redis-cli", "HLEN", key])
    return out.decode().strip() if code == 0 else f"an error: {out.decode().strip()}"


def replies(records) -> list[str]:
    """The agent runner's saves, by request id (`<request>/reply`)."""
    saves = (json.loads(r.value)["requestId"] for r in records if r.topic == "persist-messages")
    return [request for request in saves if request.endswith("/reply")]


def state(container) -> str:
    container.reload()
    health = container.attrs["State"].get("Health")
    return f"{container.status} {container.attrs['State']['ExitCode']}" if health is None else health["Status"]


def all_ready(found: dict) -> bool:
    """Every service healthy, and the topics made (their container exited 0)."""
    if found.keys() != SERVICES:
        return False
    wanted = {"topics": "exited 0"}
    return all(state(c) == wanted.get(name, "healthy") for name, c in found.items())
