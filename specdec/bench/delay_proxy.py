"""A TCP relay that holds every byte for a fixed delay in each direction: the fallback for a network
delay where the kernel has no netem qdisc.

    python -m specdec.bench.delay_proxy --control DELAY_FILE --ready-file READY \\
        --route 127.0.0.1:0=127.0.0.1:50052 [--route unix:/tmp/x.sock=127.0.0.1:50051 ...]

Each route listens (TCP on a loopback port, or a unix socket) and relays every connection to its
upstream. Bytes read at time t are written at t + delay, in order, in both directions, so a request/
response round trip gains 2 x delay, as with netem on both ends of a link. The delay (milliseconds)
is read from the control file, re-read every 100 ms, so one relay serves several delay levels.
A relay is a process of its own: its threads never compete with the benchmark's for the GIL.
Sleeping is precise to roughly 0.1 ms on Linux; the benchmark measures the delay actually added.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import socket
import sys
import threading
import time
from pathlib import Path

_delay_s = 0.0


def _watch(control: Path) -> None:
    global _delay_s
    while True:
        try:
            _delay_s = max(0.0, float(control.read_text().strip() or 0)) / 1000.0
        except (OSError, ValueError):
            pass
        time.sleep(0.1)


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """src -> dst, every chunk released `delay` after it was read."""
    queue: collections.deque = collections.deque()
    ready = threading.Condition()
    closed = []

    def writer() -> None:
        try:
            while True:
                with ready:
                    while not queue and not closed:
                        ready.wait()
                    if not queue:
                        return
                    due, data = queue.popleft()
                wait = due - time.perf_counter()
                if wait > 0:
                    time.sleep(wait)
                dst.sendall(data)
        except OSError:
            pass
        finally:
            _close(dst, src)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        while data := src.recv(1 << 16):
            with ready:
                queue.append((time.perf_counter() + _delay_s, data))
                ready.notify()
    except OSError:
        pass
    with ready:
        closed.append(True)
        ready.notify()


def _close(*socks: socket.socket) -> None:
    for sock in socks:
        try:
            sock.shutdown(socket.SHUT_RDWR)
        except OSError:
            pass


def _connect(upstream: str) -> socket.socket:
    host, _, port = upstream.rpartition(":")
    sock = socket.create_connection((host, int(port)))
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def _serve(listener: socket.socket, upstream: str) -> None:
    while True:
        client, _ = listener.accept()
        if client.family != socket.AF_UNIX:
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            server = _connect(upstream)
        except OSError:
            client.close()
            continue
        for a, b in ((client, server), (server, client)):
            threading.Thread(target=_pump, args=(a, b), daemon=True).start()


def _listen(spec: str) -> tuple[socket.socket, str]:
    if spec.startswith("unix:"):
        path = spec[len("unix:"):]
        if os.path.exists(path):
            os.unlink(path)
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        sock.listen(64)
        return sock, spec
    host, _, port = spec.rpartition(":")
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, int(port)))
    sock.listen(64)
    return sock, f"{host}:{sock.getsockname()[1]}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m specdec.bench.delay_proxy", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--route", action="append", required=True, metavar="LISTEN=UPSTREAM")
    parser.add_argument("--control", type=Path, required=True, help="file holding the delay in ms")
    parser.add_argument("--ready-file", type=Path, required=True)
    args = parser.parse_args(argv)
    threading.Thread(target=_watch, args=(args.control,), daemon=True).start()
    bound = []
    for route in args.route:
        listen, _, upstream = route.partition("=")
        listener, address = _listen(listen)
        bound.append(address)
        threading.Thread(target=_serve, args=(listener, upstream), daemon=True).start()
    tmp = args.ready_file.with_name(args.ready_file.name + ".tmp")
    tmp.write_text(json.dumps({"pid": os.getpid(), "listen": bound}))
    tmp.replace(args.ready_file)
    threading.Event().wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
