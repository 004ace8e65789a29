"""A stand-in for one EP rank process, for the supervisor's tests: no torch, no engine, no NATS.

Run as ``python ep_fake_rank.py <the supervisor's argv and rank flags>``. It answers
``/healthz`` on ``--http-port``, meets its peers at ``--ep-rendezvous`` (rank 0 listens, the
others connect: a star of TCP connections), and behaves as a rank of a real group does when a
peer dies: the connection closes, so it exits with ``EXIT_GROUP_FAILED`` (75). SIGTERM: exit 0.
It starts in ~50 ms, so a test can kill, restart and grow a group in a few seconds.
"""

from __future__ import annotations

import argparse
import http.server
import select
import signal
import socket
import sys
import threading
import time

EXIT_GROUP_FAILED = 75  # libs.serving.ep.EXIT_GROUP_FAILED (not imported: no repo on the path)


class _Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        self.send_response(200 if self.path == "/healthz" else 404)
        self.end_headers()

    def log_message(self, *args: object) -> None:
        pass


def _meet(rank: int, size: int, host: str, port: int) -> list[socket.socket]:
    if rank == 0:
        server = socket.socket()
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        server.bind((host, port))
        server.listen()
        server.settimeout(30)
        return [server.accept()[0] for _ in range(size - 1)]
    deadline = time.monotonic() + 30
    while True:
        try:
            return [socket.create_connection((host, port), timeout=1)]
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.05)


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--ep", type=int)
    p.add_argument("--ep-rank", type=int)
    p.add_argument("--ep-rendezvous")
    p.add_argument("--http-port", type=int)
    args, _ = p.parse_known_args()
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    ops = http.server.ThreadingHTTPServer(("127.0.0.1", args.http_port), _Health)
    threading.Thread(target=ops.serve_forever, daemon=True).start()
    host, _, port = args.ep_rendezvous.rpartition(":")
    peers = _meet(args.ep_rank, args.ep, host, int(port))
    while peers:  # a group of one has no peer to lose: it serves until SIGTERM
        readable, _, _ = select.select(peers, [], [])
        if any(not s.recv(1) for s in readable):
            return EXIT_GROUP_FAILED  # a peer's connection closed: the group failed
    signal.pause()
    return 0


if __name__ == "__main__":
    sys.exit(main())
