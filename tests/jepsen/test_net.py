"""The harness's network (`net.py`) does what the faults say, and leaves nothing behind: hosts
reach each other through the bridge, a cut stops packets both ways or one way, an isolated
host reaches no one, loss drops a share, a delay holds packets and with jitter reorders them,
heal undoes it all, and leaving the block removes every namespace and link it made."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import pytest
from net import PREFIX, Net

# A TCP echo server on port 7000 of its host, printing "up" once it listens.
SERVER = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); s.bind((sys.argv[1], 7000)); s.listen(64)
print("up", flush=True)
while True:
    c, _ = s.accept(); c.sendall(c.recv(64)); c.close()
"""
# Connect to each address given, print one line each: "ok" if the echo came back, else "no".
CLIENT = """
import socket, sys
for address in sys.argv[1:]:
    try:
        c = socket.create_connection((address, 7000), timeout=1.0); c.sendall(b"x"); print("ok" if c.recv(1) == b"x" else "no")
    except OSError:
        print("no")
"""


# Print the sequence numbers of the UDP datagrams that come to port 7001, in the order they
# came, once the first has and none has for 1 s (the sender sends one a millisecond).
RECEIVER = """
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); s.bind((sys.argv[1], 7001)); print("up", flush=True)
got = [int(s.recv(64))]; s.settimeout(1)
try:
    while True: got.append(int(s.recv(64)))
except TimeoutError:
    print(" ".join(map(str, got)))
"""
# Send datagrams 0..N-1 to port 7001 of an address, one a millisecond.
SENDER = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for n in range(int(sys.argv[2])):
    s.sendto(str(n).encode(), (sys.argv[1], 7001)); time.sleep(0.001)
"""


def reach(net: Net, source: str, *targets: str) -> list[bool]:
    """Whether `source` gets an echo from each of `targets`."""
    done = net[source].run([sys.executable, "-c", CLIENT, *(net[t].address for t in targets)], timeout=30)
    return [line == "ok" for line in done.stdout.split()]


def echo_s(net: Net, source: str, target: str) -> float:
    """How long `source` takes to connect to `target`, have its echo and close, in seconds."""
    timed = "import time; t = time.monotonic(); exec(open(0).read()); print(time.monotonic() - t)"
    done = net[source].run([sys.executable, "-c", timed, net[target].address], input=CLIENT, timeout=30)
    lines = done.stdout.split()
    assert lines[0] == "ok", done.stdout + done.stderr
    return float(lines[-1])


def datagrams(net: Net, source: str, target: str, count: int) -> list[int]:
    """The sequence numbers of `count` datagrams `source` sends `target`, in the order they came."""
    receiver = subprocess.Popen(["ip", "netns", "exec", net[target].ns, sys.executable, "-c", RECEIVER, net[target].address], stdout=subprocess.PIPE, text=True)
    net[target].processes.append(receiver)
    assert receiver.stdout.readline().strip() == "up"
    net[source].run([sys.executable, "-c", SENDER, net[target].address, str(count)], timeout=30, check=True)
    return [int(n) for n in receiver.communicate(timeout=30)[0].split()]


def from_here(address: str) -> bool:
    """Whether the test process, in the machine's own namespace, gets an echo from `address`."""
    try:
        with socket.create_connection((address, 7000), timeout=1.0) as c:
            c.sendall(b"x")
            return c.recv(1) == b"x"
    except OSError:
        return False


@pytest.fixture
def net():
    with Net(["a", "b", "c"]) as made:
        for host in made.hosts.values():
            server = subprocess.Popen(["ip", "netns", "exec", host.ns, sys.executable, "-c", SERVER, host.address], stdout=subprocess.PIPE, text=True)
            host.processes.append(server)
            assert server.stdout.readline().strip() == "up"
        yield made


def leftovers() -> list[str]:
    names = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout.split()
    links = [line.split(": ")[1] for line in subprocess.run(["ip", "-o", "link", "show"], capture_output=True, text=True).stdout.splitlines()]
    return [n for n in [*names, *links] if n.startswith(PREFIX)]


