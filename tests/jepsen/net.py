"""The Jepsen tier's network: hosts in network namespaces of the harness's own, joined by a
bridge it makes, and the faults it puts between them.

Every name it makes starts with `mfj` and the run's tag: a namespace per host, a hub namespace
holding the bridge, a veth pair per host (one end in the host's namespace, the other on the
bridge) and one for the test process (one end in the machine's namespace). Addresses are
link-local, 169.254.<subnet>.<n>/24: the test process's end takes .1 (so it reaches every
host, and no host reaches anything else: no route leaves the subnet), hosts .2 on. Leaving the block (`with Net(...)`) removes all of it, even
when a test fails; `sweep()` removes what a run that was killed left.

Faults, each undone by `heal()`:
- `cut(a, b)`: no packet from a reaches b, nor from b reaches a (`one_way=True`: a's to b only;
  `port`: only a's connections to that port of b), by nft rules in the hosts' own namespaces
  (table `mfj`); `partition(side, side, ...)`: every host of a side cut from every host of
  the others (a host on none reaches all: a bridge); `isolate(a)`: a cut from every other
  host and from the test process;
- `loss(a, percent)`: a drops that share of the packets it sends and receives (nft `numgen`);
- `slow(a, kbit)`: a's link sends at most that rate (tc `tbf`);
- `delay(a, ms, b, jitter)`: what a sends (to b only, with `b`) is held `ms`, plus up to
  `jitter` at random per packet, which sends them out of order. This machine's kernel has no
  `netem` (nor `fq`): a process in a's namespace holds them (`delay.py`, on a tun device that
  a's routes send them into).
Pauses (SIGSTOP) and clocks (faketime) are the processes', not the network's: `Host.popen`
starts a process in a host.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path

PREFIX = "mfj"
DELAY = Path(__file__).with_name("delay.py")
DELAYED = 100  # the routing table, and the rule's priority, that send a host's packets into its delay device


def _ip(*argv: str, ns: str | None = None, check: bool = True) -> subprocess.CompletedProcess:
    command = ["ip", *(["-n", ns] if ns else []), *argv]
    done = subprocess.run(command, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise RuntimeError(f"`{' '.join(command)}` failed: {done.stderr.strip()}")
    return done


def _nft(ns: str, rules: str) -> None:
    done = subprocess.run(["ip", "netns", "exec", ns, "nft", "-f", "-"], input=rules, capture_output=True, text=True)
    if done.returncode != 0:
        raise RuntimeError(f"nft in {ns} failed: {done.stderr.strip()}\n{rules}")


def sweep() -> None:
    """Remove every namespace and link a run of the harness left (their names start with PREFIX),
    and the processes still in them."""
    for line in _ip("netns", "list").stdout.splitlines():
        if line.startswith(PREFIX):
            ns = line.split()[0]
            for pid in _ip("netns", "pids", ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
            _ip("netns", "del", ns, check=False)
    for line in _ip("-o", "link", "show").stdout.splitlines():
        name = line.split(": ")[1].split("@")[0]
        if name.startswith(PREFIX):
            _ip("link", "del", name, check=False)


@dataclass
class Host:
    name: str
    ns: str
    address: str
    link: str  # its end of the veth pair, in its namespace
    processes: list[subprocess.Popen] = field(default_factory=list)

    def popen(self, argv: list[str], env: dict[str, str] | None = None, log: Path | None = None, **kwargs) -> subprocess.Popen:
        """A process in this host's namespace (stopped when the network is removed)."""
        out = open(log, "ab") if log is not None else subprocess.DEVNULL
        process = subprocess.Popen(["ip", "netns", "exec", self.ns, *argv], env=env, stdout=out, stderr=subprocess.STDOUT, **kwargs)
        self.processes.append(process)
        return process

    def run(self, argv: list[str], **kwargs) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns, *argv], capture_output=True, text=True, **kwargs)


