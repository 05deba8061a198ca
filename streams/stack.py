"""`memfilter stack`: a real local Kafka, Redis and PostgreSQL, started by the project.

The processor's tests and its local demo run against the real things, not stand-ins: Apache
Kafka in KRaft mode (broker and controller in one JVM), from the `org.apache.kafka:kafka_2.13`
jars that Maven collects from Maven Central (`streams/kafka-pom.xml`, shipped in the package), Debian's
`redis-server`, and Debian's PostgreSQL (the history's PostgreSQL tier: docs/postgres.md; run
as the `postgres` user when the stack is started as root, since PostgreSQL refuses to run as
root; trust authentication, loopback only by default). By default all listen on loopback ports; their jars, data, logs and pids live under one
stack folder (default `.stack/` in the checkout, git-ignored; for an installed package
`~/.local/state/memfilter/stack`), but for PostgreSQL's when the `postgres` user cannot reach
that folder (a root's home): then under /var/lib/postgresql/memfilter/.

By default one broker and one Redis. `--brokers 3` makes a KRaft cluster of three (each a
broker and a voter of the controller quorum; topics, offsets and the transaction log with
replication factor 3 and `min.insync.replicas=2`), broker n (from 0) on MEMFILTER_KAFKA_PORT + 2n
and its controller on MEMFILTER_CONTROLLER_PORT + 2n. `--redis-cluster` makes a Redis Cluster
of three masters with a replica each (`redis-cli --cluster create`), node n on
MEMFILTER_REDIS_PORT + n (its cluster bus on that + 10000). Redis writes its append-only file
every second (`appendfsync everysec`) either way.

Every process listens on MEMFILTER_STACK_HOST (loopback by default), or on an address of its
own (`Settings.hosts`), where `up`'s `enter` starts it: the Jepsen tier (`tests/jepsen/`)
places each in a network namespace, so that brokers and Redis nodes can be cut from each other.

`up` is idempotent: a stack that already answers is reused. Every failure (no Java, Maven
unreachable, a port taken, a stack of another folder on the ports) is one line naming the
cause, a non-zero exit, and nothing left running that this call started. A service of the
stack that died is started again by the next `up`, on its own data; `status` says, service by
service, what runs (and exits 3 unless all of it does).
"""

from __future__ import annotations

import asyncio
import hashlib
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
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from memfilter import settings as product_settings

POM = Path(__file__).resolve().parent / "kafka-pom.xml"
DEFAULT_PARTITIONS = 8
REDIS_CLUSTER_NODES = 6  # three masters, a replica each
CLUSTER_BUS_OFFSET = 10_000  # a Redis Cluster node's bus port is its port + this
# A master silent this long is failed over to its replica. Short, for a local stack and its
# tests; a production cluster uses Redis's default, 15000 (docs/production.md).
CLUSTER_NODE_TIMEOUT_MS = 2000


class StackError(Exception):
    """A failure of the stack with a one-line reason for a person."""


