"""`memfilter stack`: a real local Kafka broker and Redis server, started by the project.

The processor's tests and its local demo run against the real things, not stand-ins: Apache
Kafka in KRaft mode (broker and controller in one JVM), from the `org.apache.kafka:kafka_2.13`
jars that Maven collects from Maven Central (`streams/kafka-pom.xml`, shipped in the package), and Debian's
`redis-server`. Both listen on loopback ports; their jars, data, logs and pids live under one
stack folder (default `.stack/` in the checkout, git-ignored; for an installed package
`~/.local/state/memfilter/stack`).

`up` is idempotent: a stack that already answers is reused. Every failure (no Java, Maven
unreachable, a port taken, a stack of another folder on the ports) is one line naming the
cause, a non-zero exit, and nothing left running that this call started. A service of the
stack that died is started again by the next `up`, on its own data; `status` says, service by
service, what runs (and exits 3 unless all of it does).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from streams import settings as product_settings

POM = Path(__file__).resolve().parent / "kafka-pom.xml"
TOPICS = ("chat-requests", "filtered-inputs", "persist-messages", "chat-requests-dlq")
DEFAULT_PARTITIONS = 8
SERVICES = ("kafka", "redis")


class StackError(Exception):
    """A failure of the stack with a one-line reason for a person."""


@dataclass(frozen=True)
class Settings:
    """The stack's part of the product's settings (`streams/settings.py`)."""

    dir: Path
    kafka_port: int
    controller_port: int
    redis_port: int
    partitions: int | None  # None: DEFAULT_PARTITIONS for topics made now, existing ones as they are
    maven_settings: str = ""

    @classmethod
    def of(cls, s: product_settings.Settings, partitions: int | None = None) -> Settings:
        return cls(Path(s.stack_dir), s.kafka_port, s.controller_port, s.redis_port, partitions or s.partitions, s.maven_settings)

    @property
    def bootstrap(self) -> str:
        return f"127.0.0.1:{self.kafka_port}"

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.redis_port}/0"


@dataclass
class Running:
    """What `up` recorded in the stack folder: the processes it started."""

    kafka_pid: int
    redis_pid: int
    kafka_port: int
    controller_port: int
    redis_port: int

    def exports(self, secret: str) -> str:
        """Shell lines for `eval "$(memfilter stack up)"`; `secret` is the stack's (`secret`)."""
        return (
            f"export KAFKA_BOOTSTRAP_SERVERS=127.0.0.1:{self.kafka_port}\n"
            f"export REDIS_URL=redis://127.0.0.1:{self.redis_port}/0\n"
            f"export MEMFILTER_SECRET={secret}"
        )


def secret(s: Settings) -> str:
    """The stack's MEMFILTER_SECRET: made once, kept in the stack folder, so that the workers,
    replays and rebuilds of one local stack share it as a deployment's do."""
    path = s.dir / "secret"
    if not path.exists():
        s.dir.mkdir(parents=True, exist_ok=True)
        path.write_text(secrets.token_hex(32))
        path.chmod(0o600)
    return path.read_text().strip()


def _say(line: str) -> None:
    print(f"memfilter stack: {line}", file=sys.stderr, flush=True)


# ---- the running stack's record ---------------------------------------------------------


def _state_file(s: Settings) -> Path:
    return s.dir / "running.json"


def _alive(pid: int, marker: str) -> bool:
    try:
        cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
    except OSError:
        return False
    return marker in cmdline


def recorded(s: Settings) -> Running | None:
    """What `up` recorded in this folder, whether or not its processes still run."""
    try:
        return Running(**json.loads(_state_file(s).read_text()))
    except (OSError, ValueError, TypeError):
        return None


def alive(s: Settings, r: Running) -> dict[str, bool]:
    """Which of the recorded stack's services still run."""
    return {"kafka": _alive(r.kafka_pid, str(s.dir)), "redis": _alive(r.redis_pid, "redis-server")}


# ---- preflight: everything that can fail before a process starts --------------------------


def _check_java() -> str:
    java = shutil.which("java")
    if java is None:
        raise StackError("no `java` on PATH: Kafka needs Java 17 or newer (apt-get install openjdk-17-jre-headless)")
    out = subprocess.run([java, "-version"], capture_output=True, text=True).stderr
    try:
        major = int(out.split('"')[1].split(".")[0])
    except (IndexError, ValueError):
        raise StackError(f"cannot read the Java version from `java -version`: {out.strip()[:80]}") from None
    if major < 17:
        raise StackError(f"Java {major} found at {java}; Kafka 4 needs Java 17 or newer")
    return java


