"""Object lifecycles in ucxx._ucxx: create/close cycles leak nothing,
buffers are released exactly once, unclosed objects warn, close() is
idempotent, use after close raises, closing a worker with work pending,
event loops that go away first, and requests dropped while pending."""

import asyncio
import gc
import os
import sys
import weakref

import numpy as np
import pytest

from _util import THRESH, Local, MiB, finalizer_report, options, pattern
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

UCS_ERR_CANCELED = -16


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def under_sanitizer() -> bool:
    return "asan" in os.environ.get("LD_PRELOAD", "")


# ------------------------------------------------------------------ cycles
@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tl,cycles", [("tcp", 1000), ("shm", 300)], ids=["tcp", "shm"])
def test_create_close_cycles_leave_fds_and_rss_flat(tl, cycles):
    opts = options(tl)

    def cycle():
        ctx = U.Context(opts)
        w = U.Worker(ctx)
        w.close()
        ctx.close()

    for _ in range(50):  # warm-up: UCX and the allocator settle
        cycle()
    gc.collect()
    fds0, rss0, objs0 = fd_count(), rss(), len(gc.get_objects())
    for i in range(cycles):
        cycle()
        if i % 100 == 99:
            gc.collect()
            assert fd_count() == fds0, f"fds grew after {i + 1} cycles"
    gc.collect()
    grown = rss() - rss0
    assert fd_count() == fds0
    assert len(gc.get_objects()) - objs0 < 100, "Python objects accumulate"
    if not under_sanitizer():
        assert grown < 4 * MiB, f"RSS grew by {grown / MiB:.1f} MiB over {cycles} cycles"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_started_worker_cycles_leave_fds_flat(mode):
    """Workers attached to the running loop, with an endpoint and a
    transfer, then closed: no fd, reader or task is left behind."""
    loop = asyncio.get_running_loop()
    ctx = U.Context(options("tcp"))
    try:
        async def cycle():
            w = U.Worker(ctx, mode)
            task = w.start(loop)
            ep = w.ep_from_address(w.address)
            out = bytearray(THRESH + 1)
            await asyncio.gather(ep.tag_send(pattern(THRESH + 1), 1), w.tag_recv(out, 1))
            assert out == pattern(THRESH + 1)
            efd = w.efd
            await ep.close()
            w.close()
            await asyncio.sleep(0)
            assert task.done()
            assert not loop.remove_reader(efd)

        for _ in range(10):
            await cycle()
        gc.collect()
        fds0 = fd_count()
        tasks0 = len(asyncio.all_tasks(loop))
        for _ in range(50):
            await cycle()
        gc.collect()
        assert fd_count() == fds0
        assert len(asyncio.all_tasks(loop)) == tasks0
    finally:
        ctx.close()


# ------------------------------------------------------------------ refcounts
@pytest.fixture
async def loc():
    loc = Local("tcp")
    loc.w.start(asyncio.get_running_loop())
    try:
        yield loc
    finally:
        loc.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [10, THRESH + 1, 4 * MiB], ids=["eager", "rndv", "4MiB"])
async def test_refcounts_send_recv(loc, size):
    w, ep = loc.w, loc.ep
    src, dst = bytearray(pattern(size)), np.zeros(size, np.uint8)
    rs, rd = sys.getrefcount(src), sys.getrefcount(dst)
    r = w.tag_recv(dst, 1)
    assert sys.getrefcount(dst) > rd, "a pending receive must hold its buffer"
    s = ep.tag_send(src, 1)
    await asyncio.gather(s, r)
    # completed requests (still referenced here) have released the buffers
    assert sys.getrefcount(src) == rs
    assert sys.getrefcount(dst) == rd
    rr, rsq = sys.getrefcount(r), sys.getrefcount(s)
    del r, s
    gc.collect()
    assert sys.getrefcount(src) == rs and sys.getrefcount(dst) == rd
    assert rr == rsq  # neither request holds itself once done