@dataclass(frozen=True)
class Settings:
    """The stack's part of the product's settings (`memfilter.settings`)."""

    dir: Path
    kafka_port: int
    controller_port: int
    redis_port: int
    postgres_port: int
    partitions: int | None  # None: DEFAULT_PARTITIONS for topics made now, existing ones as they are
    maven_settings: str = ""
    brokers: int = 1
    redis_cluster: bool = False
    topics: tuple[str, ...] = product_settings.Topics().all()  # the product's topics, as the settings name them
    retention: tuple[tuple[str, int], ...] = tuple(product_settings.Topics().retention_ms().items())  # each topic's retention.ms
    host: str = "127.0.0.1"  # the address every service listens on, and is reached at
    # (process name, address): a process on a host of its own (the Jepsen tier's hosts), reached there; `up`'s `enter` starts it there
    hosts: tuple[tuple[str, str], ...] = ()

    @classmethod
    def of(cls, s: product_settings.Settings, partitions: int | None = None, brokers: int = 1, redis_cluster: bool = False) -> Settings:
        st = s.stack
        return cls(
            Path(st.dir),
            st.kafka_port,
            st.controller_port,
            st.redis_port,
            st.postgres_port,
            partitions or st.partitions,
            st.maven_settings,
            brokers,
            redis_cluster,
            s.topics.all(),
            tuple(s.topics.retention_ms().items()),
            st.host,
        )

    def host_of(self, name: str) -> str:
        """The address process `name` (`names`) listens on."""
        return dict(self.hosts).get(name, self.host)

    @property
    def kafka_ports(self) -> list[int]:
        return [self.kafka_port + 2 * n for n in range(self.brokers)]

    @property
    def controller_ports(self) -> list[int]:
        return [self.controller_port + 2 * n for n in range(self.brokers)]

    @property
    def redis_ports(self) -> list[int]:
        return [self.redis_port + n for n in range(REDIS_CLUSTER_NODES if self.redis_cluster else 1)]

    @property
    def bootstrap(self) -> str:
        return ",".join(f"{self.host_of(name)}:{port}" for name, port in zip(self.names(), self.kafka_ports))

    @property
    def redis_url(self) -> str:
        if self.redis_cluster:
            return "redis+cluster://" + ",".join(f"{self.host_of(f'redis-{port}')}:{port}" for port in self.redis_ports)
        return f"redis://{self.host_of('redis')}:{self.redis_port}/0"

    @property
    def postgres_url(self) -> str:
        return f"postgresql://{POSTGRES_USER}@{self.host_of('postgres')}:{self.postgres_port}/postgres"

    def names(self) -> list[str]:
        """The stack's processes: `kafka` (or `kafka-1`...), then `redis` (or `redis-<port>`...), then `postgres`."""
        kafka = ["kafka"] if self.brokers == 1 else [f"kafka-{n + 1}" for n in range(self.brokers)]
        return kafka + (["redis"] if not self.redis_cluster else [f"redis-{port}" for port in self.redis_ports]) + ["postgres"]


@dataclass
class Running:
    """What `up` recorded in the stack folder: the processes it started, and where."""

    pids: dict[str, int]  # process name (`Settings.names`) -> pid
    kafka_port: int
    controller_port: int
    redis_port: int
    brokers: int = 1
    redis_cluster: bool = False
    postgres_port: int = 0  # 0: a stack recorded before PostgreSQL was part of it
    host: str = "127.0.0.1"  # where its services listen (MEMFILTER_STACK_HOST)
    hosts: list[list[str]] = field(default_factory=list)  # Settings.hosts: processes on hosts of their own

    def settings(self, s: Settings) -> Settings:
        """`s` with this stack's ports, address and shape."""
        return Settings(
            s.dir,
            self.kafka_port,
            self.controller_port,
            self.redis_port,
            self.postgres_port or s.postgres_port,
            s.partitions,
            s.maven_settings,
            self.brokers,
            self.redis_cluster,
            s.topics,
            s.retention,
            self.host,
            tuple((name, address) for name, address in self.hosts),
        )

    def exports(self, s: Settings, secret: str) -> str:
        """Shell lines for `eval "$(memfilter stack up)"`; `secret` is the stack's (`secret`)."""
        s = self.settings(s)
        lines = [f"export KAFKA_BOOTSTRAP_SERVERS={s.bootstrap}", f"export REDIS_URL={s.redis_url}", f"export POSTGRES_URL={s.postgres_url}"]
        if s.redis_cluster:  # a batch commits only once its writes are on a replica (docs/production.md)
            lines.append("export MEMFILTER_REDIS_REPLICAS=1")
        return "\n".join([*lines, f"export MEMFILTER_SECRET={secret}"])


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


def _marker(name: str, s: Settings) -> str:
    """What the command line of the stack's process `name` holds."""
    if name == "postgres":
        return str(_postgres_home(s) / "data")
    return str(s.dir) if name.startswith("kafka") else "redis-server"


def alive(s: Settings, r: Running) -> dict[str, bool]:
    """Which of the stack's processes run (one the record lacks does not: a stack recorded before it was part of it)."""
    return {name: name in r.pids and _alive(r.pids[name], _marker(name, s)) for name in s.names()}


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


