"""Worker: construction and options, loop attachment and the one progress
task, manual progress without asyncio, arm/signal on the event fd, spin
budgets, listeners and worker-level receives, thread and loop checks."""

import asyncio
import collections.abc
import gc
import select
import struct
import threading
import time
import warnings

import pytest

import _peer
from _util import THRESH, Local, TurnCounter, options, pattern
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]


@pytest.fixture
def ctx():
    c = U.Context(options("tcp"))
    yield c
    gc.collect()
    c.close()


# ------------------------------------------------------------------ construction
@pytest.mark.timeout(30)
def test_modes_and_options(ctx):
    for mode in ("blocking", "polling"):
        w = U.Worker(ctx, mode)
        try:
            assert w.progress_mode == mode
            assert w.context is ctx
            assert isinstance(w.spin_us, float) and w.spin_us >= 0
            assert isinstance(w.efd, int) and w.efd >= 0
            assert isinstance(w.address, bytes) and len(w.address) > 8
            assert w.address == w.address
            assert not w.closed and w.loop is None and w.task is None
            assert w.npending == 0
            assert isinstance(w.info(), str) and w.info()
            w.spin_us = 12.5
            assert w.spin_us == 12.5
            w.spin_us = 0
            assert w.spin_us == 0
            with pytest.raises(ValueError):
                w.spin_us = -1
            with pytest.raises(TypeError):
                w.spin_us = "fast"
        finally:
            w.close()
    w = U.Worker(ctx, "polling", spin_us=7)
    assert w.spin_us == 7.0
    w.close()
    assert U.Worker(ctx).progress_mode == "blocking"  # closed when collected
    gc.collect()


@pytest.mark.timeout(30)
def test_spin_defaults_per_mode(ctx):
    """'auto' in blocking and thread mode, a fixed 100 us in polling mode, 0
    in thread-polling mode; 'auto' and numbers can be set and read back."""
    expect = {"blocking": (True, 0.0), "thread": (True, 0.0),
              "polling": (False, 100.0), "thread-polling": (False, 0.0)}
    for mode, (auto, us) in expect.items():
        w = U.Worker(ctx, mode)
        try:
            assert (w.spin_auto, w.spin_us) == (auto, us), mode
            w.spin_us = 30
            assert (w.spin_auto, w.spin_us) == (False, 30.0)
            w.spin_us = "auto"
            assert w.spin_auto and w.spin_us == 0.0
        finally:
            w.close()
    w = U.Worker(ctx, "polling", spin_us="auto")
    assert w.spin_auto
    w.close()