@pytest.mark.timeout(30)
async def test_refcounts_gather(loc):
    w, ep = loc.w, loc.ep
    frames = [bytearray(pattern(n)) for n in (0, 1, THRESH - 1, THRESH + 1, MiB)]
    outs = [bytearray(len(f)) for f in frames]
    before = [sys.getrefcount(b) for b in frames + outs]
    await asyncio.gather(ep.gather_send(frames, 3), ep.gather_recv(outs, 3))
    assert outs == frames
    assert [sys.getrefcount(b) for b in frames + outs] == before


@pytest.mark.timeout(30)
async def test_refcounts_cancelled_recv(loc):
    w, ep = loc.w, loc.ep
    buf = bytearray(THRESH + 1)
    rc0 = sys.getrefcount(buf)
    r = ep.tag_recv(buf, 4)
    r2 = w.tag_recv(buf, 5)
    assert sys.getrefcount(buf) == rc0 + 2
    assert r.cancel() and r2.cancel()
    for req in (r, r2):
        with pytest.raises(U.UCXCanceledError):
            await req
    assert sys.getrefcount(buf) == rc0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [10, THRESH + 1, 4 * MiB], ids=["eager", "rndv", "4MiB"])
async def test_refcounts_send_dropped_before_completion(loc, size):
    w, ep = loc.w, loc.ep
    src = bytearray(pattern(size))
    rc0 = sys.getrefcount(src)
    ep.tag_send(src, 6)  # the Request object is dropped at once
    gc.collect()
    out = bytearray(size)
    assert await asyncio.wait_for(w.tag_recv(out, 6), 10) == size
    assert out == src
    for _ in range(100):
        if sys.getrefcount(src) == rc0:
            break
        await asyncio.sleep(0.001)
    assert sys.getrefcount(src) == rc0


@pytest.mark.timeout(30)
async def test_refcounts_am(loc):
    ep = loc.ep
    src = bytearray(pattern(THRESH * 4))
    rc0 = sys.getrefcount(src)
    await ep.am_send(src)
    got = await asyncio.wait_for(ep.am_recv(), 10)
    assert got == src
    assert sys.getrefcount(src) == rc0


# ------------------------------------------------------------------ pending requests dropped
class Tracked(bytearray):
    """A buffer that records its content when it is finalised."""

    seen: list = []

    def __del__(self):
        Tracked.seen.append(bytes(self))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [100, THRESH + 1, 2 * MiB], ids=["eager", "rndv", "2MiB"])
async def test_dropped_pending_recv_keeps_buffer_alive(loc, size):
    w, ep = loc.w, loc.ep
    Tracked.seen = []
    buf = Tracked(size)
    ref = weakref.ref(buf)
    w.tag_recv(buf, 7)  # Request dropped while pending
    del buf
    gc.collect()
    assert ref() is not None, "the pending receive's buffer was freed"
    assert w.npending == 1
    data = pattern(size, 1)
    await ep.tag_send(data, 7)
    for _ in range(1000):
        if ref() is None:
            break
        await asyncio.sleep(0.001)
    gc.collect()
    assert ref() is None, "the buffer outlived its completed receive"
    assert Tracked.seen == [data], "the receive did not land in the buffer it held"
    assert w.npending == 0


@pytest.mark.timeout(30)
async def test_dropped_pending_send_keeps_buffer_alive(loc):
    w, ep = loc.w, loc.ep
    Tracked.seen = []
    data = pattern(2 * MiB, 2)
    buf = Tracked(data)
    ref = weakref.ref(buf)
    ep.tag_send(buf, 8)  # rendezvous: pending until the receiver comes
    del buf
    gc.collect()
    assert ref() is not None
    out = bytearray(len(data))
    await w.tag_recv(out, 8)
    assert out == data
    for _ in range(1000):
        if ref() is None:
            break
        await asyncio.sleep(0.001)
    assert ref() is None
    assert Tracked.seen == [data]