class TestTheFaultsDoWhatTheySay:
    def test_hosts_reach_each_other_and_the_test_process_reaches_them(self, net):
        assert reach(net, "a", "b", "c") == [True, True]
        assert from_here(net["a"].address)

    def test_a_cut_stops_packets_both_ways_and_leaves_the_other_links(self, net):
        net.cut("a", "b")
        assert reach(net, "a", "b", "c") == [False, True]
        assert reach(net, "b", "a", "c") == [False, True]

    def test_a_one_way_cut_stops_only_what_goes_that_way(self, net):
        net.cut("a", "b", one_way=True)  # a's packets never reach b: no connection either way (TCP needs both)
        assert reach(net, "a", "b") == [False] and reach(net, "b", "a") == [False]
        assert reach(net, "c", "a", "b") == [True, True]

    def test_a_cut_of_one_port_leaves_the_hosts_other_ports(self, net):
        net.cut("a", "b", port=7000)
        assert reach(net, "a", "b") == [False] and reach(net, "b", "a") == [True]  # b's connections to a are not a's to b's port

    def test_an_isolated_host_reaches_no_one_and_no_one_reaches_it(self, net):
        net.isolate("c")
        assert reach(net, "c", "a", "b") == [False, False]
        assert reach(net, "a", "b", "c") == [True, False]
        assert not from_here(net["c"].address) and from_here(net["a"].address)

    # Counted in datagrams, not connections: of 200 each dropped at even odds, fewer than 40 or
    # more than 160 coming is a chance below 1e-17; a TCP echo's few packets and retransmit
    # timers made a count of connections a coin that could come up all lost.
    def test_a_lossy_link_drops_a_share_of_packets_and_not_all(self, net):
        net.loss("a", 50)
        assert 40 < len(datagrams(net, "b", "a", 200)) < 160

    def test_a_lossy_link_between_two_hosts_leaves_their_other_links(self, net):
        net.loss("a", 50, "b")
        assert 40 < len(datagrams(net, "b", "a", 200)) < 160
        assert datagrams(net, "c", "a", 200) == list(range(200))

    def test_a_delay_holds_what_a_host_sends_and_loses_nothing(self, net):
        assert echo_s(net, "a", "b") < 0.3
        net.delay("a", 300)
        assert echo_s(net, "a", "b") > 0.6  # its SYN, then its data, each held 300 ms
        assert reach(net, "c", "a") == [True] and echo_s(net, "c", "b") < 0.3
        assert datagrams(net, "a", "b", 200) == list(range(200))  # held, each as long: in order, every one

    def test_a_delay_to_one_host_leaves_the_hosts_other_links(self, net):
        net.delay("a", 300, "b")
        assert echo_s(net, "a", "b") > 0.6 and echo_s(net, "a", "c") < 0.3

    def test_jitter_reorders_what_a_host_sends_and_loses_nothing(self, net):
        net.delay("a", 5, jitter=50)
        got = datagrams(net, "a", "b", 300)
        assert sorted(got) == list(range(300)) and got != list(range(300))
        assert reach(net, "a", "b", "c") == [True, True]  # TCP puts its segments back in order

    def test_heal_undoes_every_fault(self, net):
        net.cut("a", "b")
        net.isolate("c")
        net.slow("a", 64)
        net.delay("b", 500)
        net.heal()
        assert reach(net, "a", "b", "c") == [True, True] and reach(net, "c", "a") == [True]
        assert echo_s(net, "b", "a") < 0.3


class TestNothingIsLeftBehind:
    def test_leaving_the_block_removes_every_namespace_and_link_even_when_a_test_fails(self):
        with pytest.raises(RuntimeError, match="a test failing"), Net(["a", "b"]) as made:
            assert leftovers()
            made["a"].popen(["sleep", "60"])
            started = time.monotonic()
            raise RuntimeError("a test failing")
        assert leftovers() == [] and time.monotonic() - started < 20