def _apt_install(package: str, missing: str) -> None:
    """Debian's `package`, installed with apt-get (as root; otherwise a StackError naming the
    command to run). `missing` names what was not found."""
    if os.geteuid() != 0:
        raise StackError(f"no {missing}: install it (sudo apt-get install {package})")
    _say(f"{missing} missing; installing Debian's {package} with apt-get")
    for cmd in (["apt-get", "update", "-qq"], ["apt-get", "install", "-y", "-qq", package]):
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "DEBIAN_FRONTEND": "noninteractive"})
        if done.returncode != 0:
            raise StackError(f"`{' '.join(cmd)}` failed: {done.stderr.strip().splitlines()[-1:]}")


def redis_server() -> str:
    """Debian's redis-server, installed with apt-get when missing (as root)."""
    if found := shutil.which("redis-server"):
        return found
    _apt_install("redis-server", "`redis-server` on PATH")
    return shutil.which("redis-server") or "/usr/bin/redis-server"


POSTGRES_USER = "memfilter"  # the stack's PostgreSQL superuser (initdb -U), trusted on loopback


def postgres_bin() -> Path:
    """The folder of Debian's PostgreSQL server programs (the newest installed), installed
    with apt-get when missing (as root)."""
    if not _postgres_servers():
        _apt_install("postgresql", "PostgreSQL server in /usr/lib/postgresql")
    if not (found := _postgres_servers()):
        raise StackError("apt-get installed postgresql, but no server is in /usr/lib/postgresql/*/bin")
    return found[-1].parent


def _postgres_servers() -> list[Path]:
    """Debian's PostgreSQL servers, oldest major version first."""
    return sorted(Path("/usr/lib/postgresql").glob("*/bin/postgres"), key=lambda p: int(p.parts[-3]) if p.parts[-3].isdigit() else 0)


def _listener_of(port: int) -> str:
    """Who listens on a loopback port: its pid and whole command line, as far as /proc tells."""
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
                return f"pid {proc.name} ({cmd})"
        except OSError:
            continue
    return "another process"


def _ports(s: Settings, name: str) -> list[tuple[str, int, str]]:
    """The ports process `name` listens on: (what, port, the setting that moves it)."""
    if name.startswith("kafka"):
        n = int(name.partition("-")[2] or 1) - 1
        return [("Kafka", s.kafka_ports[n], "MEMFILTER_KAFKA_PORT"), ("the Kafka controller", s.controller_ports[n], "MEMFILTER_CONTROLLER_PORT")]
    if name == "postgres":
        return [("PostgreSQL", s.postgres_port, "MEMFILTER_POSTGRES_PORT")]
    port = int(name.partition("-")[2] or s.redis_port)
    bus = [("the Redis cluster bus", port + CLUSTER_BUS_OFFSET, "MEMFILTER_REDIS_PORT")] if s.redis_cluster else []
    return [("Redis", port, "MEMFILTER_REDIS_PORT"), *bus]