def _redis_server() -> str:
    found = shutil.which("redis-server")
    if found:
        return found
    if os.geteuid() != 0:
        raise StackError("no `redis-server` on PATH: install it (sudo apt-get install redis-server)")
    _say("redis-server missing; installing Debian's redis-server with apt-get")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", "redis-server"]):
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            raise StackError(f"`{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}")
    return shutil.which("redis-server") or "/usr/bin/redis-server"


def _listener_of(port: int) -> str:
    """Who listens on a loopback port: the process's command line, as far as /proc tells."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if fields[3] == "0A" and int(fields[1].rsplit(":", 1)[1], 16) == port:
                inodes.add(f"socket:[{fields[9]}]")
    for proc in Path("/proc").iterdir():
        if not proc.name.isdigit():
            continue
        try:
            if any(os.readlink(fd) in inodes for fd in (proc / "fd").iterdir()):
                cmd = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
                return f"pid {proc.name} ({cmd[:160]})"
        except OSError:
            continue
    return "another process"


def _check_ports(s: Settings, services: set[str]) -> None:
    """The ports of the services about to start are free."""
    for service, name, port, setting in (
        ("kafka", "Kafka", s.kafka_port, "MEMFILTER_KAFKA_PORT"),
        ("kafka", "the Kafka controller", s.controller_port, "MEMFILTER_CONTROLLER_PORT"),
        ("redis", "Redis", s.redis_port, "MEMFILTER_REDIS_PORT"),
    ):
        if service not in services:
            continue
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", port))
                continue
            except OSError:
                pass
        holder = _listener_of(port)
        if ".stack" in holder or "kafka.Kafka" in holder or "redis-server" in holder:
            raise StackError(
                f"port {port} for {name} is held by a stack of another folder: {holder}; "
                f"run `memfilter stack down` with that MEMFILTER_STACK_DIR, or set {setting}"
            )
        raise StackError(f"port {port} for {name} is taken by {holder}; free it or set {setting}")


def _kafka_libs(s: Settings) -> Path:
    """The broker's classpath, collected by Maven from Maven Central on first use."""
    libs = s.dir / "kafka-libs"
    if (libs / ".complete").exists():
        return libs
    if shutil.which("mvn") is None:
        raise StackError("no `mvn` on PATH: Maven collects the Kafka jars (apt-get install maven)")
    _say(f"collecting the Kafka jars with Maven into {libs} (first start only)")
    cmd = ["mvn", "-q", "-B", "-f", str(POM), "dependency:copy-dependencies", "-DincludeScope=runtime", f"-DoutputDirectory={libs}"]
    if s.maven_settings:
        cmd[1:1] = ["-s", s.maven_settings]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode != 0:
        errors = [line for line in done.stdout.splitlines() if line.startswith("[ERROR]")]
        reason = errors[0][8:160] if errors else done.stderr.strip()[-160:]
        raise StackError(f"Maven could not fetch the Kafka jars from Maven Central: {reason}")
    (libs / ".complete").touch()
    return libs


# ---- starting and stopping ---------------------------------------------------------------

SERVER_PROPERTIES = """\
process.roles=broker,controller
node.id=1
listeners=PLAINTEXT://127.0.0.1:{kafka_port},CONTROLLER://127.0.0.1:{controller_port}
advertised.listeners=PLAINTEXT://127.0.0.1:{kafka_port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
controller.quorum.bootstrap.servers=127.0.0.1:{controller_port}
log.dirs={data}
num.partitions=1
auto.create.topics.enable=false
offsets.topic.replication.factor=1
offsets.topic.num.partitions=1
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1
group.initial.rebalance.delay.ms=0
message.max.bytes=8388608
# Keep every record: audits replay the topics, and records stamped in the past (replays of old
# traffic, fixed test timestamps) would otherwise be deleted by time retention within minutes.
log.retention.ms=-1
"""

