"""Helpers for the tests of the C extension ``ucxx._ucxx``: contexts with a
known eager/rendezvous threshold, loopback workers, buffer factories,
refcount and loop-turn probes, and the randomised traffic generator used by
the progress stress tests (shared with the peer process, ``_peer.py``)."""

from __future__ import annotations

import array
import asyncio
import random
import struct
import sys

import numpy as np
import pytest

import ucxx  # noqa: F401  (loads the UCX libraries)
from ucxx import _ucxx as U

# A concrete eager/rendezvous threshold (UCX's default is "auto").
THRESH = 8192
MiB = 1 << 20

# name -> UCX options of a Context (UCX configuration is per Context).
TRANSPORTS = {
    "tcp": {"TLS": "tcp"},
    # Shared memory alone has no peer-failure support: endpoints fall back
    # to no error handling.
    "shm": {"TLS": "posix,sysv,cma"},
    # Shared memory carries the data, tcp gives connection management and
    # error handling.
    "shm_eh": {"TLS": "posix,sysv,cma,tcp", "MM_ERROR_HANDLING": "y"},
}


def options(transport: str, **extra) -> dict:
    opts = dict(TRANSPORTS[transport])
    opts["RNDV_THRESH"] = str(THRESH)
    opts.update({k: str(v) for k, v in extra.items()})
    return opts


class Local:
    """A context, a worker and an endpoint from the worker to itself."""

    def __init__(self, transport="tcp", mode="blocking", spin_us=None, **opts):
        self.transport = transport
        self.ctx = U.Context(options(transport, **opts))
        self.w = U.Worker(self.ctx, mode, spin_us)
        self.ep = self.w.ep_from_address(self.w.address)

    def close(self):
        self.ep.abort()
        self.w.close()
        self.ctx.close()


class Pair:
    """Two workers of one context on the same loop, with an endpoint each
    way: ``a`` sends to ``b`` through ``ab``, ``b`` to ``a`` through ``ba``."""

    def __init__(self, transport="tcp", mode="blocking", spin_us=None, **opts):
        self.ctx = U.Context(options(transport, **opts))
        self.a = U.Worker(self.ctx, mode, spin_us)
        self.b = U.Worker(self.ctx, mode, spin_us)
        self.ab = self.a.ep_from_address(self.b.address)
        # Finish a->b wireup before creating b->a: UCX 1.22's own assertion
        # in wireup.c ("lane 0 exists") has fired on crossing wireups of two
        # workers in one process under ASan's timing.
        r = self.b.tag_recv(bytearray(1), 0xFFFF_FFFF_FFFF_FFF0)
        s = self.ab.tag_send(b"w", 0xFFFF_FFFF_FFFF_FFF0)
        for _ in range(100000):
            if r.done() and s.done():
                break
            self.a.progress()
            self.b.progress()
        self.ba = self.b.ep_from_address(self.a.address)

    def close(self):
        self.ab.abort()
        self.ba.abort()
        self.a.close()
        self.b.close()
        self.ctx.close()


@pytest.fixture(params=["tcp", "shm"])
async def local(request):
    """A started loopback ``Local`` over tcp and over shared memory."""
    loc = Local(request.param)
    loc.w.start(asyncio.get_running_loop())
    try:
        yield loc
    finally:
        loc.close()


@pytest.fixture
async def local_tcp():
    loc = Local("tcp")
    loc.w.start(asyncio.get_running_loop())
    try:
        yield loc
    finally:
        loc.close()