# ------------------------------------------------------------------ ResourceWarning
# A finalizer's warning never reaches the test as an exception (an "error"
# filter sends it to sys.unraisablehook, which pytest only reports), so
# these tests record warnings and unraisable exceptions and assert on them.
@pytest.mark.timeout(30)
def test_unclosed_worker_warns():
    ctx = U.Context(options("tcp"))
    try:
        w = U.Worker(ctx)
        ref = weakref.ref(w)
        with finalizer_report() as rep:
            del w
            gc.collect()
        assert ref() is None
        assert rep.resource_warnings("unclosed <ucxx.Worker"), rep.describe()
        assert not rep.unraisable, rep.describe()
    finally:
        ctx.close()  # the collected worker was closed: the context can go


@pytest.mark.timeout(30)
def test_unclosed_endpoint_warns():
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    try:
        ep = w.ep_from_address(w.address)
        ref = weakref.ref(ep)
        with finalizer_report() as rep:
            del ep
            gc.collect()
        assert ref() is None
        assert rep.resource_warnings("unclosed <ucxx.Endpoint"), rep.describe()
        assert not rep.unraisable, rep.describe()
    finally:
        w.close()
        ctx.close()


@pytest.mark.timeout(30)
def test_unclosed_context_warns():
    ctx = U.Context(options("tcp"))
    ref = weakref.ref(ctx)
    with finalizer_report() as rep:
        del ctx
        gc.collect()
    assert ref() is None
    assert rep.resource_warnings("unclosed <ucxx._ucxx.Context"), rep.describe()
    assert not rep.unraisable, rep.describe()


@pytest.mark.timeout(30)
def test_closed_objects_do_not_warn():
    """Closed objects go without a warning, and each is released while
    what it belongs to is still open: the same object left open warns
    (tests above), so any one close that goes missing fails the test."""
    gc.collect()  # what earlier tests left is not this test's
    with finalizer_report() as rep:
        ctx = U.Context(options("tcp"))
        w = U.Worker(ctx)
        ep = w.ep_from_address(w.address)
        ep.abort()
        del ep
        gc.collect()
        w.close()
        del w
        gc.collect()
        ctx.close()
        del ctx
        gc.collect()
    assert not rep.warnings and not rep.unraisable, rep.describe()


# ------------------------------------------------------------------ close
@pytest.mark.timeout(30)
async def test_close_is_idempotent():
    loop = asyncio.get_running_loop()
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    w.start(loop)
    ep = w.ep_from_address(w.address)
    ep2 = w.ep_from_address(w.address)
    listener = w.listen(lambda ep: None, 0, "127.0.0.1")

    c1 = ep.close()
    c2 = ep.close()
    await c1
    await c2
    await ep.close()
    ep.abort()
    assert ep.closed and not ep.alive

    ep2.abort()
    ep2.abort()
    await ep2.close()
    assert ep2.closed

    listener.close()
    listener.close()
    assert listener.closed

    with pytest.raises(U.UCXError):
        ctx.close()  # a worker is still open
    assert not ctx.closed
    w.close()
    w.close()
    assert w.closed
    ep.abort()
    await ep.close()
    listener.close()
    ctx.close()
    ctx.close()
    assert ctx.closed


