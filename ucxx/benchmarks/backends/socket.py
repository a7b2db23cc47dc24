"""``--backend socket``: blocking TCP sockets (a baseline without asyncio)."""

from __future__ import annotations

import socket
from time import perf_counter

import numpy as np

from ucxx.benchmarks.backends.base import BaseClient, BaseServer
from ucxx.benchmarks.utils import GilContention, put_results


def _recv_exactly(sock: socket.socket, view: memoryview) -> None:
    """Fill ``view`` completely from ``sock``."""
    n = len(view)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionResetError(
                f"peer closed the connection after {got} of {n} bytes"
            )
        got += r


def _tune(sock: socket.socket) -> None:
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)


class SocketServer(BaseServer):
    has_cuda_support = False

    def run(self):
        args = self.args
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as server:
            server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            server.bind((args.server_address, args.port or 0))
            server.listen(1)
            self.queue.put(server.getsockname()[1])
            conn, _ = server.accept()

        with conn:
            _tune(conn)
            if args.reuse_alloc:
                recv_msg = np.zeros(args.n_bytes, dtype="u1")
            for _ in range(args.n_iter + args.n_warmup_iter):
                if not args.reuse_alloc:
                    recv_msg = np.zeros(args.n_bytes, dtype="u1")
                view = memoryview(recv_msg).cast("B")
                _recv_exactly(conn, view)
                conn.sendall(view)
            # Wait for the client to close first (EOF), so that the last
            # echo is never cut by a reset.
            conn.recv(1)


class SocketClient(BaseClient):
    has_cuda_support = False

    def run(self):
        args = self.args
        send_msg = np.arange(args.n_bytes, dtype="u1")
        send_view = memoryview(send_msg).cast("B")
        if args.reuse_alloc:
            recv_msg = np.zeros(args.n_bytes, dtype="u1")

        with socket.create_connection((self.server_address, self.port)) as sock:
            _tune(sock)
            gil = GilContention(args.report_gil_contention)
            gil.start()
            times = []
            for i in range(args.n_iter + args.n_warmup_iter):
                start = perf_counter()
                if not args.reuse_alloc:
                    recv_msg = np.zeros(args.n_bytes, dtype="u1")
                sock.sendall(send_view)
                _recv_exactly(sock, memoryview(recv_msg).cast("B"))
                stop = perf_counter()
                if i >= args.n_warmup_iter:
                    times.append(stop - start)
            contention = gil.stop()

        if not np.array_equal(recv_msg, send_msg):
            raise RuntimeError("socket backend: the echoed message differs")
        put_results(self.queue, args, times, contention)
