"""A host's packets held before they leave: the delay and the reordering this machine's kernel
cannot make (it has neither `netem` nor `fq`, whose timed departures would do it).

Run by `net.Net.delay` in a host's namespace, where it makes the tun device DEVICE; the host's
routes then send what it sends into the device (to the addresses `Net.delay` names). This
reads each packet, holds it MS milliseconds plus a random share of JITTER milliseconds, and
writes it back into the device, from where the kernel forwards it on the host's link. Without
jitter the packets leave in the order they came; with jitter wider than the gap between two,
out of order. It prints "up" once the device is made, and runs until killed (the device goes
with it).

Usage: python delay.py DEVICE MS JITTER
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import random
import struct
import sys

TUNSETIFF = 0x400454CA
IFF_TUN, IFF_NO_PI = 0x0001, 0x1000  # IP packets, no header of tun's own before them


def main() -> None:
    device, ms, jitter = sys.argv[1], float(sys.argv[2]), float(sys.argv[3])
    tun = os.open("/dev/net/tun", os.O_RDWR | os.O_NONBLOCK)
    fcntl.ioctl(tun, TUNSETIFF, struct.pack("16sH", device.encode(), IFF_TUN | IFF_NO_PI))
    loop = asyncio.new_event_loop()

    def send(packet: bytes) -> None:
        try:
            os.write(tun, packet)
        except OSError:  # the device's queue full: the packet lost, as a link loses one
            pass

    def arrived() -> None:
        while True:
            try:
                packet = os.read(tun, 65536)
            except BlockingIOError:
                return
            loop.call_later((ms + random.uniform(0, jitter)) / 1000, send, packet)

    loop.add_reader(tun, arrived)
    print("up", flush=True)
    loop.run_forever()


if __name__ == "__main__":
    main()