@pytest.mark.timeout(30)
async def test_use_after_close_raises():
    loop = asyncio.get_running_loop()
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    w.start(loop)
    ep = w.ep_from_address(w.address)
    addr = w.address
    await ep.close()
    ep_calls = {
        "tag_send": lambda: ep.tag_send(b"x", 1),
        "send": lambda: ep.send(b"x"),
        "tag_recv": lambda: ep.tag_recv(bytearray(1), 1),
        "recv": lambda: ep.recv(bytearray(1)),
        "gather_send": lambda: ep.gather_send([b"x"]),
        "gather_recv": lambda: ep.gather_recv([bytearray(1)]),
        "am_send": lambda: ep.am_send(b"x"),
        "am_recv": lambda: ep.am_recv(),
        "stream_send": lambda: ep.stream_send(b"x"),
        "stream_recv": lambda: ep.stream_recv(bytearray(1)),
    }
    for name, call in ep_calls.items():
        with pytest.raises(U.UCXCloseError):
            call()
            pytest.fail(f"ep.{name} after close did not raise")
    ep2 = w.ep_from_address(addr)
    w.close()
    worker_calls = {
        "tag_recv": lambda: w.tag_recv(bytearray(1), 1),
        "ep_from_address": lambda: w.ep_from_address(addr),
        "ep_from_sockaddr": lambda: w.ep_from_sockaddr("127.0.0.1", 1234),
        "listen": lambda: w.listen(lambda ep: None, 0, "127.0.0.1"),
        "address": lambda: w.address,
        "progress": lambda: w.progress(),
        "arm": lambda: w.arm(),
        "signal": lambda: w.signal(),
        "info": lambda: w.info(),
        "start": lambda: w.start(loop),
        "ep2.tag_send": lambda: ep2.tag_send(b"x", 1),
        "ep2.tag_recv": lambda: ep2.tag_recv(bytearray(1), 1),
    }
    for name, call in worker_calls.items():
        with pytest.raises(U.UCXCloseError):
            call()
            pytest.fail(f"{name} after worker close did not raise")
    ctx.close()
    with pytest.raises(U.UCXCloseError):
        U.Worker(ctx)
    with pytest.raises(U.UCXCloseError):
        ctx.info()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_close_worker_with_pending_receives(mode):
    loop = asyncio.get_running_loop()
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx, mode)
    task = w.start(loop)
    ep = w.ep_from_address(w.address)
    try:
        efd = w.efd
        bufs = [bytearray(THRESH + 1) for _ in range(4)]
        rcs = [sys.getrefcount(b) for b in bufs]
        reqs = [
            w.tag_recv(bufs[0], 1),
            ep.tag_recv(bufs[1], 2),
            ep.gather_recv([bufs[2], bufs[3]], 3),
            ep.am_recv(),
        ]

        async def waiter(r):
            return await r

        awaiting = asyncio.ensure_future(waiter(w.tag_recv(bytearray(5), 9)))
        for _ in range(3):
            await asyncio.sleep(0)
        assert not awaiting.done()
        assert w.task is task and not task.done()
        w.close()
        for r in reqs:
            assert r.done()
            with pytest.raises(U.UCXCanceledError):
                await r
            assert r.status == UCS_ERR_CANCELED
        with pytest.raises(U.UCXCanceledError):
            await asyncio.wait_for(awaiting, 5)
        assert [sys.getrefcount(b) for b in bufs] == rcs
        assert w.task is None and w.loop is None
        for _ in range(2):
            await asyncio.sleep(0)
        assert task.done() and not task.cancelled()
        assert task.exception() is None
        if mode == "blocking":
            assert efd >= 0
        assert not loop.remove_reader(efd), "the worker's fd reader is still registered"
    finally:
        ep.abort()
        w.close()
        ctx.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("settle", [True, False], ids=["cancel-then-close", "same-turn"])
async def test_cancelled_task_then_worker_closed(settle):
    loop = asyncio.get_running_loop()
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    w.start(loop)
    try:
        buf = bytearray(THRESH + 1)
        rc0 = sys.getrefcount(buf)
        r = w.tag_recv(buf, 1)

        async def waiter():
            return await r

        t = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        t.cancel()
        if settle:
            with pytest.raises(asyncio.CancelledError):
                await t
        w.close()
        if not settle:
            with pytest.raises(asyncio.CancelledError):
                await t
        assert r.done() and r.status == UCS_ERR_CANCELED
        del r
        gc.collect()
        assert sys.getrefcount(buf) == rc0
    finally:
        w.close()
        ctx.close()