@pytest.mark.timeout(30)
def test_auto_spin_policy(ctx):
    """The auto budget (docs/ENGINE.md, "Spin and time slice"): a completion
    that came after the spin gave up grows it to that wait, at least
    doubling it, from 10 us up to the 200 us cap; one within the budget
    changes nothing; a wait longer than the cap, or one during which this
    process made other UCX calls, halves it (to 0 below 10 us); spins that
    mostly expire stop it for 32 sleeps, then 64, ..."""
    w = U.Worker(ctx, "blocking")
    try:
        budgets = []
        for block in (5.0, 15.0, 25.0, 190.0, 195.0):
            w._spin_adapt(block)
            budgets.append(w.spin_us)
        assert budgets == [10.0, 20.0, 40.0, 190.0, 200.0]
        w._spin_adapt(190.0)           # within the budget: no change
        assert w.spin_us == 200.0
        w._spin_adapt(5000.0)          # longer than the cap: halves
        assert w.spin_us == 100.0
        w._spin_adapt(150.0, True)     # others called UCX meanwhile: halves
        assert w.spin_us == 50.0
        for _ in range(3):
            w._spin_adapt(1e6)
        assert w.spin_us == 0.0        # 50 -> 25 -> 12.5 -> 0
        w._spin_adapt(5.0)
        assert w.spin_us == 10.0
        st = w.spin_stats
        assert st["grows"] == 6 and st["shrinks"] == 5
        # expired spins: the moving hit rate falls below 1/2 after 6 in a
        # row, then no growth for 32 sleeps, then a fresh start; a back-off
        # that follows another without a clean hit between lasts twice as
        # long
        for cycle, length in enumerate((32, 64)):
            for i in range(6):
                w._spin_missed()
                assert w.spin_us == (0.0 if i == 5 else 10.0), (cycle, i)
            for _ in range(length):
                w._spin_adapt(150.0)
                assert w.spin_us == 0.0
            w._spin_adapt(5.0)
            assert w.spin_us == 10.0
        w.spin_us = 40                 # a fixed budget does not adapt
        w._spin_adapt(150.0)
        w._spin_adapt(1e6)
        assert w.spin_us == 40.0 and not w.spin_auto
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_bad_constructor_arguments(ctx):
    with pytest.raises(ValueError):
        U.Worker(ctx, "spinning")
    with pytest.raises((ValueError, TypeError)):
        U.Worker(ctx, 1)
    with pytest.raises(ValueError):
        U.Worker(ctx, "polling", spin_us=-5)
    with pytest.raises(ValueError):
        U.Worker(ctx, "polling", spin_us=1e9)
    with pytest.raises(TypeError):
        U.Worker("not a context")
    with pytest.raises(TypeError):
        U.Endpoint()
    with pytest.raises(TypeError):
        U.Request()


@pytest.mark.timeout(30)
def test_blocking_needs_wakeup():
    ctx = U.Context(options("tcp"), features=U.FEATURE_TAG)
    try:
        w = U.Worker(ctx, "polling")
        assert w.efd == -1
        w.close()
        with pytest.raises(ValueError):
            U.Worker(ctx, "blocking")
        # The refused worker is not left open on the context until a GC
        # pass finds it (and warns about an object the caller never had).
        ctx.close()
    finally:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", ResourceWarning)
            gc.collect()
        ctx.close()


@pytest.mark.timeout(30)
def test_invalid_address(ctx):
    w = U.Worker(ctx)
    try:
        with pytest.raises(U.UCXError):
            w.ep_from_address(b"abc")
        with pytest.raises(TypeError):
            w.ep_from_address("not bytes")
        assert w.npending == 0
    finally:
        w.close()


# ------------------------------------------------------------------ manual progress
@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [10, THRESH + 1, 1 << 20])
def test_manual_progress_without_asyncio(ctx, size):
    w = U.Worker(ctx, "polling")
    ep = w.ep_from_address(w.address)
    try:
        out = bytearray(size)
        r = w.tag_recv(out, 3)
        with pytest.raises((asyncio.InvalidStateError, U.UCXError)):
            r.result()
        assert r.status == 1  # UCS_INPROGRESS
        s = ep.tag_send(pattern(size), 3)
        for _ in range(100000):
            if r.done() and s.done():
                break
            w.progress()
        assert r.done() and s.done()
        assert r.result() == size and s.result() is None
        assert r.status == 0 and s.status == 0
        assert out == pattern(size)
        assert w.loop is None  # nothing attached it to a loop
    finally:
        ep.abort()
        w.close()


