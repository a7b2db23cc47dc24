"""``--backend ucxx-core``: the C extension ``ucxx._ucxx`` without asyncio.

The benchmark loop posts tagged transfers and progresses the worker itself
until they complete: in ``polling`` mode by calling ``Worker.progress()``
in a loop, in ``blocking`` mode by draining it, arming it and sleeping on
its event fd. With ``--asyncio-wait`` the requests are awaited in an event
loop instead (the worker's progress coroutine drives them).

A listener delivers its connections through the event loop, so this
backend connects with worker addresses instead: the server listens on a
plain TCP socket (``--server-address``, ``--port``), whose port it reports
like any other backend; the client connects to it and both sides swap their
UCX worker addresses (length-prefixed), then close the socket and create
endpoints with ``Worker.ep_from_address``.
"""

from __future__ import annotations

import select
import socket
import struct
from argparse import Namespace
from time import perf_counter

from ucxx import _ucxx
from ucxx.benchmarks.backends.base import BaseClient, BaseServer
from ucxx.benchmarks.utils import (
    GilContention,
    check_echo,
    get_allocator,
    print_key_value,
    print_ucx_config,
    put_results,
    run_until_complete,
)

# Tags (as in RAPIDS ucxx): client -> server 1, server -> client 0,
# terminal acknowledgement 2.
TAG_TO_SERVER = 1
TAG_TO_CLIENT = 0
TAG_ACK = 2

_MAX_ADDRESS = 1 << 20  # sanity bound on a worker address from the wire


# -- rendezvous ---------------------------------------------------------------