# ------------------------------------------------------------------ loops that go first
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
@pytest.mark.parametrize("then", ["new-loop", "close-directly"])
def test_event_loop_closed_first(mode, then):
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx, mode)
    ep = w.ep_from_address(w.address)
    size = THRESH + 1

    async def transfer(tag):
        out = bytearray(size)
        await asyncio.wait_for(
            asyncio.gather(ep.tag_send(pattern(size, tag), tag), w.tag_recv(out, tag)), 10)
        assert out == pattern(size, tag)

    async def start_and_transfer(tag):
        w.start(asyncio.get_running_loop())
        await transfer(tag)

    loop1 = asyncio.new_event_loop()
    try:
        loop1.run_until_complete(start_and_transfer(1))
        assert w.loop is loop1 and w.task is not None
        # a receive left pending on the loop that goes away
        pending = w.tag_recv(bytearray(size), 99)
    finally:
        loop1.close()
    try:
        if then == "new-loop":
            loop2 = asyncio.new_event_loop()
            try:
                # awaiting a pending request attaches to the running loop
                loop2.run_until_complete(transfer(2))
                if w.loop is not loop2:  # everything completed inline (spin)
                    loop2.run_until_complete(start_and_transfer(2))
                assert w.loop is loop2
                loop2.run_until_complete(transfer(3))
                ep.abort()
                w.close()
                loop2.run_until_complete(asyncio.sleep(0))
                assert not loop2.remove_reader(w.efd) if w.efd >= 0 else True
            finally:
                loop2.close()
        else:
            ep.abort()
            w.close()
        assert pending.done()
        with pytest.raises(U.UCXCanceledError):
            pending.result()
    finally:
        ep.abort()
        w.close()
        ctx.close()
    gc.collect()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
def test_inline_completions_on_a_new_loop_after_the_first_closed(mode):
    # Awaits of done requests do not attach the worker to the running loop;
    # when their time slice is spent, the turn they give must be taken on
    # the running loop, not on the worker's closed one.
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx, mode)
    ep = w.ep_from_address(w.address)

    async def start():
        w.start(asyncio.get_running_loop())
        await ep.tag_send(b"x", 1)

    async def many_small_sends():
        for _ in range(5000):
            await ep.tag_send(b"x", 2)

    loop1 = asyncio.new_event_loop()
    loop2 = asyncio.new_event_loop()
    try:
        loop1.run_until_complete(start())
        loop1.close()
        yields = w.spin_stats["slice_yields"]
        loop2.run_until_complete(many_small_sends())
        assert w.spin_stats["slice_yields"] > yields  # the slice was spent
        assert w.loop is loop1  # nothing attached the worker to loop2
    finally:
        ep.abort()
        w.close()
        loop1.close()
        loop2.close()
        ctx.close()


@pytest.mark.timeout(60)
def test_worker_stop_and_restart_on_another_loop():
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    ep = w.ep_from_address(w.address)
    try:
        for i in range(3):
            loop = asyncio.new_event_loop()
            try:
                async def go():
                    task = w.start(loop)
                    assert w.start(loop) is task  # idempotent per loop
                    out = bytearray(4)
                    await asyncio.gather(ep.tag_send(b"ping", i), w.tag_recv(out, i))
                    assert out == b"ping"
                    w.stop()
                    assert w.task is None and w.loop is None
                    await asyncio.sleep(0)
                    await asyncio.sleep(0)
                    assert task.done()
                    assert not loop.remove_reader(w.efd)

                loop.run_until_complete(asyncio.wait_for(go(), 10))
            finally:
                loop.close()
    finally:
        ep.abort()
        w.close()
        ctx.close()


# ------------------------------------------------------------------ buffers held while pending
@pytest.mark.timeout(30)
async def test_pending_recv_holds_the_buffer_export(loc):
    """While a receive is pending its buffer stays exported: a bytearray
    cannot be resized, a memoryview cannot be released."""
    w, ep = loc.w, loc.ep
    ba = bytearray(THRESH + 1)
    r = w.tag_recv(ba, 20)
    with pytest.raises(BufferError):
        ba.extend(b"more")
    mv = memoryview(bytearray(100))
    r2 = ep.tag_recv(mv, 21)
    with pytest.raises(BufferError):
        mv.release()
    await ep.tag_send(pattern(THRESH + 1), 20)
    await ep.tag_send(pattern(100), 21)
    await asyncio.wait_for(asyncio.gather(r, r2), 10)
    ba.extend(b"more")  # released on completion
    assert bytes(mv) == pattern(100)
    mv.release()