_UNRECEIVED = """
import sys
from ucxx import _ucxx as U
sys.path.insert(0, sys.argv[2])
from _util import options
ctx = U.Context(options(sys.argv[1]))
a = U.Worker(ctx, "polling")
b = U.Worker(ctx, "polling")
ep = a.ep_from_address(b.address)
sends = [ep.tag_send(bytes(n), 5) for n in (0, 1, 128, 4096) * 3]
for _ in range(5000):
    a.progress(); b.progress()
    if all(s.done() for s in sends):
        break
assert all(s.done() and s.result() is None for s in sends)
b.close()
ep.abort()
a.close()
ctx.close()
print("closed")
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["tcp", "shm"])
def test_close_drops_unreceived_small_messages(tls):
    """Messages that arrived but were never received are dropped when the
    worker closes, instead of UCX warning about each one at destroy."""
    import os
    import subprocess
    import sys

    here = os.path.dirname(os.path.abspath(__file__))
    r = subprocess.run([sys.executable, "-c", _UNRECEIVED, tls, here],
                       capture_output=True, text=True, timeout=50)
    out = r.stdout + r.stderr  # UCX logs to stdout unless UCX_LOG_FILE says
    assert r.returncode == 0 and "closed" in r.stdout, out
    assert "was not matched" not in out, out
    assert "UCX  WARN" not in out and "UCX  ERROR" not in out, out


@pytest.mark.timeout(30)
def test_arm_and_signal_wake_the_fd(ctx):
    w = U.Worker(ctx, "blocking")
    try:
        for _ in range(1000):
            w.progress()
            if w.arm():
                break
        else:
            pytest.fail("the worker never armed")
        r, _, _ = select.select([w.efd], [], [], 0.05)
        assert not r, "an armed idle worker's fd is readable"
        w.signal()
        r, _, _ = select.select([w.efd], [], [], 5)
        assert r == [w.efd], "signal() did not wake the fd"
        w.progress()
    finally:
        w.close()


@pytest.mark.timeout(30)
def test_manual_blocking_protocol_never_stalls(ctx):
    """The blocking protocol by hand, two workers in one thread: progress
    until idle, arm, sleep on both fds. Every arrival (connection set-up,
    data, completions) wakes an fd: the select never times out before the
    transfer is done."""
    a = U.Worker(ctx, "blocking")
    b = U.Worker(ctx, "blocking")
    ab = a.ep_from_address(b.address)
    try:
        out = bytearray(THRESH + 1)
        r = b.tag_recv(out, 4)
        s = ab.tag_send(pattern(THRESH + 1), 4)

        def settle(w):
            for _ in range(10000):
                while w.progress():
                    pass
                if w.arm():
                    return
            pytest.fail("the worker never armed")

        # (connection set-up may wake the fds many times: bound by time)
        deadline = time.monotonic() + 20
        while not (r.done() and s.done()) and time.monotonic() < deadline:
            settle(a)
            settle(b)
            if r.done() and s.done():
                break
            ready, _, _ = select.select([a.efd, b.efd], [], [], 5)
            assert ready, f"stalled: recv done={r.done()} send done={s.done()}"
        assert r.done() and s.done()
        assert out == pattern(THRESH + 1)
    finally:
        ab.abort()
        a.close()
        b.close()


# ------------------------------------------------------------------ loop attachment
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_one_progress_task_per_worker_and_loop(mode):
    loop = asyncio.get_running_loop()
    loc = Local("tcp", mode, spin_us=0)
    try:
        task = loc.w.start(loop)
        assert isinstance(task, asyncio.Task)
        assert loc.w.start(loop) is task
        assert loc.w.task is task and loc.w.loop is loop
        coro = task.get_coro()
        assert isinstance(coro, collections.abc.Coroutine)
        assert isinstance(coro, U.ProgressCoroutine)
        assert coro.worker is loc.w
        before = set(asyncio.all_tasks(loop))
        for i in range(300):
            size = (0, 10, THRESH + 1)[i % 3]
            out = bytearray(size)
            await asyncio.gather(loc.ep.tag_send(pattern(size, i), 5), loc.w.tag_recv(out, 5))
            assert out == pattern(size, i)
        # the same task and coroutine, never re-created, and no new tasks
        assert loc.w.task is task and task.get_coro() is coro and not task.done()
        assert set(asyncio.all_tasks(loop)) == before
    finally:
        loc.close()
    await asyncio.sleep(0)
    assert task.done()


@pytest.mark.timeout(30)
async def test_await_attaches_implicitly():
    loc = Local("tcp", "blocking", spin_us=0)
    try:
        assert loc.w.loop is None
        out = bytearray(THRESH + 1)
        r = loc.w.tag_recv(out, 6)
        s = loc.ep.tag_send(pattern(THRESH + 1), 6)
        await asyncio.wait_for(asyncio.gather(r, s), 10)
        assert loc.w.loop is asyncio.get_running_loop()
        assert isinstance(loc.w.task, asyncio.Task)
    finally:
        loc.close()


@pytest.mark.timeout(30)
async def test_use_from_another_thread_raises():
    loc = Local("tcp")
    loc.w.start(asyncio.get_running_loop())
    errors = []

    def other():
        try:
            loc.w.tag_recv(bytearray(1), 1)
        except BaseException as e:
            errors.append(e)

    try:
        t = threading.Thread(target=other)
        t.start()
        t.join()
        assert len(errors) == 1 and isinstance(errors[0], RuntimeError)
        assert loc.w.npending == 0
    finally:
        loc.close()


@pytest.mark.timeout(30)
async def test_worker_driven_by_another_running_loop():
    """A worker attached to a loop that is running in another thread cannot
    be driven from this loop."""
    loc = Local("tcp")
    other = asyncio.new_event_loop()
    started = threading.Event()

    def run():
        asyncio.set_event_loop(other)
        other.call_soon(started.set)
        other.run_forever()

    th = threading.Thread(target=run)
    th.start()
    try:
        started.wait(5)
        fut = asyncio.run_coroutine_threadsafe(_start(loc.w), other)
        fut.result(5)
        with pytest.raises(RuntimeError):
            loc.w.start(asyncio.get_running_loop())
    finally:
        def stop_and_close():
            loc.close()
            other.stop()

        other.call_soon_threadsafe(stop_and_close)
        th.join(10)
        other.close()


async def _start(w):
    w.start(asyncio.get_running_loop())


# ------------------------------------------------------------------ spin budget
@pytest.mark.timeout(30)
async def test_polling_spin_budget_in_one_process():
    """Polling mode: with no budget an await that cannot complete at once
    suspends; with a budget the (loopback) message completes it inline."""
    loop = asyncio.get_running_loop()
    for spin in (0.0, 200000.0):
        loc = Local("tcp", "polling", spin_us=spin)
        try:
            loc.w.start(loop)
            await asyncio.gather(loc.ep.tag_send(b"w", 1), loc.w.tag_recv(bytearray(1), 1))
            turned = []
            for i in range(20):
                out = bytearray(64)
                r = loc.w.tag_recv(out, 2)
                s = loc.ep.tag_send(pattern(64, i), 2)
                counter = TurnCounter(loop)
                yields = loc.w.spin_stats["slice_yields"]
                try:
                    assert await r == 64
                    # a turn the time slice gave the loop is not a suspension
                    turned.append(counter.turns > 0
                                  and loc.w.spin_stats["slice_yields"] == yields)
                finally:
                    counter.stop()
                await s
                assert out == pattern(64, i)
            if spin == 0:
                assert all(turned), "spin_us=0 must not progress inline"
            else:
                assert not any(turned), "a message within the spin budget needed a loop turn"
        finally:
            loc.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_spin_budget_two_processes(mode):
    """A reply from another process that arrives within the spin budget
    completes the await without a loop turn; without a budget the task
    suspends and the loop turns. The peer echoes 2 ms after the request,
    well within the budget, and the receive is awaited before the sends:
    the reply cannot be there before the await, where the arm that
    precedes a suspension would complete it without one."""
    loop = asyncio.get_running_loop()
    results = {}
    for spin in (0.0, 200000.0):
        s = await _peer.connect("tcp", "echo", mode, spin, peer_mode="blocking",
                                delay_s=0.002)
        try:
            w, ep = s.w, s.ep
            turned = []
            for i in range(40):
                out = bytearray(64)
                r = ep.tag_recv(out, 3)
                sends = [ep.tag_send(struct.pack("<Q", 64), 1),
                         ep.tag_send(pattern(64, i), 2)]
                counter = TurnCounter(loop)
                yields = w.spin_stats["slice_yields"]
                try:
                    assert await r == 64
                    # a turn the time slice gave the loop is not a suspension
                    turned.append(counter.turns > 0 and w.spin_stats["slice_yields"] == yields)
                finally:
                    counter.stop()
                for q in sends:
                    await q
                assert out == pattern(64, i)
            await ep.tag_send(struct.pack("<Q", _peer.STOP), 1)
            await s.done()
            await s.finish()
        finally:
            s.close()
        results[spin] = sum(turned[5:])  # after warm-up
    assert results[0.0] >= 20, f"only {results[0.0]}/35 awaits suspended without a budget"
    assert results[200000.0] == 0, f"{results[200000.0]}/35 awaits suspended within the budget"


# ------------------------------------------------------------------ listener, worker receives
@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_listener_and_client_in_one_process(ctx, mode):
    loop = asyncio.get_running_loop()
    w = U.Worker(ctx, mode)
    w.start(loop)
    accepted = []
    got = loop.create_future()

    def on_connect(ep):
        assert asyncio.get_running_loop() is loop
        assert threading.current_thread() is threading.main_thread()
        accepted.append(ep)
        if not got.done():
            got.set_result(ep)

    listener = w.listen(on_connect, 0, "127.0.0.1")
    try:
        assert listener.port > 0 and listener.ip == "127.0.0.1" and not listener.closed
        client = w.ep_from_sockaddr("127.0.0.1", listener.port)
        server = await asyncio.wait_for(got, 10)
        assert isinstance(server, U.Endpoint) and server.alive
        for size in (0, 1, THRESH + 1, 1 << 20):
            out = bytearray(size)
            await asyncio.gather(client.tag_send(pattern(size), 1), server.tag_recv(out, 1))
            assert out == pattern(size)
            out = bytearray(size)
            await asyncio.gather(server.tag_send(pattern(size, 1), 2), client.tag_recv(out, 2))
            assert out == pattern(size, 1)
        with pytest.raises(U.UCXError):
            w.listen(on_connect, listener.port, "127.0.0.1")
        with pytest.raises(ValueError):
            w.listen(on_connect, 0, "not-an-address")
        with pytest.raises(TypeError):
            w.listen(42, 0, "127.0.0.1")
        await asyncio.sleep(0.01)
        assert len(accepted) == 1
        await client.close()
        server.abort()
    finally:
        listener.close()
        w.close()


@pytest.mark.timeout(30)
async def test_worker_recv_from_any_endpoint(ctx):
    w = U.Worker(ctx)
    w.start(asyncio.get_running_loop())
    eps = [w.ep_from_address(w.address) for _ in range(3)]
    try:
        outs = [bytearray(3) for _ in eps]
        recvs = [w.tag_recv(o, 9) for o in outs]
        for i, ep in enumerate(eps):
            await ep.tag_send(b"ep%d" % i, 9)
        await asyncio.wait_for(asyncio.gather(*recvs), 10)
        assert sorted(outs) == [b"ep0", b"ep1", b"ep2"]
        assert len({ep.uid for ep in eps}) == 3
    finally:
        for ep in eps:
            ep.abort()
        w.close()


@pytest.mark.timeout(30)
async def test_npending_tracks_requests(ctx):
    w = U.Worker(ctx)
    w.start(asyncio.get_running_loop())
    ep = w.ep_from_address(w.address)
    try:
        reqs = [w.tag_recv(bytearray(4), 100 + i) for i in range(5)]
        assert w.npending == 5
        big = ep.tag_send(pattern(1 << 20), 200)  # rendezvous: pending
        assert w.npending == 6
        for i, r in enumerate(reqs):
            await ep.tag_send(b"abcd", 100 + i)
            await r
            assert w.npending == 6 - i - 1
        out = bytearray(1 << 20)
        await asyncio.gather(big, w.tag_recv(out, 200))
        assert w.npending == 0
    finally:
        ep.abort()
        w.close()
