"""``--backend ucxx-async``: the public asyncio API of ucxx."""

from __future__ import annotations

import asyncio
import sys
from argparse import Namespace
from time import perf_counter

import ucxx
from ucxx.benchmarks.backends.base import BaseClient, BaseServer
from ucxx.benchmarks.utils import (
    GilContention,
    check_echo,
    get_allocator,
    print_key_value,
    print_ucx_config,
    put_results,
)


def init_ucxx(args: Namespace) -> None:
    """``ucxx.init`` with the progress mode and spin budget of the options
    (``spin_us`` is passed only when ``--spin-us`` was given, so that the
    package default applies otherwise)."""
    kwargs = {"progress_mode": args.progress_mode}
    if args.spin_us is not None:
        kwargs["spin_us"] = args.spin_us
    ucxx.init(**kwargs)


def teardown_ucxx() -> None:
    """Release the global context (best effort: the process exits next)."""
    try:
        ucxx.reset()
    except Exception as e:  # reported, not fatal: the results are in
        print(f"ucxx-async: ucxx.reset() failed: {e!r}", file=sys.stderr)


def register_am_allocators(args: Namespace) -> None:
    """With ``--enable-am``, make ``am_recv`` allocate the object type of
    the benchmark (host: numpy; cupy/rmm: device memory)."""
    if not args.enable_am:
        return
    if args.object_type == "numpy":
        import numpy as np

        ucxx.register_am_allocator(lambda n: np.empty(n, dtype=np.uint8), "host")
    elif args.object_type == "cupy":
        import cupy as cp

        ucxx.register_am_allocator(lambda n: cp.empty(n, dtype=cp.uint8), "cuda")
    else:
        import rmm

        ucxx.register_am_allocator(lambda n: rmm.DeviceBuffer(size=n), "cuda")


# How long the client waits for the server to close the connection.
PEER_CLOSE_TIMEOUT = 10.0


def _close_future(ep):
    """A future resolved when ``ep`` closes."""
    fut = asyncio.get_running_loop().create_future()

    def on_close(*_args):
        if not fut.done():
            fut.set_result(None)

    ep.set_close_callback(on_close)
    return fut


async def _send_terminal_ack(ep, enable_am: bool) -> None:
    """Tell the server that the last echo arrived (it may close now)."""
    ack = bytearray(1)
    if enable_am:
        await ep.am_send(ack)
    else:
        await ep.send(ack)


async def _recv_terminal_ack(ep, enable_am: bool) -> None:
    if enable_am:
        ack = await ep.am_recv()
        n = memoryview(ack).nbytes if not hasattr(ack, "nbytes") else ack.nbytes
    else:
        ack = bytearray(1)
        await ep.recv(ack)
        n = len(ack)
    if n != 1:
        raise RuntimeError("Invalid benchmark terminal acknowledgement")


class UCXPyAsyncServer(BaseServer):
    has_cuda_support = True

    async def run(self):
        args = self.args
        init_ucxx(args)
        xp = get_allocator(
            args.object_type, args.rmm_init_pool_size, args.rmm_managed_memory
        )
        register_am_allocators(args)
        done = asyncio.get_running_loop().create_future()

        async def server_handler(ep):
            try:
                if args.reuse_alloc and args.n_buffers == 1:
                    reuse_msg = xp.zeros(args.n_bytes, dtype="u1")
                for _ in range(args.n_iter + args.n_warmup_iter):
                    if args.enable_am:
                        recv = await ep.am_recv()
                        await ep.am_send(recv)
                    elif args.n_buffers == 1:
                        msg = (
                            reuse_msg
                            if args.reuse_alloc
                            else xp.zeros(args.n_bytes, dtype="u1")
                        )
                        await ep.recv(msg)
                        await ep.send(msg)
                    else:
                        msgs = await ep.recv_multi()
                        await ep.send_multi(msgs)
                await _recv_terminal_ack(ep, args.enable_am)
                await ep.close()
            except Exception as e:
                if not done.done():
                    done.set_exception(e)
            else:
                if not done.done():
                    done.set_result(None)

        # Listen where the client is told to connect (RAPIDS: all
        # interfaces; -s names the one that is used either way).
        lf = ucxx.create_listener(
            server_handler,
            port=args.port,
            endpoint_error_handling=args.error_handling,
            host=args.server_address,
        )
        self.queue.put(lf.port)
        try:
            await done
        finally:
            lf.close()
            del lf
            teardown_ucxx()


class UCXPyAsyncClient(BaseClient):
    has_cuda_support = True

    async def run(self):
        args = self.args
        init_ucxx(args)
        xp = get_allocator(
            args.object_type, args.rmm_init_pool_size, args.rmm_managed_memory
        )
        register_am_allocators(args)

        ep = await ucxx.create_endpoint(
            self.server_address,
            self.port,
            endpoint_error_handling=args.error_handling,
        )

        am_msg = xp.arange(args.n_bytes, dtype="u1")
        if args.reuse_alloc:
            reuse_msg_send = xp.arange(args.n_bytes, dtype="u1")
            if args.n_buffers == 1:
                reuse_msg_recv = xp.zeros(args.n_bytes, dtype="u1")
            else:
                reuse_msg_send = [reuse_msg_send] * args.n_buffers

        if args.cuda_profile:
            xp.cuda.profiler.start()
        gil = GilContention(args.report_gil_contention)
        gil.start()

        times = []
        msg_recv = None
        for i in range(args.n_iter + args.n_warmup_iter):
            start = perf_counter()
            if args.enable_am:
                msg_send = am_msg
                await ep.am_send(msg_send)
                msg_recv = await ep.am_recv()
            elif args.n_buffers == 1:
                if args.reuse_alloc:
                    msg_send = reuse_msg_send
                    msg_recv = reuse_msg_recv
                else:
                    msg_send = xp.arange(args.n_bytes, dtype="u1")
                    msg_recv = xp.zeros(args.n_bytes, dtype="u1")
                await ep.send(msg_send)
                await ep.recv(msg_recv)
            else:
                if args.reuse_alloc:
                    msg_send = reuse_msg_send
                else:
                    msg_send = [
                        xp.arange(args.n_bytes, dtype="u1")
                        for _ in range(args.n_buffers)
                    ]
                await ep.send_multi(msg_send)
                msg_recv = await ep.recv_multi()
            stop = perf_counter()
            if i >= args.n_warmup_iter:
                times.append(stop - start)

        contention = gil.stop()
        if args.cuda_profile:
            xp.cuda.profiler.stop()

        # The server closes the endpoint once it has the acknowledgement;
        # wait for that instead of closing both ends at once.
        peer_closed = _close_future(ep)
        await _send_terminal_ack(ep, args.enable_am)
        sent = msg_send[0] if isinstance(msg_send, list) else msg_send
        check_echo(msg_recv, sent, 1 if args.enable_am else args.n_buffers)
        try:
            await asyncio.wait_for(peer_closed, PEER_CLOSE_TIMEOUT)
        except asyncio.TimeoutError:
            pass
        await ep.close()
        del ep
        teardown_ucxx()
        put_results(self.queue, args, times, contention)

    def print_backend_specific_config(self):
        print_key_value(
            key="Transfer API", value=f"{'AM' if self.args.enable_am else 'TAG'}"
        )
        print_key_value(key="Progress mode", value=f"{self.args.progress_mode}")
        print_ucx_config()