def _recv_exactly(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        r = sock.recv_into(view[got:], n - got)
        if r == 0:
            raise ConnectionResetError("rendezvous: peer closed the connection")
        got += r
    return bytes(buf)


def _send_blob(sock: socket.socket, data: bytes) -> None:
    sock.sendall(struct.pack("!Q", len(data)) + data)


def _recv_blob(sock: socket.socket) -> bytes:
    (n,) = struct.unpack("!Q", _recv_exactly(sock, 8))
    if n > _MAX_ADDRESS:
        raise ValueError(f"rendezvous: worker address too large ({n} bytes)")
    return _recv_exactly(sock, n)


# -- worker and waiting -----------------------------------------------------------


def _create_worker(args: Namespace):
    ctx = _ucxx.Context({})
    kwargs = {"progress_mode": args.progress_mode}
    if args.spin_us is not None:
        kwargs["spin_us"] = args.spin_us
    worker = _ucxx.Worker(ctx, **kwargs)
    if args.enable_am:
        _register_am_allocators(args, worker)
    return ctx, worker


def _register_am_allocators(args: Namespace, worker) -> None:
    import numpy as np

    worker.register_am_allocator(
        _ucxx.MEMORY_TYPE_HOST, lambda n: np.empty(n, dtype=np.uint8)
    )
    if args.object_type == "cupy":
        import cupy as cp

        worker.register_am_allocator(
            _ucxx.MEMORY_TYPE_CUDA, lambda n: cp.empty(n, dtype=cp.uint8)
        )
    elif args.object_type == "rmm":
        import rmm

        worker.register_am_allocator(
            _ucxx.MEMORY_TYPE_CUDA, lambda n: rmm.DeviceBuffer(size=n)
        )


def _make_wait(worker, args: Namespace):
    """``wait(*requests)``: progress ``worker`` until all are done, then
    raise the first error among them."""
    progress = worker.progress

    if args.progress_mode == "polling":

        def wait(*requests):
            for r in requests:
                while not r.done():
                    progress()
            for r in requests:
                r.result()

        return wait

    efd = worker.efd
    arm = worker.arm

    def wait(*requests):
        for r in requests:
            while not r.done():
                # DRAIN, then ARM; sleep on the fd only if nothing is left.
                while progress():
                    pass
                if r.done():
                    break
                if arm():
                    # The timeout only bounds a lost wakeup; it never fires
                    # while traffic flows.
                    select.select([efd], [], [], 1.0)
        for r in requests:
            r.result()

    return wait


async def _await_all(*requests):
    for r in requests:
        await r


def _close(ep, wait) -> None:
    """Graceful close of ``ep``; an error of a peer that closed or exited
    first is not a benchmark failure."""
    try:
        wait(ep.close())
    except _ucxx.UCXError:
        ep.abort()


# -- server / client ----------------------------------------------------------


class UCXPyCoreServer(BaseServer):
    has_cuda_support = True

    def run(self):
        args = self.args
        ctx, worker = _create_worker(args)
        xp = get_allocator(
            args.object_type, args.rmm_init_pool_size, args.rmm_managed_memory
        )
        try:
            with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as ls:
                ls.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                ls.bind((args.server_address, args.port or 0))
                ls.listen(1)
                self.queue.put(ls.getsockname()[1])
                conn, _ = ls.accept()
            with conn:
                _send_blob(conn, worker.address)
                peer = _recv_blob(conn)
            ep = worker.ep_from_address(peer, error_handling=args.error_handling)

            if args.asyncio_wait:
                run_until_complete(self._transfer_async(ep, xp), args.event_loop)
            else:
                self._transfer(ep, xp, _make_wait(worker, args))
        finally:
            worker.close()
            ctx.close()

    def _transfer(self, ep, xp, wait):
        args = self.args
        # Wire-up: one untimed exchange establishes both connections.
        wire = _host(8)
        wait(ep.tag_recv(wire, TAG_TO_SERVER))
        wait(ep.tag_send(wire, TAG_TO_CLIENT))

        if args.reuse_alloc:
            recv_msg = xp.zeros(args.n_bytes, dtype="u1")
        for _ in range(args.n_iter + args.n_warmup_iter):
            if args.enable_am:
                req = ep.am_recv()
                wait(req)
                wait(ep.am_send(req.result()))
            else:
                if not args.reuse_alloc:
                    recv_msg = xp.zeros(args.n_bytes, dtype="u1")
                wait(ep.tag_recv(recv_msg, TAG_TO_SERVER))
                wait(ep.tag_send(recv_msg, TAG_TO_CLIENT))

        ack = _host(1)
        wait(ep.am_recv() if args.enable_am else ep.tag_recv(ack, TAG_ACK))
        _close(ep, wait)

    async def _transfer_async(self, ep, xp):
        args = self.args
        wire = _host(8)
        await ep.tag_recv(wire, TAG_TO_SERVER)
        await ep.tag_send(wire, TAG_TO_CLIENT)

        if args.reuse_alloc:
            recv_msg = xp.zeros(args.n_bytes, dtype="u1")
        for _ in range(args.n_iter + args.n_warmup_iter):
            if args.enable_am:
                msg = await ep.am_recv()
                await ep.am_send(msg)
            else:
                if not args.reuse_alloc:
                    recv_msg = xp.zeros(args.n_bytes, dtype="u1")
                await ep.tag_recv(recv_msg, TAG_TO_SERVER)
                await ep.tag_send(recv_msg, TAG_TO_CLIENT)

        ack = _host(1)
        await (ep.am_recv() if args.enable_am else ep.tag_recv(ack, TAG_ACK))
        try:
            await ep.close()
        except _ucxx.UCXError:
            ep.abort()


class UCXPyCoreClient(BaseClient):
    has_cuda_support = True

    def run(self):
        args = self.args
        ctx, worker = _create_worker(args)
        xp = get_allocator(
            args.object_type, args.rmm_init_pool_size, args.rmm_managed_memory
        )
        try:
            with socket.create_connection((self.server_address, self.port)) as conn:
                peer = _recv_blob(conn)
                _send_blob(conn, worker.address)
            ep = worker.ep_from_address(peer, error_handling=args.error_handling)
            send_msg = xp.arange(args.n_bytes, dtype="u1")

            if args.asyncio_wait:
                times, contention, last = run_until_complete(
                    self._transfer_async(ep, xp, send_msg), args.event_loop
                )
            else:
                times, contention, last = self._transfer(
                    ep, xp, send_msg, _make_wait(worker, args)
                )
        finally:
            worker.close()
            ctx.close()
        check_echo(last, send_msg)
        put_results(self.queue, args, times, contention)

    def _transfer(self, ep, xp, send_msg, wait):
        args = self.args
        wire = _host(8)
        wait(ep.tag_send(wire, TAG_TO_SERVER))
        wait(ep.tag_recv(wire, TAG_TO_CLIENT))

        if args.reuse_alloc:
            recv_msg = xp.zeros(args.n_bytes, dtype="u1")
        if args.cuda_profile:
            xp.cuda.profiler.start()
        gil = GilContention(args.report_gil_contention)
        gil.start()

        times = []
        last = None
        for i in range(args.n_iter + args.n_warmup_iter):
            start = perf_counter()
            if args.enable_am:
                wait(ep.am_send(send_msg))
                req = ep.am_recv()
                wait(req)
                last = req.result()
            else:
                if not args.reuse_alloc:
                    recv_msg = xp.zeros(args.n_bytes, dtype="u1")
                # Post the receive first: the echo may arrive before the
                # send request is seen complete.
                rreq = ep.tag_recv(recv_msg, TAG_TO_CLIENT)
                wait(ep.tag_send(send_msg, TAG_TO_SERVER), rreq)
                last = recv_msg
            stop = perf_counter()
            if i >= args.n_warmup_iter:
                times.append(stop - start)

        contention = gil.stop()
        if args.cuda_profile:
            xp.cuda.profiler.stop()

        ack = _host(1)
        wait(ep.am_send(ack) if args.enable_am else ep.tag_send(ack, TAG_ACK))
        _close(ep, wait)
        return times, contention, last

    async def _transfer_async(self, ep, xp, send_msg):
        args = self.args
        wire = _host(8)
        await ep.tag_send(wire, TAG_TO_SERVER)
        await ep.tag_recv(wire, TAG_TO_CLIENT)

        if args.reuse_alloc:
            recv_msg = xp.zeros(args.n_bytes, dtype="u1")
        if args.cuda_profile:
            xp.cuda.profiler.start()
        gil = GilContention(args.report_gil_contention)
        gil.start()

        times = []
        last = None
        for i in range(args.n_iter + args.n_warmup_iter):
            start = perf_counter()
            if args.enable_am:
                await ep.am_send(send_msg)
                last = await ep.am_recv()
            else:
                if not args.reuse_alloc:
                    recv_msg = xp.zeros(args.n_bytes, dtype="u1")
                rreq = ep.tag_recv(recv_msg, TAG_TO_CLIENT)
                await _await_all(ep.tag_send(send_msg, TAG_TO_SERVER), rreq)
                last = recv_msg
            stop = perf_counter()
            if i >= args.n_warmup_iter:
                times.append(stop - start)

        contention = gil.stop()
        if args.cuda_profile:
            xp.cuda.profiler.stop()

        ack = _host(1)
        await (ep.am_send(ack) if args.enable_am else ep.tag_send(ack, TAG_ACK))
        try:
            await ep.close()
        except _ucxx.UCXError:
            ep.abort()
        return times, contention, last

    def print_backend_specific_config(self):
        print_key_value(
            key="Transfer API", value=f"{'AM' if self.args.enable_am else 'TAG'}"
        )
        print_key_value(key="Progress mode", value=f"{self.args.progress_mode}")
        print_key_value(key="Asyncio wait", value=f"{self.args.asyncio_wait}")
        print_key_value(key="Delay progress", value="False")
        print_ucx_config()


def _host(n: int):
    import numpy as np

    return np.zeros(n, dtype="u1")
