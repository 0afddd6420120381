"""Delay every packet that reaches a network namespace, with the kernel's netfilter queue.

This kernel has no sch_netem (CONFIG_NET_SCH_NETEM unset) and nftables cannot delay a packet,
but iptables' NFQUEUE target hands each packet to a program that says when it may go on. This
is that program: run in a namespace, it binds a queue and accepts each packet DELAY seconds
after it came. The packets keep their order (one delay for all, and a verdict batch accepts
every packet up to an id).

    ip netns exec NS iptables -t mangle -A PREROUTING ! -i lo -j NFQUEUE --queue-num 7 --queue-bypass
    ip netns exec NS python tests/netdelay.py --queue 7 --delay 0.2

On arrival (PREROUTING), not on the way out: a packet held on its way out still belongs to
its socket, and TCP's small-queue limit then lets a connection have about one packet in
flight per delay (1 MB did not cross in 20 s; held on arrival, 20 MB took 3.5 s at 200 ms).

--queue-bypass lets packets through while no program listens; the queue is opened fail-open,
so a packet that finds the queue full goes at once rather than being dropped. SIGTERM or
SIGINT: every packet still held goes at once, and the program says how many it held.

The netlink messages are linux/netfilter/nfnetlink_queue.h's, written by hand (no library).
"""

from __future__ import annotations

import argparse
import collections
import os
import select
import signal
import socket
import struct
import sys
import time

NETLINK_NETFILTER = 12
NFNL_SUBSYS_QUEUE = 3
NFQNL_MSG_PACKET, NFQNL_MSG_CONFIG, NFQNL_MSG_VERDICT_BATCH = 0, 2, 3
NFQA_PACKET_HDR, NFQA_VERDICT_HDR = 1, 2
NFQA_CFG_CMD, NFQA_CFG_PARAMS, NFQA_CFG_QUEUE_MAXLEN, NFQA_CFG_MASK, NFQA_CFG_FLAGS = 1, 2, 3, 4, 5
NFQNL_CFG_CMD_BIND = 1
NFQNL_COPY_META = 1  # the packet's id and metadata, not its bytes
NFQA_CFG_F_FAIL_OPEN, NFQA_CFG_F_GSO = 1, 4
NF_ACCEPT = 1
NLM_F_REQUEST, NLM_F_ACK = 1, 4
NLMSG_ERROR = 2
SOL_NETLINK, NETLINK_NO_ENOBUFS = 270, 5


def attr(kind: int, payload: bytes) -> bytes:
    n = 4 + len(payload)
    return struct.pack("=HH", n, kind) + payload + b"\0" * (-n % 4)


def message(msg: int, queue: int, attrs: bytes, flags: int = NLM_F_REQUEST) -> bytes:
    body = struct.pack("=BBH", socket.AF_UNSPEC, 0, socket.htons(queue)) + attrs
    return struct.pack("=IHHII", 16 + len(body), (NFNL_SUBSYS_QUEUE << 8) | msg, flags, 0, 0) + body


def attrs_of(data: bytes) -> dict[int, bytes]:
    out, i = {}, 0
    while i + 4 <= len(data):
        n, kind = struct.unpack_from("=HH", data, i)
        if n < 4:
            break
        out[kind & 0x3FFF] = data[i + 4:i + n]
        i += (n + 3) & ~3
    return out


def messages(buf: bytes):
    """(type, what follows the netlink header) of each netlink message in `buf`."""
    i = 0
    while i + 16 <= len(buf):
        n, kind = struct.unpack_from("=IH", buf, i)
        if n < 16:
            break
        yield kind, buf[i + 16:i + n]
        i += (n + 3) & ~3


def open_queue(queue: int) -> socket.socket:
    s = socket.socket(socket.AF_NETLINK, socket.SOCK_RAW, NETLINK_NETFILTER)
    s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 8 << 20)
    s.setsockopt(SOL_NETLINK, NETLINK_NO_ENOBUFS, 1)
    s.bind((0, 0))
    flags = NFQA_CFG_F_FAIL_OPEN | NFQA_CFG_F_GSO
    for attrs in (attr(NFQA_CFG_CMD, struct.pack("=BxH", NFQNL_CFG_CMD_BIND, 0)),
                  attr(NFQA_CFG_PARAMS, struct.pack(">IB", 0, NFQNL_COPY_META))
                  + attr(NFQA_CFG_QUEUE_MAXLEN, struct.pack(">I", 1 << 16))
                  + attr(NFQA_CFG_MASK, struct.pack(">I", flags)) + attr(NFQA_CFG_FLAGS, struct.pack(">I", flags))):
        s.send(message(NFQNL_MSG_CONFIG, queue, attrs, NLM_F_REQUEST | NLM_F_ACK))
        for kind, payload in messages(s.recv(65536)):
            if kind == NLMSG_ERROR and (err := struct.unpack_from("=i", payload)[0]):
                raise OSError(-err, f"binding netfilter queue {queue}: {os.strerror(-err)}")
    return s


def accept_up_to(s: socket.socket, queue: int, packet_id: int) -> None:
    """Every packet of the queue up to `packet_id` goes on (one verdict batch)."""
    s.send(message(NFQNL_MSG_VERDICT_BATCH, queue, attr(NFQA_VERDICT_HDR, struct.pack(">II", NF_ACCEPT, packet_id))))


def run(queue: int, delay: float) -> int:
    s = open_queue(queue)
    held: collections.deque[tuple[float, int]] = collections.deque()  # (when it may go, packet id)
    count = 0
    stop = []
    signal.signal(signal.SIGTERM, lambda *_: stop.append(1))
    signal.signal(signal.SIGINT, lambda *_: stop.append(1))
    print(f"netdelay: queue {queue}, {delay * 1000:.0f} ms", flush=True)
    while not stop:
        now = time.monotonic()
        due = None
        while held and (held[0][0] <= now):
            due = held.popleft()[1]
        if due is not None:
            accept_up_to(s, queue, due)
        timeout = max(0.0, held[0][0] - time.monotonic()) if held else 1.0
        try:
            ready, _, _ = select.select([s], [], [], timeout)
        except InterruptedError:
            continue
        if not ready:
            continue
        came = time.monotonic()
        while True:  # every packet waiting: one netlink datagram each
            try:
                data = s.recv(1 << 16, socket.MSG_DONTWAIT)
            except BlockingIOError:
                break
            for kind, payload in messages(data):
                if kind == (NFNL_SUBSYS_QUEUE << 8) | NFQNL_MSG_PACKET:
                    hdr = attrs_of(payload[4:]).get(NFQA_PACKET_HDR)  # after the nfgenmsg
                    if hdr is not None:
                        held.append((came + delay, struct.unpack_from(">I", hdr)[0]))
                        count += 1
    if held:
        accept_up_to(s, queue, held[-1][1])
    print(f"netdelay: {count} packets held {delay * 1000:.0f} ms", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--queue", type=int, required=True, help="the NFQUEUE number of the iptables rule")
    ap.add_argument("--delay", type=float, required=True, help="seconds each packet is held")
    a = ap.parse_args(argv)
    try:
        return run(a.queue, a.delay)
    except OSError as e:
        print(f"netdelay: {e} (run it as root, in the namespace, one program per queue)", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