def _check_ports(s: Settings, names: list[str]) -> None:
    """The ports of the processes about to start are free (a process on a host of its own has them to itself)."""
    placed = dict(s.hosts)
    for name, port, setting in (p for process in names if process not in placed for p in _ports(s, process)):
        with socket.socket() as sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind((s.host, port))
                continue
            except OSError:
                pass
        holder = _listener_of(port)
        shown = holder if len(holder) <= 180 else f"{holder[:177]}..."
        if "-Dmemfilter.stack=" in holder or ".stack" in holder or "kafka.Kafka" in holder or "redis-server" in holder:
            raise StackError(
                f"port {port} for {name} is held by a stack of another folder: {shown}; "
                f"run `memfilter stack down` with that MEMFILTER_STACK_DIR, or set {setting}"
            )
        raise StackError(f"port {port} for {name} is taken by {shown}; free it or set {setting}")


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
node.id={node_id}
listeners=PLAINTEXT://{host}:{kafka_port},CONTROLLER://{host}:{controller_port}
advertised.listeners=PLAINTEXT://{host}:{kafka_port}
controller.listener.names=CONTROLLER
listener.security.protocol.map=PLAINTEXT:PLAINTEXT,CONTROLLER:PLAINTEXT
{quorum}
log.dirs={data}
num.partitions=1
auto.create.topics.enable=false
default.replication.factor={replicas}
min.insync.replicas={isr}
offsets.topic.replication.factor={replicas}
offsets.topic.num.partitions=1
transaction.state.log.replication.factor={replicas}
transaction.state.log.min.isr={isr}
share.coordinator.state.topic.replication.factor={replicas}
share.coordinator.state.topic.min.isr={isr}
group.initial.rebalance.delay.ms=0
# A consumer may ask for a session timeout down to 2 s (Kafka's default floor is 6 s): the fault
# tests stall and kill workers past it, and wait for it each time.
group.min.session.timeout.ms=2000
message.max.bytes=8388608
# Keep every record: audits replay the topics, and records stamped in the past (replays of old
# traffic, fixed test timestamps) would otherwise be deleted by time retention within minutes.
log.retention.ms=-1
"""

REDIS_CONF = """\
bind {host}
port {port}
dir {data}
logfile {log}
appendonly yes
appendfsync everysec
save ""
protected-mode {protected}
"""

REDIS_CLUSTER_CONF = """\
cluster-enabled yes
cluster-config-file nodes.conf
cluster-node-timeout {timeout}
"""


def _spawn(cmd: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as out:
        return subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)


def _home(s: Settings, name: str) -> Path:
    return s.dir / name


def _start_redis(s: Settings, name: str, server: str, enter: list[str]) -> subprocess.Popen:
    home = _home(s, name)
    home.mkdir(parents=True, exist_ok=True)
    conf = home / "redis.conf"
    port = _ports(s, name)[0][1]
    # protected mode answers only loopback's clients: a node on another address
    # (MEMFILTER_STACK_HOST, Settings.hosts) serves the other hosts there
    host = s.host_of(name)
    protected = "yes" if host.startswith("127.") else "no"
    text = REDIS_CONF.format(host=host, port=port, data=home, log=home / "redis.log", protected=protected)
    if s.redis_cluster:
        text += REDIS_CLUSTER_CONF.format(timeout=CLUSTER_NODE_TIMEOUT_MS)
    conf.write_text(text)
    return _spawn([*enter, server, str(conf)], home / "stdout.log")


def _postgres_home(s: Settings) -> Path:
    """Where the stack's PostgreSQL keeps its data and log: in the stack folder. Started as root,
    PostgreSQL runs as `postgres`, which must reach that folder: where it cannot (a root's
    folder under /root, which is 0700), under Debian's home of PostgreSQL's clusters instead,
    one folder per stack folder (`status` and `up` say which)."""
    if os.geteuid() == 0 and not _reachable_by_postgres(s.dir):
        return Path("/var/lib/postgresql/memfilter") / hashlib.sha256(str(s.dir).encode()).hexdigest()[:16]
    return _home(s, "postgres")


def _reachable_by_postgres(folder: Path) -> bool:
    """Can the `postgres` user pass through every folder down to `folder` (the nearest that exists)?"""
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    try:
        return subprocess.run(["test", "-x", str(existing)], user="postgres", capture_output=True).returncode == 0
    except (KeyError, OSError):  # no `postgres` user yet
        return False


def _start_postgres(s: Settings, bin_dir: Path, enter: list[str]) -> subprocess.Popen:
    return start_postgres(_postgres_home(s), s.postgres_port, bin_dir, s.host_of("postgres"), enter)


def start_postgres(home: Path, port: int, bin_dir: Path, host: str = "127.0.0.1", enter: list[str] | None = None) -> subprocess.Popen:
    """PostgreSQL on `home`/data (made by initdb on first start), on TCP at `host` alone (with
    trust for loopback's clients, and for its subnet's when `host` is not loopback), logging to
    `home`/postgres.log; as the `postgres` user when started as root (PostgreSQL refuses root),
    in a session of its own (its process group is its server's pid); run by `enter` first
    (`up`'s), when it is on a host of its own."""
    data = home / "data"
    home.mkdir(parents=True, exist_ok=True)
    user = "postgres" if os.geteuid() == 0 else None
    if user:
        shutil.chown(home, user)
    if not (data / "PG_VERSION").exists():
        init = [str(bin_dir / "initdb"), "-D", str(data), "-U", POSTGRES_USER, "--auth=trust", "-E", "UTF8", "--no-instructions"]
        done = subprocess.run(init, capture_output=True, text=True, user=user)
        if done.returncode != 0:
            raise StackError(f"initdb of PostgreSQL's data in {data} failed: {(done.stderr or done.stdout).strip()[-200:]}")
    hba, subnet = data / "pg_hba.conf", "host all all samenet trust\n"
    if not host.startswith("127.") and subnet not in hba.read_text():
        with open(hba, "a") as rules:
            rules.write(subnet)
    server = [str(bin_dir / "postgres"), "-D", str(data), "-p", str(port), "-c", f"listen_addresses={host}", "-c", "unix_socket_directories="]
    if enter and user:  # entering a host needs root: the user is taken after it (setpriv execs, so the pid is the server's)
        server, user = [*enter, "setpriv", f"--reuid={user}", f"--regid={user}", "--init-groups", *server], None
    elif enter:
        server = [*enter, *server]
    with open(home / "postgres.log", "ab") as out:
        return subprocess.Popen(server, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True, user=user)


def postgres_answers(port: int, host: str = "127.0.0.1") -> bool:
    """Does the PostgreSQL on this port accept connections (pg_isready)?"""
    done = subprocess.run([str(postgres_bin() / "pg_isready"), "-q", "-h", host, "-p", str(port)], capture_output=True)
    return done.returncode == 0


def _kafka_properties(s: Settings, n: int, data: Path) -> str:
    """Broker n's (from 0) server.properties: one broker, its own quorum; or one of a replicated
    cluster, a voter of a static quorum of all of them."""
    brokers = [name for name in s.names() if name.startswith("kafka")]
    if s.brokers == 1:
        quorum = f"controller.quorum.bootstrap.servers={s.host_of(brokers[0])}:{s.controller_ports[n]}"
    else:
        quorum = "controller.quorum.voters=" + ",".join(f"{i + 1}@{s.host_of(brokers[i])}:{port}" for i, port in enumerate(s.controller_ports))
    return SERVER_PROPERTIES.format(
        host=s.host_of(brokers[n]),
        node_id=n + 1,
        kafka_port=s.kafka_ports[n],
        controller_port=s.controller_ports[n],
        quorum=quorum,
        data=data,
        replicas=s.brokers,
        isr=min(2, s.brokers),
    )


def _start_kafka(s: Settings, name: str, java: str, libs: Path, cluster_id: str, enter: list[str]) -> subprocess.Popen:
    n = int(name.partition("-")[2] or 1) - 1
    home = _home(s, name)
    data = home / "data"
    home.mkdir(parents=True, exist_ok=True)
    props = home / "server.properties"
    props.write_text(_kafka_properties(s, n, data))
    jvm = [
        java,
        "-Xms256m",
        "-Xmx1g",
        "-Dorg.slf4j.simpleLogger.defaultLogLevel=warn",
        "-Dorg.slf4j.simpleLogger.showDateTime=true",
        "-Dorg.slf4j.simpleLogger.dateTimeFormat=yyyy-MM-dd HH:mm:ss,SSS",
        "-cp",
        f"{libs}/*",
    ]
    formatted_for = home / "formatted-for-controller-port"
    if data.exists() and formatted_for.exists() and formatted_for.read_text() != str(s.controller_ports[n]):
        _say("controller port changed since the storage was formatted; formatting Kafka's storage anew")
        shutil.rmtree(data)
    if not (data / "meta.properties").exists():
        # One broker formats itself as the whole quorum; brokers of a cluster share its id and its static voters.
        fmt = [*jvm, "kafka.tools.StorageTool", "format", *(["--standalone"] if s.brokers == 1 else []), "-t", cluster_id, "-c", str(props)]
        done = subprocess.run(fmt, capture_output=True, text=True)
        if done.returncode != 0:
            raise StackError(f"formatting Kafka's storage failed: {(done.stderr or done.stdout).strip()[-200:]}")
        formatted_for.write_text(str(s.controller_ports[n]))
    # The stack folder on the command line marks the process as this stack's (see `running`),
    # first, so that an error naming a process by its command line's start names the folder.
    return _spawn([*enter, java, f"-Dmemfilter.stack={s.dir}", *jvm[1:], "kafka.Kafka", str(props)], home / "kafka.log")


def _cluster_id(s: Settings, java: str, libs: Path) -> str:
    """The Kafka cluster's id, made once and kept in the stack folder."""
    path = s.dir / "kafka-cluster-id"
    if not path.exists():
        jvm = [java, "-cp", f"{libs}/*", "kafka.tools.StorageTool", "random-uuid"]
        path.write_text(subprocess.run(jvm, capture_output=True, text=True).stdout.strip())
    return path.read_text().strip()


def _port_open(port: int, host: str) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1):
            return True
    except OSError:
        return False


def _redis_answers(port: int, host: str) -> bool:
    try:
        with socket.create_connection((host, port), timeout=1) as sock:
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


def topic_configs(retention_ms: int) -> dict[str, str]:
    """A topic's settings: how long it keeps a record (-1: for ever; `Topics.retention_ms`)."""
    return {"retention.ms": str(retention_ms)}


async def _create_topics(s: Settings, deadline: float) -> None:
    """Create the topics that are missing; refuse a partition count other than the existing."""
    from aiokafka.admin import AIOKafkaAdminClient, NewTopic

    while True:
        admin = AIOKafkaAdminClient(bootstrap_servers=s.bootstrap, request_timeout_ms=5000)
        try:
            await admin.start()
            existing = set(await admin.list_topics()) & set(s.topics)
            counts = {t["topic"]: len(t["partitions"]) for t in await admin.describe_topics(sorted(existing))} if existing else {}
            partitions = s.partitions or next(iter(counts.values()), DEFAULT_PARTITIONS)
            retention = dict(s.retention)
            missing = [NewTopic(t, partitions, s.brokers, topic_configs=topic_configs(retention[t])) for t in s.topics if t not in existing]
            if not missing:
                await _keep_retention(admin, sorted(existing), retention)
                break
            await admin.create_topics(missing)  # refused per topic while brokers are still joining: asked again
            await asyncio.sleep(0.2)
        except StackError:
            raise
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


# A topic config's source, as DescribeConfigs v1+ gives it: set on the topic itself.
DYNAMIC_TOPIC_CONFIG = 1


async def _keep_retention(admin: Any, topics: list[str], retention: dict[str, int]) -> None:
    """Give topics made before the retention the settings give now (MEMFILTER_*_RETENTION_DAYS
    changed). Kafka's AlterConfigs replaces a topic's own configs whole, so each topic's others
    (a `segment.ms` an operator set, say: docs/erasure.md) are sent with it, and only a topic
    whose retention differs is altered."""
    from aiokafka.admin.config_resource import ConfigResource, ConfigResourceType

    changes = []
    for described in await admin.describe_configs([ConfigResource(ConfigResourceType.TOPIC, t) for t in topics]):
        for _, _, _, topic, entries in described.resources:  # entries: (name, value, read-only, source, sensitive, synonyms)
            own = {name: value for name, value, _, source, *_ in entries if source == DYNAMIC_TOPIC_CONFIG}
            if own.get("retention.ms") != str(retention[topic]):
                changes.append(ConfigResource(ConfigResourceType.TOPIC, topic, configs=own | topic_configs(retention[topic])))
    if not changes:
        return
    for response in await admin.alter_configs(changes):
        for code, message, _, topic in response.resources:
            if code:
                raise StackError(f"Kafka refused the retention of topic {topic} (error {code}: {message}); set it with kafka-configs.sh --alter")


def _redis_cli(host: str, port: int, *args: str) -> str:
    done = subprocess.run(["redis-cli", "-h", host, "-p", str(port), *args], capture_output=True, text=True, timeout=60)
    return done.stdout + done.stderr


def _cluster_ok(nodes: list[tuple[str, int]]) -> bool:
    """Every node of the Redis Cluster sees all the slots served, and every replica has its
    master's data (a node started again syncs with its master first)."""
    for host, port in nodes:
        replication = _redis_cli(host, port, "info", "replication")
        if "cluster_state:ok" not in _redis_cli(host, port, "cluster", "info") or ("role:slave" in replication and "master_link_status:up" not in replication):
            return False
    return True


def _create_cluster(s: Settings, deadline: float) -> None:
    """Join the nodes into a cluster of three masters with a replica each, once; then wait until
    it is whole (`_cluster_ok`: after a restart too, while a node takes its place again)."""
    ports = s.redis_ports
    nodes = [(s.host_of(f"redis-{port}"), port) for port in ports]
    if "cluster_known_nodes:1\n" in _redis_cli(*nodes[0], "cluster", "info"):
        out = _redis_cli(*nodes[0], "--cluster", "create", *(f"{h}:{p}" for h, p in nodes), "--cluster-replicas", "1", "--cluster-yes")
        if "[OK] All 16384 slots covered" not in out:
            raise StackError(f"`redis-cli --cluster create` failed: {out.strip().splitlines()[-1:]}")
    while not _cluster_ok(nodes):
        if time.monotonic() > deadline:
            raise StackError(f"the Redis Cluster on ports {ports[0]}-{ports[-1]} did not reach cluster_state:ok in time")
        time.sleep(0.2)


def _wait(s: Settings, started: dict[str, subprocess.Popen], timeout: float) -> None:
    """Until the processes just started answer, and the topics (and the Redis Cluster) exist."""
    deadline = time.monotonic() + timeout
    for name, process in started.items():
        port = _ports(s, name)[0][1]
        log = _postgres_home(s) / "postgres.log" if name == "postgres" else _home(s, name) / ("redis.log" if name.startswith("redis") else "kafka.log")
        answers = {"r": _redis_answers, "k": _port_open, "p": postgres_answers}[name[0]]
        while not answers(port, s.host_of(name)):
            if process.poll() is not None:
                raise StackError(f"{name} exited at start: see {log}")
            if time.monotonic() > deadline:
                raise StackError(f"{name} on port {port} did not answer within {timeout:.0f}s: see {log}")
            time.sleep(0.1)
    if s.redis_cluster:
        _create_cluster(s, deadline)
    asyncio.run(_create_topics(s, deadline))


def _stop(name: str, pid: int, marker: str, grace: float) -> None:
    if not _alive(pid, marker):
        return
    # PostgreSQL's SIGTERM waits for its clients to leave; SIGINT is its fast shutdown.
    os.kill(pid, signal.SIGINT if name == "postgres" else signal.SIGTERM)
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


def up(s: Settings, timeout: float = 90.0, enter: Callable[[str], list[str]] = lambda name: []) -> Running:
    """Start the stack in `s.dir`, or what of it stopped (a process that died is started again
    on its data); return its record. `enter(name)` is the command that runs process `name` on
    its host (`Settings.hosts`: the Jepsen tier's `ip netns exec <host>`), before its own."""
    before = recorded(s)
    if before is not None and (before.brokers, before.redis_cluster) != (s.brokers, s.redis_cluster):
        shape = lambda brokers, cluster: f"{brokers} broker{'s' if brokers > 1 else ''} and {'a Redis Cluster' if cluster else 'one Redis'}"  # noqa: E731
        raise StackError(
            f"the stack in {s.dir} has {shape(before.brokers, before.redis_cluster)}, not {shape(s.brokers, s.redis_cluster)}: "
            "run `memfilter stack down` and use another MEMFILTER_STACK_DIR for the other shape"
        )
    if before is not None:  # a process of the running stack stays on its ports
        s = before.settings(s)
    if s.redis_cluster and max(s.redis_ports) + CLUSTER_BUS_OFFSET > 65535:
        first, last = min(s.redis_ports), max(s.redis_ports)
        raise StackError(
            f"a Redis Cluster on ports {first}-{last} needs bus ports {first + CLUSTER_BUS_OFFSET}-{last + CLUSTER_BUS_OFFSET}, past 65535: "
            f"set MEMFILTER_REDIS_PORT to {65535 - CLUSTER_BUS_OFFSET - (last - first)} or lower"
        )
    up_already = alive(s, before) if before is not None else dict.fromkeys(s.names(), False)
    if before is not None and all(up_already.values()):
        if s.redis_cluster:
            _create_cluster(s, time.monotonic() + timeout)
        asyncio.run(_create_topics(s, time.monotonic() + timeout))
        _say(f"already running from {s.dir}")
        return before
    missing = [name for name, is_up in up_already.items() if not is_up]
    java = _check_java() if any(name.startswith("kafka") for name in missing) else ""
    server = redis_server() if any(name.startswith("redis") for name in missing) else ""
    pg_bin = postgres_bin() if "postgres" in missing else None
    _check_ports(s, missing)
    s.dir.mkdir(parents=True, exist_ok=True)
    libs = _kafka_libs(s) if java else s.dir
    cluster_id = _cluster_id(s, java, libs) if java else ""
    started: dict[str, subprocess.Popen] = {}
    try:
        for name in missing:
            if name.startswith("redis"):
                started[name] = _start_redis(s, name, server, enter(name))
            elif name == "postgres":
                assert pg_bin is not None
                started[name] = _start_postgres(s, pg_bin, enter(name))
            else:
                started[name] = _start_kafka(s, name, java, libs, cluster_id, enter(name))
        _wait(s, started, timeout)
    except BaseException:
        for name, process in reversed(started.items()):
            _stop(name, process.pid, _marker(name, s), grace=5)
        raise
    running = {**(before.pids if before is not None else {}), **{name: process.pid for name, process in started.items()}}
    pids = {name: running[name] for name in s.names()}
    hosts = [[name, address] for name, address in s.hosts]
    record = Running(pids, s.kafka_port, s.controller_port, s.redis_port, s.brokers, s.redis_cluster, s.postgres_port, s.host, hosts)
    _state_file(s).write_text(json.dumps(asdict(record)))
    if before is not None:
        _say(f"started {' and '.join(missing)} again; the stack runs from {s.dir}")
    else:
        _say(f"Kafka on {s.bootstrap}, Redis on {s.redis_url}, PostgreSQL on {s.postgres_url}, topics made; processes {pids}")
    return record


def down(s: Settings) -> bool:
    """Stop the stack of `s.dir`: Kafka first (a controlled shutdown), then Redis, then PostgreSQL."""
    r = recorded(s)
    if r is None:
        return False
    s = r.settings(s)
    for name, pid in r.pids.items():
        _stop(name, pid, _marker(name, s), grace=30 if name.startswith("kafka") else 10)
    _state_file(s).unlink(missing_ok=True)
    return True


def status(s: Settings) -> tuple[str, bool]:
    """What runs, process by process; and whether all of it runs."""
    r = recorded(s)
    if r is None:
        return f"stopped (stack folder {s.dir})", False
    s = r.settings(s)
    is_up = alive(s, r)
    if all(is_up.values()):
        head = f"running from {s.dir}"
    elif any(is_up.values()):
        head = f"partly running from {s.dir}: `memfilter stack up` starts what stopped"
    else:
        head = f"stopped (stack folder {s.dir})"
    lines = [head]
    for name in s.names():
        state = "running" if is_up[name] else "stopped"
        ports = _ports(s, name)
        if name.startswith("kafka"):
            where = f"{s.host_of(name)}:{ports[0][1]} (controller {ports[1][1]})"
        else:
            where = s.postgres_url if name == "postgres" else f"redis://{s.host_of(name)}:{ports[0][1]}"
        pid = r.pids.get(name, "-")
        lines.append(f"  {name}  {state}  pid {pid}  {where}")
    return "\n".join(lines), all(is_up.values())