@pytest.mark.timeout(30)
async def test_pending_send_holds_the_buffer_export(loc):
    w, ep = loc.w, loc.ep
    src = bytearray(pattern(2 * MiB))
    s = ep.tag_send(src, 22)  # rendezvous: pending until received
    assert not s.done()
    with pytest.raises(BufferError):
        src.clear()
    out = bytearray(2 * MiB)
    await asyncio.wait_for(asyncio.gather(s, w.tag_recv(out, 22)), 10)
    assert out == pattern(2 * MiB)
    src.clear()


@pytest.mark.timeout(30)
async def test_cancelled_task_awaiting_a_send(loc):
    """Cancelling the task that awaits a send does not recall the send: it
    still delivers, and its buffer is released once UCX is done."""
    w, ep = loc.w, loc.ep
    src = bytearray(pattern(2 * MiB, 4))
    rc0 = sys.getrefcount(src)
    s = ep.tag_send(src, 23)

    async def waiter():
        await s

    t = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert not s.done()
    out = bytearray(2 * MiB)
    assert await asyncio.wait_for(w.tag_recv(out, 23), 10) == 2 * MiB
    assert out == src
    for _ in range(100):
        if s.done():
            break
        await asyncio.sleep(0.001)
    assert s.done() and s.status == 0
    assert sys.getrefcount(src) == rc0


@pytest.mark.timeout(60)
async def test_close_worker_with_many_pending_requests():
    ctx = U.Context(options("tcp"))
    w = U.Worker(ctx)
    w.start(asyncio.get_running_loop())
    ep = w.ep_from_address(w.address)
    try:
        bufs = [bytearray(16) for _ in range(5000)]
        rcs = [sys.getrefcount(b) for b in bufs]
        reqs = [(w.tag_recv if i % 2 else ep.tag_recv)(b, 1000 + i) for i, b in enumerate(bufs)]
        sends = [ep.tag_send(pattern(MiB, i), 9000 + i) for i in range(20)]  # rendezvous
        assert w.npending == 5020
        w.close()
        assert w.npending == 0
        for r in reqs:
            assert r.done() and r.status == UCS_ERR_CANCELED
        for s in sends:
            assert s.done()
            with pytest.raises(U.UCXError):
                s.result()
        del reqs, sends
        gc.collect()
        assert [sys.getrefcount(b) for b in bufs] == rcs
    finally:
        ep.abort()
        w.close()
        ctx.close()


@pytest.mark.timeout(30)
async def test_close_endpoint_with_pending_receives(loc):
    w, ep = loc.w, loc.ep
    ep2 = w.ep_from_address(w.address)
    try:
        r1 = ep2.tag_recv(bytearray(10), 30)
        r2 = ep2.gather_recv([bytearray(10), bytearray(THRESH + 1)], 31, force_tag=True)
        r3 = ep2.recv(bytearray(10))
        other = w.tag_recv(bytearray(10), 32)  # not tracked by ep2
        await ep2.close()
        for r in (r1, r2, r3):
            with pytest.raises(U.UCXCanceledError):
                await asyncio.wait_for(r, 5)
        assert not other.done()
        await ep.tag_send(b"0123456789", 32)
        assert await asyncio.wait_for(other, 5) == 10
    finally:
        ep2.abort()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tl", ["tcp", "shm_eh"])
@pytest.mark.parametrize("how", [
    "close",
    "abort",
])
async def test_pending_send_settles_when_endpoint_closes(tl, how):
    """DESIGN: pending operations fail with UCXCanceledError when either
    side closes. A rendezvous send nobody receives must not outlive the
    endpoint's close."""
    from _util import Pair

    p = Pair(tl)
    loop = asyncio.get_running_loop()
    p.a.start(loop)
    p.b.start(loop)
    try:
        src = bytearray(pattern(4 * MiB))
        rc0 = sys.getrefcount(src)
        s = p.ab.tag_send(src, 5)
        for _ in range(20):
            await asyncio.sleep(0.001)
        assert not s.done()
        if how == "close":
            await asyncio.wait_for(p.ab.close(), 5)
        else:
            p.ab.abort()
        try:
            await asyncio.wait_for(s, 3)
        except U.UCXError:
            pass
        assert s.done()
        assert sys.getrefcount(src) == rc0
    finally:
        p.close()