REDIS_CONF = """\
bind 127.0.0.1
port {port}
dir {data}
logfile {log}
appendonly yes
appendfsync everysec
save ""
protected-mode yes
"""


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _start_redis(s: Settings, server: str) -> subprocess.Popen:
    home = s.dir / "redis"
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "redis.conf"
    conf.write_text(REDIS_CONF.format(port=s.redis_port, data=home, log=home / "redis.log"))
    return _spawn([server, str(conf)], home / "stdout.log")


def _start_kafka(s: Settings, java: str, libs: Path) -> subprocess.Popen:
    home = s.dir / "kafka"
    data = home / "data"
    home.mkdir(parents=True, exist_ok=True)
    props = home / "server.properties"
    props.write_text(SERVER_PROPERTIES.format(kafka_port=s.kafka_port, controller_port=s.controller_port, data=data))
    jvm = [java, "-Xms256m", "-Xmx1g", "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn", "-cp", f"{libs}/*"]
    formatted_for = home / "formatted-for-controller-port"
    if data.exists() and formatted_for.exists() and formatted_for.read_text() != str(s.controller_port):
        _say("controller port changed since the storage was formatted; formatting Kafka's storage anew")
        shutil.rmtree(data)
    if not (data / "meta.properties").exists():
        cluster = subprocess.run([*jvm, "kafka.tools.StorageTool", "random-uuid"], capture_output=True, text=True).stdout.strip()
        fmt = [*jvm, "kafka.tools.StorageTool", "format", "--standalone", "-t", cluster, "-c", str(props)]
        done = subprocess.run(fmt, capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"formatting Kafka's storage failed: {(done.stderr or done.stdout).strip()[-200:]}")
        formatted_for.write_text(str(s.controller_port))
    # The stack folder on the command line marks the process as this stack's (see `running`).
    return _spawn([*jvm, f"-Dmemfilter.stack={s.dir}", "kafka.Kafka", str(props)], home / "kafka.log")


def _port_open(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1):
            return True
    except OSError:
        return False


def _redis_answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=1) as sock:
            sock.sendall(b"PING\r\n")
            return sock.recv(16).startswith(b"+PONG")
    except OSError:
        return False


async def broker_answers(bootstrap: str, timeout: float) -> bool:
    """Does a Kafka broker answer a metadata request at `bootstrap` within `timeout` seconds?"""
    from aiokafka.admin import AIOKafkaAdminClient

    quiet = logging.getLogger("aiokafka")  # its connection errors are this answer's to give
    level, quiet.level = quiet.level, logging.CRITICAL
    admin = AIOKafkaAdminClient(bootstrap_servers=bootstrap, request_timeout_ms=int(timeout * 1000))
    try:
        await asyncio.wait_for(admin.start(), timeout)
        await asyncio.wait_for(admin.list_topics(), timeout)
        return True
    except Exception:
        return False
    finally:
        await admin.close()
        quiet.setLevel(level)


