"""Leaks over long runs: RSS, file descriptors, reference counts.

In one process over loopback (a listener and an endpoint to it, handshake
included, or a worker-address endpoint to the process's own worker for
shared memory):

- one million 1-byte round trips and ten thousand 1 MiB round trips
  (``@pytest.mark.slow``; the default run does 50,000 and 1,000): RSS grows
  by less than ``RSS_BUDGET`` after a warm-up, fds and the count of live
  Request objects stay flat;
- the reference counts of buffers, callbacks and endpoints return to their
  starting values after every kind of transfer;
- 1,000 listener/endpoint create-connect-close cycles (100 by default) leave
  the fd count where it started.

Figures (RSS growth, rates, fd counts) are printed with ``-s``; the budgets
are in docs/RELIABILITY.md ("Leaks").
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
import threading
import time
import weakref

import numpy as np
import pytest

import ucxx
import ucxx.core
from ucxx import _ucxx as U

pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

HOST = "127.0.0.1"
MiB = 1 << 20
RSS_BUDGET = 2 * MiB
TRANSPORTS = {
    "tcp": {"TLS": "tcp"},
    "shm": {"TLS": "posix,sysv,cma,tcp", "MM_ERROR_HANDLING": "y"},
}
UNDER_ASAN = "asan" in os.environ.get("LD_PRELOAD", "")


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def live_requests() -> int:
    return sum(1 for o in gc.get_objects() if type(o) is U.Request)


class Loopback:
    """This process talking to itself: ``a`` sends, ``b`` echoes."""

    async def open(self, transport: str):
        ucxx.init(options=TRANSPORTS[transport])
        self.lst = None
        if transport == "tcp":
            accepted: asyncio.Queue = asyncio.Queue()
            self.lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
            self.a = await ucxx.create_endpoint(HOST, self.lst.port)
            self.b = await asyncio.wait_for(accepted.get(), 30)
        else:
            # shared memory needs a worker-address endpoint (sockaddr
            # connections carry their data over tcp): one to ourselves.
            self.a = self.b = await ucxx.create_endpoint_from_worker_address(
                ucxx.get_worker_address())
        return self

    async def close(self):
        if self.lst is not None:
            await self.a.close()
            await self.b.close()
            self.lst.close()
        else:
            self.a.abort()
        self.a = self.b = self.lst = None
        gc.collect()
        ucxx.reset()


async def _echo(ep, buf, n_tag, out_tag):
    while True:
        await ep.recv(buf, tag=n_tag)
        await ep.send(buf, tag=out_tag)


class Traffic:
    """Round trips of ``size`` bytes over ``lb``; buffers and the echo task
    are created once, so that a measurement sees only what transfers cost."""

    def __init__(self, lb: Loopback, size: int):
        self.a = lb.a
        self.sbuf = np.full(size, 7, np.uint8)
        self.rbuf = np.empty(size, np.uint8)
        self.ebuf = np.empty(size, np.uint8)
        self.echo = asyncio.ensure_future(_echo(lb.b, self.ebuf, 1, 2))

    async def run(self, n: int, samples: list | None = None, every: int = 0):
        a, sbuf, rbuf = self.a, self.sbuf, self.rbuf
        for i in range(n):
            r = a.recv(rbuf, tag=2)
            await a.send(sbuf, tag=1)
            await r
            if every and i % every == every - 1:
                samples.append(rss())
        assert rbuf[0] == 7 and rbuf[-1] == 7

    async def stop(self):
        self.echo.cancel()
        await asyncio.gather(self.echo, return_exceptions=True)


SMALL_N = {"default": 50_000, "slow": 1_000_000}
LARGE_N = {"default": 1_000, "slow": 10_000}


async def _rss_run(transport, n, size, warmup):
    lb = await Loopback().open(transport)
    traffic = Traffic(lb, size)
    try:
        await traffic.run(warmup)
        gc.collect()
        fds0, rss0, req0 = fd_count(), rss(), live_requests()
        refs0 = [sys.getrefcount(b) for b in (traffic.sbuf, traffic.rbuf, traffic.ebuf)]
        samples = [rss0]
        t0 = time.monotonic()
        await traffic.run(n, samples, every=max(1, n // 10))
        dt = time.monotonic() - t0
        gc.collect()
        grown = rss() - rss0
        print(f"\n{transport}: {n} round trips of {size} B in {dt:.1f} s "
              f"({dt / n * 1e6:.1f} us each); RSS after warm-up {rss0 / MiB:.1f} MiB, "
              f"growth {grown / 1024:+.0f} KiB (samples, KiB: "
              f"{[round((s - rss0) / 1024) for s in samples]}); fds {fds0} -> {fd_count()}; "
              f"live requests {req0} -> {live_requests()}")
        assert fd_count() == fds0
        assert live_requests() == req0
        assert [sys.getrefcount(b) for b in (traffic.sbuf, traffic.rbuf, traffic.ebuf)] == refs0
        if not UNDER_ASAN:
            assert grown < RSS_BUDGET, f"RSS grew by {grown / MiB:.2f} MiB"
    finally:
        await traffic.stop()
        await lb.close()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tl", list(TRANSPORTS))
async def test_small_roundtrips_rss_flat(tl):
    await _rss_run(tl, SMALL_N["default"], 1, warmup=20_000)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tl", list(TRANSPORTS))
async def test_million_small_roundtrips_rss_flat(tl):
    await _rss_run(tl, SMALL_N["slow"], 1, warmup=50_000)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("tl", list(TRANSPORTS))
async def test_large_roundtrips_rss_flat(tl):
    await _rss_run(tl, LARGE_N["default"], MiB, warmup=300)


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("tl", list(TRANSPORTS))
async def test_ten_thousand_large_roundtrips_rss_flat(tl):
    await _rss_run(tl, LARGE_N["slow"], MiB, warmup=500)


# ---------------------------------------------------------------- refcounts
@pytest.mark.timeout(120)
async def test_refcounts_return_to_start():
    """After 200 rounds of every kind of transfer (tagged, send_obj/recv_obj,
    send_multi/recv_multi, gather, active messages, a cancelled receive, a
    failed truncated receive), the buffers, callbacks, endpoints and the
    worker have their starting reference counts and no Request is alive."""
    lb = await Loopback().open("tcp")
    try:
        a, b = lb.a, lb.b
        w = ucxx.core._get_ctx().worker
        bufs = [bytearray(64), np.zeros(64, np.uint8), bytearray(1 << 16),
                memoryview(bytearray(64))]
        payload = bytes(range(64))

        def on_close():
            pass

        def alloc(n):
            return bytearray(n)

        rc_cb0, rc_alloc0 = sys.getrefcount(on_close), sys.getrefcount(alloc)
        a.set_close_callback(on_close)
        w.register_am_allocator(U.MEMORY_TYPE_HOST, alloc)

        async def one_round():
            r = b.recv(bufs[0])
            await a.send(payload)
            await r
            r = b.recv(bufs[1], tag=5)
            await a.send(bufs[3], tag=5)
            await r
            r = asyncio.ensure_future(b.recv_obj())
            await a.send_obj(bufs[2])
            await r
            r = asyncio.ensure_future(b.recv_multi())
            await a.send_multi([bufs[0], bufs[1], b""])
            await r
            r = b.gather_recv([bufs[0], bufs[2]], tag=6)
            await a.gather_send([payload, bufs[2]], tag=6)
            await r
            r = b.am_recv()
            await a.am_send(bufs[1])
            await r
            r = b.recv(bufs[0], tag=7)  # cancelled
            r.cancel()
            with pytest.raises(ucxx.UCXCanceledError):
                await r
            r = b.recv(bytearray(1), tag=8)  # truncated
            await a.send(b"xx", tag=8)
            with pytest.raises(ucxx.UCXMessageTruncatedError):
                await r
            del r

        for _ in range(20):
            await one_round()
        gc.collect()
        objs = [*bufs, a, b, a._ep, b._ep, w, on_close, alloc]
        before = [sys.getrefcount(o) for o in objs]
        req0 = live_requests()
        for _ in range(200):
            await one_round()
        gc.collect()
        after = [sys.getrefcount(o) for o in objs]
        names = ["bytearray", "ndarray", "bytearray-64K", "memoryview", "ep", "sep",
                 "ep._ep", "sep._ep", "worker", "close callback", "am allocator"]
        diff = {n: (x, y) for n, x, y in zip(names, before, after) if x != y}
        assert diff == {}, f"refcounts changed (before, after): {diff}"
        assert live_requests() == req0
        # Unregistered, the callbacks are back to the references this test holds.
        w.register_am_allocator(U.MEMORY_TYPE_HOST, bytearray)
        a.set_close_callback(None)
        del objs
        assert sys.getrefcount(on_close) == rc_cb0
        assert sys.getrefcount(alloc) == rc_alloc0
    finally:
        await lb.close()


@pytest.mark.timeout(120)
async def test_closed_endpoints_and_listeners_are_released():
    """Endpoints and listeners, once closed and dropped, are freed (weak
    references die), with the callbacks they held."""
    ucxx.init(options=TRANSPORTS["tcp"])
    try:
        refs = []
        accepted: asyncio.Queue = asyncio.Queue()
        for _ in range(20):
            def on_conn(ep):
                accepted.put_nowait(ep)

            lst = ucxx.create_listener(on_conn, host=HOST)
            ep = await ucxx.create_endpoint(HOST, lst.port)
            sep = await asyncio.wait_for(accepted.get(), 30)

            def cb():
                pass

            ep.set_close_callback(cb)
            await ep.close()
            await sep.close()
            lst.close()
            refs += [weakref.ref(o) for o in (ep, sep, lst, ep._ep, sep._ep, cb, on_conn)]
            del ep, sep, lst, cb, on_conn
        for _ in range(50):
            gc.collect()
            if all(r() is None for r in refs):
                break
            await asyncio.sleep(0.02)
        alive = [r() for r in refs if r() is not None]
        assert alive == [], f"{len(alive)} objects still alive: {alive[:5]}"
    finally:
        ucxx.reset()


# ----------------------------------------------------- create/close cycles
async def _settled_fds(target: int, timeout: float = 2.0) -> int:
    """The fd count once closing sockets are gone (UCX closes some of a
    connection's sockets on the next progress after the close)."""
    deadline = time.monotonic() + timeout
    while True:
        gc.collect()
        n = fd_count()
        if n <= target or time.monotonic() > deadline:
            return n
        await asyncio.sleep(0.01)
CYCLES = {"default": 100, "slow": 1000}


async def _create_close_cycles(n: int):
    ucxx.init(options=TRANSPORTS["tcp"])
    try:
        accepted: asyncio.Queue = asyncio.Queue()

        async def cycle():
            lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
            ep = await ucxx.create_endpoint(HOST, lst.port)
            sep = await asyncio.wait_for(accepted.get(), 30)
            r = sep.recv(bytearray(4))
            await ep.send(b"ping")
            await r
            await ep.close()
            await sep.close()
            lst.close()

        for _ in range(10):
            await cycle()
        gc.collect()
        fds0, threads0, rss0 = fd_count(), threading.active_count(), rss()
        counts = []
        t0 = time.monotonic()
        for i in range(n):
            await cycle()
            if i % (n // 10) == n // 10 - 1:
                counts.append(await _settled_fds(fds0))
        dt = time.monotonic() - t0
        await asyncio.sleep(0.05)
        gc.collect()
        print(f"\n{n} listener/endpoint create-connect-close cycles in {dt:.1f} s "
              f"({dt / n * 1e3:.1f} ms each): fds {fds0} -> {counts} -> {fd_count()}, "
              f"RSS {(rss() - rss0) / 1024:+.0f} KiB")
        assert max(counts) <= fds0, f"fds grew: {fds0} -> {counts}"
        assert threading.active_count() <= threads0
        assert ucxx.core._get_ctx().live_objects() == []
    finally:
        ucxx.reset()


@pytest.mark.timeout(300)
async def test_create_close_cycles_fds_flat():
    await _create_close_cycles(CYCLES["default"])


@pytest.mark.slow
@pytest.mark.timeout(600)
async def test_thousand_create_close_cycles_fds_flat():
    await _create_close_cycles(CYCLES["slow"])


# ------------------------------------------------ keepalive over shared memory
@pytest.mark.timeout(120)
async def test_idle_shm_endpoint_with_error_handling_rss_flat():
    """An idle shared-memory endpoint with error handling: UCX's keepalive
    message goes through the receiver's FIFO, whose 256 slots each come
    with a receive buffer in shared memory; RSS grows while the messages
    first touch those buffers (about 1 MiB), then stays flat. Keepalive
    every 10 ms: the first 4 s touch every slot, the next 4 s must not grow
    RSS."""
    ucxx.init(options={**TRANSPORTS["shm"], "KEEPALIVE_INTERVAL": "10ms"})
    try:
        ep = await ucxx.create_endpoint_from_worker_address(ucxx.get_worker_address())
        rss_start = rss()
        await asyncio.sleep(4.0)
        gc.collect()
        rss0 = rss()
        await asyncio.sleep(4.0)
        grown = rss() - rss0
        ep.abort()
        print(f"\nidle shm endpoint, keepalive 10 ms: RSS {(rss0 - rss_start) / 1024:+.0f} KiB "
              f"in the first 4 s, then {grown / 1024:+.0f} KiB in 4 s")
        assert grown < 64 * 1024, f"RSS grew by {grown / 1024:.0f} KiB in 4 s while idle"
    finally:
        ucxx.reset()
