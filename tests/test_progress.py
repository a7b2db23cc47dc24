"""The progress coroutine under stress (DESIGN.md, "The progress coroutine").

Many tasks post sends and receives at random points relative to the
progress coroutine: after random numbers of ``sleep(0)``, right after the
worker armed (before the loop polls), from plain loop callbacks, in bursts
(half of them as one gather_send / gather_recv);
in one process (two workers on one loop) and across two processes, over tcp
and shared memory, in blocking mode, polling mode, with a spin budget and in both thread
modes.
Every run is bounded by a timeout (a lost wakeup shows as a hang), every
payload is checked, and a selector probe asserts that the loop never blocks
in its poll while a blocking-mode worker is not armed.
"""

import asyncio
import os
import struct
import time
import zlib

import numpy as np
import pytest

import _peer
import ucxx
from _util import (THRESH, BlockingPollProbe, Local, Pair, pingpong, stress)

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

# None is each mode's default (an adaptive spin, a fixed one in polling
# mode); spin 0 keeps every await on the sleep path, where a lost wakeup
# would show.
CONFIGS = [
    ("blocking", None),
    ("blocking", 0.0),
    ("polling", None),
    ("blocking", 50.0),
    ("polling", 20.0),
    ("thread", None),
    ("thread", 0.0),
    ("thread-polling", None),
]
CONFIG_IDS = ["blocking", "blocking-spin0", "polling", "blocking-spin50", "polling-spin20",
              "thread", "thread-spin0", "thread-polling"]
NSTREAMS = 6
NMSGS = 400
NPINGPONG = 200


def seed_of(*params) -> int:
    return zlib.crc32(repr(params).encode())


def check_probe(probe, mode):
    assert not probe.violations, probe.violations[:5]
    if mode == "blocking":
        # the loop really slept on the worker's fd at some point
        assert not probe.available or probe.blocking > 0
    else:
        # polling: the progress task keeps the loop from blocking, except
        # where nothing at all is left to do between phases
        assert not probe.available or probe.polls > 0


@pytest.mark.timeout(10)
async def test_probe_detects_an_unarmed_worker():
    """The probe itself: a (fake) blocking worker that is not armed while
    the loop sleeps is reported."""
    loop = asyncio.get_running_loop()

    class FakeWorker:
        closed = False
        progress_mode = "blocking"
        armed = False

    fake = FakeWorker()
    fake.loop = loop
    probe = BlockingPollProbe(loop, [fake])
    try:
        await asyncio.sleep(0.01)
    finally:
        probe.close()
    if not probe.available:
        pytest.skip("the probe needs a selector-based loop")
    assert probe.blocking >= 1 and probe.violations
    assert "select" not in vars(loop._selector)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