class Net:
    """Hosts by name, on a bridge of their own; the faults between them."""

    def __init__(self, names: list[str], subnet: int | None = None):
        if os.geteuid() != 0:
            raise PermissionError("the Jepsen tier makes network namespaces: run it as root")
        self.tag = f"{PREFIX}{secrets.token_hex(2)}"
        self.subnet = subnet if subnet is not None else 100 + secrets.randbelow(100)
        self.hub, self.bridge = f"{self.tag}-hub", f"{self.tag}br"
        self.gateway = f"169.254.{self.subnet}.1"  # the test process's address on the subnet
        self.names = names
        self.hosts: dict[str, Host] = {}
        self.delays: dict[str, subprocess.Popen] = {}  # by host: the process holding its packets (`delay`)

    def __enter__(self) -> Net:
        try:
            # The bridge is in a namespace of its own (the hub): frames crossing a bridge go
            # through its namespace's iptables, and the machine's own may drop forwarded
            # packets (Docker's FORWARD policy does). The test process reaches it by a veth pair.
            _ip("netns", "add", self.hub)
            _ip("link", "add", self.bridge, "type", "bridge", ns=self.hub)
            _ip("link", "set", self.bridge, "up", ns=self.hub)
            _ip("link", "add", f"{self.tag}r", "type", "veth", "peer", "name", f"{self.tag}rb", "netns", self.hub)
            _ip("link", "set", f"{self.tag}rb", "master", self.bridge, "up", ns=self.hub)
            _ip("addr", "add", f"{self.gateway}/24", "dev", f"{self.tag}r")
            _ip("link", "set", f"{self.tag}r", "up")
            for n, name in enumerate(self.names, start=2):
                host = Host(name, f"{self.tag}-{name}", f"169.254.{self.subnet}.{n}", f"{self.tag}h{n}")
                _ip("netns", "add", host.ns)
                _ip("link", "set", "lo", "up", ns=host.ns)
                _ip("link", "add", host.link, "netns", host.ns, "type", "veth", "peer", "name", f"{self.tag}b{n}", "netns", self.hub)
                _ip("link", "set", f"{self.tag}b{n}", "master", self.bridge, "up", ns=self.hub)
                _ip("addr", "add", f"{host.address}/24", "dev", host.link, ns=host.ns)
                _ip("link", "set", host.link, "up", ns=host.ns)
                _nft(host.ns, _TABLE)
                self.hosts[name] = host
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def __exit__(self, *_) -> None:
        for host in self.hosts.values():
            for process in host.processes:
                if process.poll() is None:
                    process.kill()
                    process.wait(10)
            # and what they left running there (daemons, a stack's services): a namespace lives on while a process holds it
            for pid in _ip("netns", "pids", host.ns, check=False).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for host in self.hosts.values():
            _ip("netns", "del", host.ns, check=False)  # its veth pair with it
        _ip("netns", "del", self.hub, check=False)  # the bridge, and the test process's veth pair
        _ip("link", "del", f"{self.tag}r", check=False)

    def __getitem__(self, name: str) -> Host:
        return self.hosts[name]

    def cut(self, a: str, b: str, one_way: bool = False, port: int | None = None) -> None:
        """No packet from a to b (and, unless `one_way`, from b to a): each host drops what it
        would send to the other and what it receives from it. With `port`, only a's connections
        to that TCP port of b (a worker cut from the brokers, not from Redis on the same host)."""
        ha, hb = self.hosts[a], self.hosts[b]
        to, back = ("", "") if port is None else (f" tcp dport {port}", f" tcp sport {port}")
        _nft(ha.ns, f"add rule inet mfj out ip daddr {hb.address}{to} drop\n")
        _nft(hb.ns, f"add rule inet mfj in ip saddr {ha.address}{to} drop\n")
        if not one_way:
            _nft(hb.ns, f"add rule inet mfj out ip daddr {ha.address}{back} drop\n")
            _nft(ha.ns, f"add rule inet mfj in ip saddr {hb.address}{back} drop\n")

    def partition(self, *sides: list[str]) -> None:
        """No packet between hosts on different sides; a host on no side (a bridge) reaches both."""
        for i, side in enumerate(sides):
            for a in side:
                for other in sides[i + 1 :]:
                    for b in other:
                        self.cut(a, b)

    def isolate(self, a: str) -> None:
        """a hears from no one, the test process included, and reaches no one."""
        _nft(
            self.hosts[a].ns, f"add rule inet mfj out ip daddr 169.254.{self.subnet}.0/24 drop\nadd rule inet mfj in ip saddr 169.254.{self.subnet}.0/24 drop\n"
        )

    def loss(self, a: str, percent: int, b: str | None = None) -> None:
        """a drops `percent` of the packets it sends and of those it receives, at random (with
        `b`: only those to and from b, the link between them)."""
        to, back = ("", "") if b is None else (f"ip daddr {self.hosts[b].address} ", f"ip saddr {self.hosts[b].address} ")
        _nft(
            self.hosts[a].ns,
            f"add rule inet mfj out {to}numgen random mod 100 < {percent} drop\nadd rule inet mfj in {back}numgen random mod 100 < {percent} drop\n",
        )

    def slow(self, a: str, kbit: int) -> None:
        """a's link sends at most `kbit` kilobits a second (a token bucket; what waits longer than
        1 s is dropped): under load, a delay of up to a second. The delay of this machine's
        kernel: it has no netem."""
        host = self.hosts[a]
        done = host.run(["tc", "qdisc", "replace", "dev", host.link, "root", "tbf", "rate", f"{kbit}kbit", "burst", "16kb", "latency", "1s"])
        if done.returncode != 0:
            raise RuntimeError(f"tc in {host.ns} failed: {done.stderr.strip()}")

    def delay(self, a: str, ms: int, b: str | None = None, jitter: int = 0) -> None:
        """What a sends (with `b`, to b only) is held `ms` milliseconds, plus up to `jitter` more
        at random per packet: with jitter, packets leave out of order (a TCP connection's
        segments among them). What a receives is not held: delay both ends for a slow link.
        One delay per host at a time."""
        host = self.hosts[a]
        device = f"{self.tag}d"
        holder = subprocess.Popen(["ip", "netns", "exec", host.ns, sys.executable, str(DELAY), device, str(ms), str(jitter)], stdout=subprocess.PIPE, text=True)
        host.processes.append(holder)
        self.delays[a] = holder
        if holder.stdout is None or holder.stdout.readline().strip() != "up":
            raise RuntimeError(f"the delay of {a} did not start (exit {holder.wait(5)})")
        # Written back into the device, a's packets come in from it: a forwards them on its link,
        # though their source is its own address (accept_local) and no route leads back there.
        conf = f"net.ipv4.conf.{device}"
        done = host.run(["sysctl", "-q", "-w", "net.ipv4.ip_forward=1", f"{conf}.accept_local=1", f"{conf}.rp_filter=0", "net.ipv4.conf.all.rp_filter=0"])
        if done.returncode != 0:
            raise RuntimeError(f"sysctl in {host.ns} failed: {done.stderr.strip()}")
        _ip("link", "set", device, "up", ns=host.ns)
        _ip("route", "add", f"169.254.{self.subnet}.0/24", "dev", device, "src", host.address, "table", str(DELAYED), ns=host.ns)
        target = self.hosts[b].address if b is not None else f"169.254.{self.subnet}.0/24"
        _ip("rule", "add", "iif", "lo", "to", target, "lookup", str(DELAYED), "pref", str(DELAYED), ns=host.ns)  # iif lo: what a itself sends

    def heal(self) -> None:
        """Every fault above undone: the rules flushed, the links' rates back, no packet held."""
        for host in self.hosts.values():
            _nft(host.ns, "flush chain inet mfj in\nflush chain inet mfj out\n")
            host.run(["tc", "qdisc", "del", "dev", host.link, "root"])
        for a, holder in self.delays.items():
            _ip("rule", "del", "pref", str(DELAYED), ns=self.hosts[a].ns, check=False)
            holder.kill()  # the packets it held are lost; its device, and the route into it, go with it
            holder.wait(10)
        self.delays = {}


# A host's own table: the faults' rules go in these chains (loopback is never touched).
_TABLE = """table inet mfj {
  chain in { type filter hook input priority 0; policy accept; iif "lo" accept; }
  chain out { type filter hook output priority 0; policy accept; oif "lo" accept; }
}
"""