# ------------------------------------------------------------------ buffers
def pattern(n: int, seed: int = 0) -> bytes:
    """n deterministic pseudo-random bytes."""
    if n == 0:
        return b""
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def recv_buffers(nbytes: int):
    """(name, writable buffer of nbytes bytes, bytes view) for every host
    buffer kind a receive accepts; nbytes must suit every dtype used."""
    out = [
        ("bytearray", bytearray(nbytes)),
        ("memoryview", memoryview(bytearray(nbytes))),
        ("np.uint8", np.zeros(nbytes, dtype=np.uint8)),
    ]
    if nbytes % 8 == 0:
        out += [
            ("np.int32", np.zeros(nbytes // 4, dtype=np.int32)),
            ("np.float64", np.zeros(nbytes // 8, dtype=np.float64)),
            ("np.complex64-2d", np.zeros((2, nbytes // 16), dtype=np.complex64)
             if nbytes % 16 == 0 else np.zeros((1, nbytes // 8), dtype=np.complex64)),
            ("np.float32-2d", np.zeros((4, nbytes // 16), dtype=np.float32)
             if nbytes % 16 == 0 else np.zeros((2, nbytes // 8), dtype=np.float32)),
            ("array.d", array.array("d", bytes(nbytes))),
            ("array.B", array.array("B", bytes(nbytes))),
        ]
    return out


def as_bytes(buf) -> bytes:
    return bytes(memoryview(buf).cast("B")) if memoryview(buf).nbytes else b""


def send_buffers(data: bytes):
    """Every host buffer kind a send accepts, all holding ``data``."""
    n = len(data)
    out = [
        ("bytes", data),
        ("memoryview-bytes", memoryview(data)),
        ("bytearray", bytearray(data)),
        ("memoryview-slice", memoryview(b"xx" + data + b"yy")[2:2 + n]),
        ("np.uint8", np.frombuffer(data, dtype=np.uint8).copy()),
        ("np.uint8-readonly", np.frombuffer(data, dtype=np.uint8)),
    ]
    if n % 8 == 0:
        out += [
            ("np.int64", np.frombuffer(data, dtype=np.int64).copy()),
            ("np.float32-2d", np.frombuffer(data, dtype=np.float32).reshape(2, -1).copy()
             if n % 8 == 0 and n else np.zeros((2, 0), np.float32)),
            ("array.d", array.array("d", data)),
        ]
    return out


# ------------------------------------------------------------------ probes
class TurnCounter:
    """Counts event-loop turns: a callback that reschedules itself."""

    def __init__(self, loop):
        self.loop = loop
        self.turns = 0
        self._handle = loop.call_soon(self._tick)

    def _tick(self):
        self.turns += 1
        self._handle = self.loop.call_soon(self._tick)

    def stop(self):
        self._handle.cancel()


def drive(awaitable):
    """Run one step of ``awaitable``'s await: (True, value) if it finished
    without suspending, (False, yielded) if it would suspend."""
    it = awaitable.__await__()
    try:
        y = it.send(None)
    except StopIteration as e:
        return True, e.value
    return False, y


def refcounts(*objs):
    return [sys.getrefcount(o) for o in objs]


async def progress_until(w, cond, timeout=10.0):
    """Await loop turns (the worker progresses itself) until cond()."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout
    while not cond():
        if loop.time() > deadline:
            raise TimeoutError("condition not reached")
        await asyncio.sleep(0.001)


# ------------------------------------------------------------------ stress
STRESS_TAG = 0x5A00_0000_0000_0000
PINGPONG_TAG = 0x5B00_0000_0000_0000
STRESS_SIZES = (0, 1, 1, 8, 100, 100, 1000, THRESH - 1, THRESH + 1, 30000, 200000)


def stream_tag(sender: int, k: int) -> int:
    return STRESS_TAG | (sender << 32) | k


def stream_sizes(seed: int, sender: int, k: int, n: int, sizes=STRESS_SIZES):
    rng = random.Random(f"{seed}/{sender}/{k}")
    return [rng.choice(sizes) for _ in range(n)]


def payload(sender: int, k: int, i: int, size: int) -> bytes:
    if size == 0:
        return b""
    pat = struct.pack("<IIQ", sender, k, i)
    return (pat * (-(-size // 16)))[:size]


async def _yield(n):
    for _ in range(n):
        await asyncio.sleep(0)


async def _wait_armed(w, limit=20):
    """Yield until the worker is armed (the loop may sleep on its fd next):
    the post that follows lands between ARM and the loop's poll."""
    for _ in range(limit):
        if w.armed:
            return
        await asyncio.sleep(0)


async def _post_in_callback(loop, post):
    """Post from a plain loop callback (not from a Task)."""
    fut = loop.create_future()

    def cb():
        try:
            fut.set_result(post())
        except BaseException as e:  # pragma: no cover - reported by the test
            fut.set_exception(e)

    loop.call_soon(cb)
    return await fut


def _burst(seed: int, sender: int, k: int, i: int, nmsgs: int):
    """Whether message i of stream k starts a burst, and if so (stop,
    gathered). Both sides draw it from the same seed: a gather is one
    operation on the wire (its small frames one IOV message), so sender and
    receiver must agree on which messages make a gather."""
    r = random.Random((seed * 1000003 + sender * 9176 + k) * 1000003 + i)
    if r.random() >= 0.15:
        return None
    return min(nmsgs, i + r.randint(2, 8)), r.random() < 0.5


async def stress(w, ep, me: int, peer: int, seed: int, nstreams: int, nmsgs: int,
                 sizes=STRESS_SIZES, timeout: float = 60.0) -> dict:
    """Randomised traffic: ``nstreams`` sender tasks and ``nstreams``
    receiver tasks, ``nmsgs`` messages each way per stream, posted at random
    points relative to the progress coroutine (random sleep(0) counts, right
    after the worker armed, from loop callbacks, in bursts). Every payload
    is checked. Returns counts; raises on any loss or corruption."""
    loop = asyncio.get_running_loop()
    rng = random.Random(seed * 7919 + me)
    stats = {"sent": 0, "recvd": 0, "bytes": 0, "armed_posts": 0,
             "callback_posts": 0, "bursts": 0, "gathers": 0}

    async def sender(k):
        tag = stream_tag(me, k)
        sz = stream_sizes(seed, me, k, nmsgs, sizes)
        i = 0
        while i < nmsgs:
            p = rng.random()
            burst = _burst(seed, me, k, i, nmsgs)
            if burst is not None:
                stop, gathered = burst
                bufs = [payload(me, k, j, sz[j]) for j in range(i, stop)]
                if gathered:
                    # one operation from one C call, sometimes posted while
                    # the worker is armed
                    if rng.random() < 0.5:
                        await _wait_armed(w)
                        stats["armed_posts"] += w.armed
                    reqs = [ep.gather_send(bufs, tag, force_tag=True)]
                    stats["gathers"] += 1
                else:
                    reqs = [ep.tag_send(b, tag) for b in bufs]
                await _yield(rng.randint(0, 2))
                for r in reqs:
                    await r
                stats["bursts"] += 1
                stats["sent"] += len(bufs)
                i = stop
                continue
            if p < 0.3:
                req = await _post_in_callback(
                    loop, lambda j=i: ep.tag_send(payload(me, k, j, sz[j]), tag))
                stats["callback_posts"] += 1
            elif p < 0.45:
                await _wait_armed(w)
                stats["armed_posts"] += w.armed
                req = ep.tag_send(payload(me, k, i, sz[i]), tag)
            else:
                await _yield(rng.randint(0, 3))
                req = ep.tag_send(payload(me, k, i, sz[i]), tag)
            if rng.random() < 0.3:
                await _yield(rng.randint(1, 3))
            await req
            stats["sent"] += 1
            i += 1

    async def receiver(k):
        tag = stream_tag(peer, k)
        sz = stream_sizes(seed, peer, k, nmsgs, sizes)
        i = 0

        def post(j):
            buf = bytearray(sz[j])
            if j % 2:
                return buf, ep.tag_recv(buf, tag)
            return buf, w.tag_recv(buf, tag)

        async def check(j, buf, req):
            n = await req
            assert n == sz[j], f"stream {k} msg {j}: {n} bytes, expected {sz[j]}"
            if bytes(buf) != payload(peer, k, j, sz[j]):
                raise AssertionError(f"stream {k} msg {j}: wrong payload")
            stats["recvd"] += 1
            stats["bytes"] += n

        while i < nmsgs:
            p = rng.random()
            burst = _burst(seed, peer, k, i, nmsgs)
            if burst is not None:
                stop, gathered = burst
                if gathered:
                    # one gather_recv for the sender's gather_send
                    if rng.random() < 0.5:
                        await _wait_armed(w)
                        stats["armed_posts"] += w.armed
                    bufs = [bytearray(sz[j]) for j in range(i, stop)]
                    req = ep.gather_recv(bufs, tag, force_tag=True)
                    await _yield(rng.randint(0, 2))
                    assert await req is None
                    for j, buf in zip(range(i, stop), bufs):
                        if bytes(buf) != payload(peer, k, j, sz[j]):
                            raise AssertionError(f"stream {k} msg {j}: wrong payload (gather)")
                        stats["recvd"] += 1
                        stats["bytes"] += sz[j]
                    stats["gathers"] += 1
                else:
                    posted = [(j, *post(j)) for j in range(i, stop)]
                    await _yield(rng.randint(0, 2))
                    for j, buf, req in posted:
                        await check(j, buf, req)
                stats["bursts"] += 1
                i = stop
                continue
            if p < 0.3:
                buf, req = await _post_in_callback(loop, lambda j=i: post(j))
                stats["callback_posts"] += 1
            elif p < 0.45:
                await _wait_armed(w)
                stats["armed_posts"] += w.armed
                buf, req = post(i)
            else:
                await _yield(rng.randint(0, 3))
                buf, req = post(i)
            if rng.random() < 0.3:
                await _yield(rng.randint(1, 3))
            await check(i, buf, req)
            i += 1

    tasks = [asyncio.ensure_future(sender(k)) for k in range(nstreams)]
    tasks += [asyncio.ensure_future(receiver(k)) for k in range(nstreams)]
    try:
        await asyncio.wait_for(asyncio.gather(*tasks), timeout)
    except BaseException:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    assert stats["sent"] == stats["recvd"] == nstreams * nmsgs, stats
    return stats


async def pingpong(w, ep, me: int, n: int, seed: int, timeout: float = 10.0) -> int:
    """Strict ping-pong with nothing else in flight: a lost wakeup has no
    other traffic to rescue it and shows as a timeout."""
    rng = random.Random(seed * 31 + me)
    buf = bytearray(8)
    for i in range(n):
        for turn in ((0, 1) if me == 0 else (1, 0)):
            if turn == 0:
                await _yield(rng.randint(0, 2))
                await ep.tag_send(struct.pack("<Q", i), PINGPONG_TAG | me)
            else:
                req = w.tag_recv(buf, PINGPONG_TAG | (1 - me))
                if rng.random() < 0.5:
                    await _wait_armed(w, 3)
                try:
                    got = await asyncio.wait_for(req, timeout)
                except asyncio.TimeoutError:
                    raise AssertionError(f"ping-pong stalled at message {i} "
                                         f"(side {me}, armed={w.armed})") from None
                assert got == 8 and struct.unpack("<Q", buf)[0] == i
    return n


# ------------------------------------------------------------------ invariant probe
class BlockingPollProbe:
    """Wraps the loop's selector: every poll that may block (timeout None or
    > 0) checks that each watched worker attached to this loop is armed.
    A blocking poll on an unarmed worker can miss the worker's next event
    (the progress invariant of DESIGN.md)."""

    def __init__(self, loop, workers):
        self.loop = loop
        self.workers = list(workers)
        self.polls = 0
        self.blocking = 0
        self.violations: list[str] = []
        self._sel = getattr(loop, "_selector", None)
        # uvloop has no Python selector to wrap: the probe sees nothing there
        # (the stress itself still runs and would hang on a lost wakeup).
        self.available = self._sel is not None
        if self._sel is None:
            return
        self._orig = self._sel.select

        def select(timeout=None):
            self.polls += 1
            if timeout is None or timeout > 0:
                self.blocking += 1
                for i, w in enumerate(self.workers):
                    if w.closed or w.loop is not loop or w.progress_mode != "blocking":
                        continue
                    if not w.armed:
                        self.violations.append(
                            f"worker {i} not armed at a blocking poll (timeout={timeout})")
            return self._orig(timeout)

        self._sel.select = select

    def close(self):
        if self._sel is not None and "select" in vars(self._sel):
            del self._sel.select