@pytest.mark.parametrize("mode,spin", CONFIGS, ids=CONFIG_IDS)
async def test_stress_two_processes(tl, mode, spin):
    seed = seed_of(tl, mode, spin)
    loop = asyncio.get_running_loop()
    s = await _peer.connect(tl, "stress", mode, spin, seed=seed, nstreams=NSTREAMS,
                            nmsgs=NMSGS, npingpong=NPINGPONG)
    try:
        probe = BlockingPollProbe(loop, [s.w])
        try:
            stats = await stress(s.w, s.ep, 0, 1, seed, NSTREAMS, NMSGS, timeout=60)
            assert await pingpong(s.w, s.ep, 0, NPINGPONG, seed) == NPINGPONG
            # idle for a moment: a blocking-mode loop sleeps on an armed worker
            await asyncio.sleep(0.05)
        finally:
            probe.close()
        peer = await s.done()
        assert stats["sent"] == stats["recvd"] == NSTREAMS * NMSGS
        assert peer["sent"] == peer["recvd"] == NSTREAMS * NMSGS
        assert peer["pingpong"] == NPINGPONG
        assert not peer["violations"], peer["violations"]
        check_probe(probe, mode)
        if mode == "blocking":
            assert s.w.armed
            assert stats["armed_posts"] > 0, "no post landed while the worker was armed"
        assert stats["callback_posts"] > 0 and stats["bursts"] > 0
        assert stats["gathers"] > 0 and peer["gathers"] > 0
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tl", ["tcp", "shm_eh"])
async def test_stress_mixed_modes(tl):
    """This side blocking with a spin budget, the peer polling."""
    seed = seed_of("mixed", tl)
    s = await _peer.connect(tl, "stress", "blocking", 30.0, peer_mode="polling",
                            peer_spin_us=0, seed=seed, nstreams=4, nmsgs=200,
                            npingpong=100)
    try:
        probe = BlockingPollProbe(asyncio.get_running_loop(), [s.w])
        try:
            await stress(s.w, s.ep, 0, 1, seed, 4, 200, timeout=60)
            await pingpong(s.w, s.ep, 0, 100, seed)
        finally:
            probe.close()
        peer = await s.done()
        assert peer["recvd"] == 800 and not peer["violations"]
        assert not probe.violations, probe.violations[:5]
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
@pytest.mark.parametrize("mode,spin", CONFIGS, ids=CONFIG_IDS)
async def test_stress_one_process(tl, mode, spin):
    """Two workers on one loop, traffic both ways."""
    seed = seed_of("one", tl, mode, spin)
    loop = asyncio.get_running_loop()
    p = Pair(tl, mode, spin)
    try:
        p.a.start(loop)
        p.b.start(loop)
        probe = BlockingPollProbe(loop, [p.a, p.b])
        try:
            sa, sb = await asyncio.wait_for(asyncio.gather(
                stress(p.a, p.ab, 0, 1, seed, NSTREAMS, NMSGS // 2),
                stress(p.b, p.ba, 1, 0, seed, NSTREAMS, NMSGS // 2)), 90)
            await asyncio.wait_for(asyncio.gather(
                pingpong(p.a, p.ab, 0, NPINGPONG, seed),
                pingpong(p.b, p.ba, 1, NPINGPONG, seed)), 60)
            await asyncio.sleep(0.05)
        finally:
            probe.close()
        assert sa["recvd"] == sb["recvd"] == NSTREAMS * (NMSGS // 2)
        assert sa["gathers"] > 0 and sb["gathers"] > 0
        check_probe(probe, mode)
        if mode == "blocking":
            assert p.a.armed and p.b.armed
    finally:
        p.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
async def test_post_while_armed_same_turn(tl):
    """Posts made after the worker armed, in the same loop turn (from a
    plain callback): the worker is re-armed before the loop blocks, and the
    transfers complete with nothing else happening."""
    loop = asyncio.get_running_loop()
    p = Pair(tl, "blocking")
    try:
        p.a.start(loop)
        p.b.start(loop)
        out = bytearray(THRESH + 1)
        await asyncio.gather(p.ab.tag_send(b"warm", 1), p.b.tag_recv(bytearray(4), 1))
        probe = BlockingPollProbe(loop, [p.a, p.b])
        try:
            for i in range(50):
                size = (1, 100, THRESH + 1)[i % 3]
                data = bytes([i]) * size
                await asyncio.sleep(0.002)  # let both loops go idle
                assert p.a.armed and p.b.armed
                posted = loop.create_future()

                def cb():
                    assert p.a.armed and p.b.armed
                    r = p.b.tag_recv(memoryview(out)[:size], 2)
                    s = p.ab.tag_send(data, 2)
                    posted.set_result((r, s))

                loop.call_soon(cb)
                r, s = await posted
                await asyncio.wait_for(asyncio.gather(r, s), 5)
                assert out[:size] == data
        finally:
            probe.close()
        assert not probe.violations, probe.violations[:5]
        assert not probe.available or probe.blocking >= 50
    finally:
        p.close()


@pytest.mark.timeout(30)
async def test_idle_worker_is_armed_and_wakes():
    """A blocking-mode worker left idle is armed; a message arriving after a
    long idle period wakes the loop (no periodic watchdog needed)."""
    loop = asyncio.get_running_loop()
    loc = Local("tcp", "blocking")
    try:
        loc.w.start(loop)
        await asyncio.gather(loc.ep.tag_send(b"x", 1), loc.w.tag_recv(bytearray(1), 1))
        await asyncio.sleep(0.05)
        assert loc.w.armed
        out = bytearray(5)
        r = loc.w.tag_recv(out, 2)
        probe = BlockingPollProbe(loop, [loc.w])
        try:
            # The send is posted from a timer while the loop sleeps.
            loop.call_later(0.2, lambda: loc.ep.tag_send(b"hello", 2))
            assert await asyncio.wait_for(r, 5) == 5
        finally:
            probe.close()
        assert out == b"hello"
        assert not probe.violations
        assert not probe.available or probe.blocking >= 1
    finally:
        loc.close()


# ------------------------------------------------------------ spin and slice
async def _echo_round(ep, buf, out):
    """One round trip with an ``echo`` peer (tag 1 size, tag 2 payload,
    reply on tag 3)."""
    r = ep.tag_recv(out, 3)
    await ep.tag_send(struct.pack("<Q", len(buf)), 1)
    await ep.tag_send(buf, 2)
    return await r


async def _echo_stop(s):
    await s.ep.tag_send(struct.pack("<Q", _peer.STOP), 1)
    await s.done()
    await s.finish()


async def _cancel_and_stop(s, r):
    """Cancel ``r``, a receive nothing will match, then stop the peer."""
    assert not r.done()
    r.cancel()
    with pytest.raises(ucxx.exceptions.UCXCanceledError):
        await r
    await _echo_stop(s)


FAIR_MODES = [("blocking", None), ("polling", None), ("thread", None),
              ("thread-polling", None), ("blocking", 50.0)]


@pytest.mark.timing
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,spin", FAIR_MODES,
                         ids=["blocking", "polling", "thread", "thread-polling",
                              "blocking-spin50"])
@pytest.mark.parametrize("transport,nbytes", [("tcp", 1), ("tcp", 1 << 20), ("shm", 1 << 20)],
                         ids=["tcp-1B", "tcp-1MiB", "shm-1MiB"])
async def test_ticker_keeps_its_timing_beside_a_full_speed_pingpong(mode, spin, transport,
                                                                    nbytes):
    """A 1 ms ticker in the loop of a full-speed 1 B or 1 MiB ping-pong wakes
    at most 1 ms late at p99 (its awaits complete inline, within spins and
    while following a large transfer: the time slice gives the loop its
    turns), while the ping-pong keeps going.
    Late is counted in the loop thread's CPU time: what the loop ran before
    the timer's turn, which is what the engine decides.  In wall-clock time
    the kernel adds its own time slices (milliseconds) whenever the loop,
    the peer and anything else on two cores all want to run; the
    wall-clock p99 is held to 20 ms, a monopolised loop's is hundreds."""
    loop = asyncio.get_running_loop()
    lateness, cpu_late = [], []
    stop = False

    async def ticker():
        while not stop:
            due, cpu = time.monotonic() + 0.001, time.thread_time()
            await asyncio.sleep(0.001)
            lateness.append(time.monotonic() - due)
            cpu_late.append(time.thread_time() - cpu - 0.001)

    s = await _peer.connect(transport, "echo", mode, spin, peer_mode="blocking")
    rounds = 0
    try:
        buf, out = b"x" * nbytes, bytearray(nbytes)
        for _ in range(200):  # warm up: the auto budget settles
            await _echo_round(s.ep, buf, out)
        yields = s.w.spin_stats["slice_yields"]
        t = loop.create_task(ticker())
        end = time.monotonic() + 1.5
        while time.monotonic() < end:
            assert await _echo_round(s.ep, buf, out) == nbytes
            rounds += 1
        stop = True
        await t
        await _echo_stop(s)
    finally:
        s.close()
    lateness.sort()
    cpu_late.sort()
    p99 = lateness[int(len(lateness) * 0.99)]
    cpu_p99 = cpu_late[int(len(cpu_late) * 0.99)]
    assert len(lateness) > 300, f"the ticker woke {len(lateness)} times in 1.5 s"
    # uvloop's timers have a resolution of 1 ms (libuv's clock)
    bound = 0.002 if type(loop).__module__.startswith("uvloop") else 0.001
    assert cpu_p99 <= bound, (f"p99 lateness in loop CPU time {cpu_p99 * 1e3:.2f} ms "
                              f"(max {cpu_late[-1] * 1e3:.2f}; wall-clock p99 {p99 * 1e3:.2f})")
    assert p99 <= 0.020, f"wall-clock p99 lateness {p99 * 1e3:.2f} ms (max {lateness[-1] * 1e3:.2f})"
    assert rounds > (1500 if nbytes == 1 else 150), f"only {rounds} round trips in 1.5 s"
    if mode != "thread-polling" and (spin is None or spin > 0) and nbytes == 1:
        # the awaits completed inline: the slice, not a suspension, gave
        # the ticker its turns
        assert s.w.spin_stats["slice_yields"] > yields


@pytest.mark.timing
@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "thread"])
async def test_auto_spin_grows_with_a_peer_and_shrinks_when_idle(mode):
    """spin_us='auto' (the default): a ping-pong with another process grows
    the budget until replies complete within the spin; a long wait shrinks
    it again; an idle await does not spin."""
    s = await _peer.connect("tcp", "echo", mode, None, peer_mode="blocking")
    try:
        assert s.w.spin_auto and s.w.spin_us == 0.0
        buf, out = b"x", bytearray(1)
        for _ in range(300):
            await _echo_round(s.ep, buf, out)
        # a loaded machine delays replies past the cap or takes the CPU
        # from a spin, and the budget backs off to 0 for a while: go on
        # until it has grown again
        for _ in range(5000):
            if s.w.spin_us > 0:
                break
            await _echo_round(s.ep, buf, out)
        st = s.w.spin_stats
        assert st["grows"] > 0 and st["hits"] > 0, st
        assert 0 < s.w.spin_us <= 200, st
        # a wait much longer than the cap: the budget halves
        budget = s.w.spin_us
        r = s.ep.tag_recv(out, 3)
        sends = []
        asyncio.get_running_loop().call_later(
            0.01, lambda: sends.append(asyncio.ensure_future(_send_echo(s.ep, buf))))
        await r
        await sends[0]
        assert s.w.spin_us < budget and s.w.spin_stats["shrinks"] > st["shrinks"]
        await _echo_stop(s)
    finally:
        s.close()


async def _send_echo(ep, buf):
    await ep.tag_send(struct.pack("<Q", len(buf)), 1)
    await ep.tag_send(buf, 2)


@pytest.mark.timeout(60)
async def test_auto_spin_stays_off_with_both_ends_in_one_process():
    """Both ends on one loop: a reply needs the other task to run, which a
    spin would only delay; the auto budget stays at (or returns to) 0."""
    p = Pair("tcp", "blocking")
    try:
        loop = asyncio.get_running_loop()
        p.a.start(loop)
        p.b.start(loop)
        assert p.b.spin_auto

        async def server():
            buf = bytearray(8)
            for _ in range(500):
                await p.ba.tag_recv(buf, 1)
                await p.ba.tag_send(buf, 2)

        srv = loop.create_task(server())
        out = bytearray(8)
        for i in range(500):
            r = p.ab.tag_recv(out, 2)
            await p.ab.tag_send(b"%8d" % i, 1)
            await r
        await srv
        assert p.a.spin_us == 0.0 and p.b.spin_us == 0.0, (p.a.spin_stats, p.b.spin_stats)
    finally:
        p.close()


def _cpu_of(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode,nbytes", [("blocking", 8), ("thread", 8), ("blocking", 1 << 20)])
async def test_idle_process_with_a_pending_receive_uses_no_cpu(mode, nbytes):
    """After traffic stops, with a live endpoint and a pending receive, the
    process (and its peer) use at most 1 % of a core: the spin budget is
    bounded per await and nothing polls. A pending 1 MiB receive (a large
    transfer the engine follows) costs no more: following ends after
    UCXX_FOLLOW_IDLE_US without an event."""
    s = await _peer.connect("tcp", "echo", mode, None, peer_mode=mode)
    try:
        buf, out = b"x", bytearray(1)
        for _ in range(500):
            await _echo_round(s.ep, buf, out)
        r = s.ep.tag_recv(bytearray(nbytes), 99)  # never sent
        await asyncio.sleep(0.2)
        me0, peer0 = _cpu_of(os.getpid()), _cpu_of(s.peer.proc.pid)
        await asyncio.sleep(3.0)
        me, peer = _cpu_of(os.getpid()) - me0, _cpu_of(s.peer.proc.pid) - peer0
        await _cancel_and_stop(s, r)
    finally:
        s.close()
    assert me <= 0.03 and peer <= 0.03, f"idle CPU in 3 s: {me:.3f} s here, {peer:.3f} s in the peer"


@pytest.mark.timeout(60)
@pytest.mark.parametrize("transport", ["shm", "tcp"])
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_large_transfers_are_followed(mode, transport):
    """A transfer of 64 KiB or more in flight keeps the worker progressing
    (spin_stats["follows"]) instead of sleeping on the fd per piece; sizes
    around the threshold and across the eager limit arrive intact, and an
    idle worker follows nothing."""
    s = await _peer.connect(transport, "echo", mode, None, peer_mode=mode)
    try:
        for n in ((64 << 10) - 1, 64 << 10, 1 << 20, 9 << 20):
            buf = np.random.default_rng(n).integers(0, 256, n, dtype=np.uint8)
            out = np.zeros(n, np.uint8)
            for _ in range(3):
                assert await _echo_round(s.ep, buf, out) == n
                assert np.array_equal(out, buf)
        follows = s.w.spin_stats["follows"]
        assert follows > 0, s.w.spin_stats
        for _ in range(20):
            await _echo_round(s.ep, b"x", bytearray(1))
        await asyncio.sleep(0.3)
        assert s.w.spin_stats["follows"] == follows, s.w.spin_stats
        await _echo_stop(s)
    finally:
        s.close()


class _BusyTask:
    """Another task of the loop: CPU slices of ``slice_s`` with a bare
    yield between them, so that the loop is never idle."""

    def __init__(self, slice_s=0.0005):
        self.slice_s, self.stop, self.slices = slice_s, False, 0
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self):
        while not self.stop:
            end = time.perf_counter() + self.slice_s
            while time.perf_counter() < end:
                pass
            self.slices += 1
            await asyncio.sleep(0)

    async def close(self):
        self.stop = True
        await self.task


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling", "thread", "thread-polling"])
async def test_busy_loop_polls_the_worker_and_stops_when_idle(mode):
    """Beside a task that keeps the loop busy, a pending await yields and
    polls the worker once per loop iteration (spin_stats["busy_polls"])
    instead of waiting for the fd reader or the progress task, whose
    wake-ups run one iteration later; the polls stop once the loop is idle,
    and a blocking worker is armed again before the loop sleeps."""
    s = await _peer.connect("tcp", "echo", mode, 0.0, peer_mode="blocking")
    loop = asyncio.get_running_loop()
    probe = BlockingPollProbe(loop, [s.w])
    try:
        buf, out = b"y", bytearray(1)
        busy = _BusyTask()
        try:
            for _ in range(200):
                assert await _echo_round(s.ep, buf, out) == 1 and out == buf
        finally:
            await busy.close()
        polls = s.w.spin_stats["busy_polls"]
        assert polls > 0 and busy.slices > 0, s.w.spin_stats
        # idle loop: polls in fewer than half the rounds, then the fd
        # again.  A wake-up the kernel delays 100 µs (three threads on two
        # cores in thread mode) also reads as a busy loop, so this bound is
        # loose; the strict check is the pending receive below.
        for _ in range(200):
            assert await _echo_round(s.ep, buf, out) == 1
        assert s.w.spin_stats["busy_polls"] - polls < 100, s.w.spin_stats
        r = s.ep.tag_recv(bytearray(8), 99)  # never sent
        await asyncio.sleep(0.05)
        polls = s.w.spin_stats["busy_polls"]
        await asyncio.sleep(0.2)
        assert s.w.spin_stats["busy_polls"] == polls
        assert mode != "blocking" or s.w.armed
        await _cancel_and_stop(s, r)
    finally:
        probe.close()
        s.close()
    check_probe(probe, mode)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["blocking", "polling", "thread"])
async def test_stress_beside_a_busy_task(mode):
    """The two-process stress with another task keeping the loop busy: the
    busy-yield polls carry part of the progress, every payload arrives, and a
    blocking worker is never unarmed at a blocking poll."""
    seed = seed_of("busy", mode)
    loop = asyncio.get_running_loop()
    s = await _peer.connect("tcp", "stress", mode, None, seed=seed, nstreams=NSTREAMS,
                            nmsgs=NMSGS, npingpong=NPINGPONG)
    try:
        probe = BlockingPollProbe(loop, [s.w])
        busy = _BusyTask(0.0002)
        try:
            stats = await stress(s.w, s.ep, 0, 1, seed, NSTREAMS, NMSGS, timeout=90)
            assert await pingpong(s.w, s.ep, 0, NPINGPONG, seed) == NPINGPONG
        finally:
            await busy.close()
            await asyncio.sleep(0.05)
            probe.close()
        peer = await s.done()
        assert stats["sent"] == stats["recvd"] == NSTREAMS * NMSGS
        assert peer["sent"] == peer["recvd"] == NSTREAMS * NMSGS
        assert peer["pingpong"] == NPINGPONG and not peer["violations"]
        assert s.w.spin_stats["busy_polls"] > 0, s.w.spin_stats
        check_probe(probe, mode)
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("mode", ["blocking", "polling", "thread", "thread-polling"])
async def test_worker_leaves_the_loop_and_its_class_unchanged(mode):
    """A full workload (listener, connect, transfers of every kind, close)
    changes no attribute of the loop instance nor of its class."""
    loop = asyncio.get_running_loop()

    def loop_attrs():
        # asyncio's own state (counters, queues) changes as it runs; what
        # must not change is which attributes there are and which callables
        # (methods) they hold
        return (set(vars(loop)),
                {k: v for k, v in vars(loop).items() if callable(v)})

    before = loop_attrs()
    cls_before = {c: dict(vars(c)) for c in type(loop).__mro__}
    p = Pair("tcp", mode)
    try:
        p.a.start(loop)
        p.b.start(loop)
        for n in (0, 1, 1000, THRESH + 1, 1 << 20):
            out = bytearray(n)
            r = p.b.tag_recv(out, 7)
            await p.ab.tag_send(bytes(n), 7)
            assert await asyncio.wait_for(r, 10) == n
        frames = [bytearray(10), bytearray(THRESH + 5)]
        r = p.ba.gather_recv(frames)
        await p.ab.gather_send([b"1" * 10, b"2" * (THRESH + 5)])
        await asyncio.wait_for(r, 10)
        assert loop_attrs() == before
    finally:
        p.close()
    await asyncio.sleep(0)
    assert loop_attrs() == before
    assert {c: dict(vars(c)) for c in type(loop).__mro__} == cls_before


def test_slice_wake_leaves_a_cancelled_future_alone():
    """The timer of a time-slice yield resolves the awaiting task's future;
    asyncio.run cancels every task on exit (sys.exit in main), so the
    future may be cancelled by then: nothing is raised in the loop."""
    from ucxx import _ucxx

    loop = asyncio.new_event_loop()
    try:
        f = loop.create_future()
        f.cancel()
        assert _ucxx._slice_wake(f) is None and f.cancelled()
        g = loop.create_future()
        _ucxx._slice_wake(g)
        assert g.result() is None
    finally:
        loop.close()


@pytest.mark.timeout(60)
async def test_a_large_transfer_that_does_not_move_is_followed_at_most_200ms():
    """A large receive that nothing matches is a transfer in flight that
    makes no progress: the fd reader follows it for at most 200 ms
    (UCXX_FOLLOW_MAX_US) while other traffic wakes the worker (here echo
    replies that arrive before their receive is posted), then waits on the
    fd as usual; once a large request settles, following resumes.  (The fd
    reader is blocking mode's; polling mode follows in the await only.)"""
    s = await _peer.connect("tcp", "echo", "blocking", 0, peer_mode="blocking")
    try:
        r = s.ep.tag_recv(bytearray(1 << 20), 99)  # nothing is sent on tag 99
        size, replies = struct.pack("<Q", 1), 0

        async def unexpected_replies(seconds):
            nonlocal replies
            end = time.monotonic() + seconds
            while time.monotonic() < end:
                await s.ep.tag_send(size, 1)
                await s.ep.tag_send(b"x", 2)
                replies += 1
                await asyncio.sleep(0.005)

        await unexpected_replies(0.5)
        stats = s.w.spin_stats
        assert stats["follows"] > 5 and stats["follow_stops"] == 1, str(stats)
        await unexpected_replies(0.3)
        assert s.w.spin_stats["follows"] == stats["follows"], s.w.spin_stats
        for _ in range(replies):
            assert await s.ep.tag_recv(bytearray(1), 3) == 1
        r.cancel()
        with pytest.raises(ucxx.exceptions.UCXCanceledError):
            await r
        payload = bytes(range(256)) * 4096
        out = bytearray(len(payload))
        assert await _echo_round(s.ep, payload, out) == len(payload)
        assert s.w.spin_stats["follows"] > stats["follows"], s.w.spin_stats
        await _echo_stop(s)
    finally:
        s.close()