async def _create_topics(s: Settings, deadline: float) -> None:
    """Create the topics that are missing; refuse a partition count other than the existing."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            existing = set(await admin.list_topics()) & set(TOPICS)
            counts = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(sorted(existing))} if existing else {}
            missing = [NewTopic(t, s.partitions or next(iter(counts.values()), DEFAULT_PARTITIONS), 1) for t in TOPICS if t not in existing]
            if missing:
                await admin.create_topics(missing)
            break
        except Exception as e:  # the broker is still starting: not yet a failure
            if time.monotonic() > deadline:
                raise StackError(f"Kafka on {s.bootstrap} did not answer in time: {e!r}") from None
            await asyncio.sleep(0.5)
        finally:
            await admin.close()
    other = {t: n for t, n in counts.items() if s.partitions and n != s.partitions}
    if other:
        raise StackError(
            f"the stack's topics have {sorted(set(other.values()))} partitions, not {s.partitions}: a topic's partitions "
            f"cannot change without moving its threads; run `memfilter stack down`, delete {s.dir / 'kafka'}, and `up` again"
        )


def _wait(s: Settings, started: dict[str, subprocess.Popen], timeout: float) -> None:
    """Until the services just started answer, and the topics exist."""
    deadline = time.monotonic() + timeout
    redis, kafka = started.get("redis"), started.get("kafka")
    while redis is not None and not _redis_answers(s.redis_port):
        if redis.poll() is not None:
            raise StackError(f"redis-server exited at start: see {s.dir / 'redis' / 'redis.log'}")
        if time.monotonic() > deadline:
            raise StackError(f"Redis on port {s.redis_port} did not answer within {timeout:.0f}s")
        time.sleep(0.1)
    while kafka is not None and not _port_open(s.kafka_port):
        if kafka.poll() is not None:
            raise StackError(f"Kafka exited at start: see {s.dir / 'kafka' / 'kafka.log'}")
        if time.monotonic() > deadline:
            raise StackError(f"Kafka on {s.bootstrap} did not listen within {timeout:.0f}s: see {s.dir / 'kafka' / 'kafka.log'}")
        time.sleep(0.2)
    asyncio.run(_create_topics(s, deadline))


def _stop(pid: int, marker: str, grace: float) -> None:
    if not _alive(pid, marker):
        return
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + grace
    while _alive(pid, marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    if _alive(pid, marker):
        os.kill(pid, signal.SIGKILL)
    try:
        os.waitpid(pid, 0)
    except ChildProcessError:
        pass
    while _alive(pid, marker):
        time.sleep(0.05)


def up(s: Settings, timeout: float = 90.0) -> Running:
    """Start the stack in `s.dir`, or what of it stopped (a service that died is started again
    on its data); return its record."""
    before = recorded(s)
    up_already = alive(s, before) if before is not None else dict.fromkeys(SERVICES, False)
    if before is not None and all(up_already.values()):
        s = Settings(s.dir, before.kafka_port, before.controller_port, before.redis_port, s.partitions, s.maven_settings)
        asyncio.run(_create_topics(s, time.monotonic() + timeout))
        _say(f"already running from {s.dir}")
        return before
    if before is not None:  # a service of the running stack stays on its ports
        s = Settings(s.dir, before.kafka_port, before.controller_port, before.redis_port, s.partitions, s.maven_settings)
    missing = {name for name, is_up in up_already.items() if not is_up}
    java = _check_java() if "kafka" in missing else ""
    server = _redis_server() if "redis" in missing else ""
    _check_ports(s, missing)
    s.dir.mkdir(parents=True, exist_ok=True)
    libs = _kafka_libs(s) if "kafka" in missing else None
    started: dict[str, subprocess.Popen] = {}
    try:
        if "redis" in missing:
            started["redis"] = _start_redis(s, server)
        if "kafka" in missing:
            started["kafka"] = _start_kafka(s, java, libs)
        _wait(s, started, timeout)
    except BaseException:
        for name, process in reversed(started.items()):
            _stop(process.pid, str(s.dir) if name == "kafka" else "redis-server", grace=5)
        raise
    pid = lambda name: started[name].pid if name in started else getattr(before, f"{name}_pid")  # noqa: E731
    record = Running(pid("kafka"), pid("redis"), s.kafka_port, s.controller_port, s.redis_port)
    _state_file(s).write_text(json.dumps(asdict(record)))
    if before is not None:
        _say(f"started {' and '.join(sorted(missing))} again; the stack runs from {s.dir}")
    else:
        _say(f"Kafka on {s.bootstrap} (pid {record.kafka_pid}), Redis on {s.redis_url} (pid {record.redis_pid}), topics made")
    return record


def down(s: Settings) -> bool:
    """Stop the stack of `s.dir`: Kafka first (a controlled shutdown), then Redis."""
    r = recorded(s)
    if r is None:
        return False
    _stop(r.kafka_pid, str(s.dir), grace=30)
    _stop(r.redis_pid, "redis-server", grace=10)
    _state_file(s).unlink(missing_ok=True)
    return True


def status(s: Settings) -> tuple[str, bool]:
    """What runs, service by service; and whether all of it runs."""
    r = recorded(s)
    if r is None:
        return f"stopped (stack folder {s.dir})", False
    is_up = alive(s, r)
    if all(is_up.values()):
        head = f"running from {s.dir}"
    elif any(is_up.values()):
        head = f"partly running from {s.dir}: `memfilter stack up` starts what stopped"
    else:
        head = f"stopped (stack folder {s.dir})"
    state = {name: "running" if is_up[name] else "stopped" for name in SERVICES}
    lines = [
        head,
        f"  kafka  {state['kafka']}  pid {r.kafka_pid}  127.0.0.1:{r.kafka_port} (controller {r.controller_port})",
        f"  redis  {state['redis']}  pid {r.redis_pid}  redis://127.0.0.1:{r.redis_port}/0",
    ]
    return "\n".join(lines), all(is_up.values())
