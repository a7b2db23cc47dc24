"""gather_send / gather_recv: one operation per list (host frames as IOV
runs), the runs both sides derive, frame counts and sizes around the
eager/rendezvous threshold and beyond 64 MiB, concurrency on one and several
endpoints beside plain traffic, size mismatches (clear errors, no leak),
cancellation, fake device frames, empty and bad lists."""

import asyncio
import gc
import os
import random
import struct
import sys

import numpy as np
import pytest

import _peer
from _util import THRESH, MiB, Pair, as_bytes, drive, local, local_tcp, pattern  # noqa: F401
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

SMALL = [0, 1, THRESH - 1, THRESH + 1]
UCS_ERR_CANCELED = -16
# The run rule's constants (csrc/ucxx.h; part of the wire format,
# docs/PROTOCOL.md "Gathers on the wire").
ALONE = 256 * 1024
RUN_BYTES = 1024 * 1024
RUN_FRAMES = 1024
runs = U.Endpoint.gather_runs


def frame_sizes(n: int) -> list:
    big = {n // 2, n - 1}
    return [4 * MiB if i in big else SMALL[i % 4] for i in range(n)]


def send_frames(sizes, seed=0):
    kinds = [bytes, bytearray, lambda b: np.frombuffer(b, np.uint8), memoryview]
    return [kinds[i % 4](pattern(n, seed * 100003 + i)) for i, n in enumerate(sizes)]


def recv_frames(sizes):
    kinds = [bytearray, lambda n: np.zeros(n, np.uint8),
             lambda n: memoryview(bytearray(n))]
    return [kinds[i % 3](n) for i, n in enumerate(sizes)]


def check_frames(outs, sizes, seed=0):
    for i, (o, n) in enumerate(zip(outs, sizes)):
        assert memoryview(o).nbytes == n, i
        assert as_bytes(o) == pattern(n, seed * 100003 + i), f"frame {i} ({n} bytes)"


class FakeDevice:
    """Host memory behind ``__cuda_array_interface__`` only: the C layer
    classifies it as device memory (UCX without CUDA support moves it like
    host memory), which is what the run rule looks at."""

    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, False), "shape": arr.shape,
            "typestr": arr.dtype.str, "strides": None, "version": 3}


@pytest.fixture
async def pair(request):
    tl = getattr(request, "param", "tcp")
    p = Pair(tl)
    loop = asyncio.get_running_loop()
    p.a.start(loop)
    p.b.start(loop)
    p.ab.send_tag = p.ba.recv_tag = 0x1111
    p.ba.send_tag = p.ab.recv_tag = 0x2222
    try:
        yield p
    finally:
        p.close()


# ------------------------------------------------------------------ runs
@pytest.mark.timeout(30)
def test_runs():
    """The messages a gather is made of, from sizes and memory types."""
    b = bytearray
    assert runs([]) == []
    assert runs([b(5)]) == [(0, 1, 5, False)]
    # consecutive small host frames: one IOV message (empty frames too)
    assert runs([b(0), b(1), b(1000), b(0)]) == [(0, 4, 1001, True)]
    assert runs([b(1024)] * 16) == [(0, 16, 16384, True)]
    # large frames travel alone and end the run before them
    assert runs([b(10), b(ALONE), b(20), b(30), b(ALONE - 1)]) == [
        (0, 1, 10, False), (1, 1, ALONE, False), (2, 3, 50 + ALONE - 1, True)]
    assert runs([b(4 * MiB)] * 3) == [(i, 1, 4 * MiB, False) for i in range(3)]
    # a run holds at most RUN_BYTES and RUN_FRAMES
    big = ALONE - 1
    k = RUN_BYTES // big
    assert runs([b(big)] * (k + 1)) == [(0, k, k * big, True), (k, 1, big, False)]
    assert runs([b(1)] * (RUN_FRAMES + 2)) == [
        (0, RUN_FRAMES, RUN_FRAMES, True), (RUN_FRAMES, 2, 2, True)]
    # device frames travel alone
    dev = FakeDevice(np.zeros(8, np.uint8))
    assert runs([b(1), b(2), dev, b(3), dev, dev]) == [
        (0, 2, 3, True), (2, 1, 8, False), (3, 1, 3, False), (4, 1, 8, False),
        (5, 1, 8, False)]
    # what the frames are made of does not matter, only size and memory type
    same = [bytes(3), np.zeros(3, np.uint8), memoryview(bytearray(3))]
    assert runs(same) == runs([b(3)] * 3)
    with pytest.raises(TypeError):
        runs([b(1), None])
    with pytest.raises(TypeError):
        runs(5)


# ------------------------------------------------------------------ sizes
@pytest.mark.timeout(60)
@pytest.mark.parametrize("n", [1, 2, 100, 1000])
@pytest.mark.parametrize("recv_first", [True, False], ids=["recv-first", "send-first"])
async def test_gather_frames(local, n, recv_first):
    w, ep = local.w, local.ep
    sizes = frame_sizes(n)
    frames = send_frames(sizes, n)
    outs = recv_frames(sizes)
    if recv_first:
        r = ep.gather_recv(outs)
        s = ep.gather_send(frames)
    else:
        s = ep.gather_send(frames)
        r = ep.gather_recv(outs)
    assert await asyncio.wait_for(r, 30) is None
    assert await asyncio.wait_for(s, 30) is None
    check_frames(outs, sizes, n)
    assert w.npending == 0


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", SMALL + [4 * MiB], ids=["0", "1", "thresh-1", "thresh+1", "4MiB"])
async def test_gather_single_frame(local, size):
    data = pattern(size, 7)
    out = bytearray(size)
    await asyncio.wait_for(asyncio.gather(local.ep.gather_send([data]),
                                          local.ep.gather_recv([out])), 10)
    assert out == data
    # a gather frame is an ordinary tagged message on the endpoint's tag
    out = bytearray(size)
    await asyncio.gather(local.ep.gather_send([data], 5, force_tag=True),
                         local.w.tag_recv(out, 5))
    assert out == data


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
async def test_gather_two_processes(tl):
    s = await _peer.connect(tl, "gather_echo")
    try:
        ep = s.ep
        for n in (1, 2, 100, 1000):
            sizes = frame_sizes(n)
            frames = send_frames(sizes, n)
            outs = recv_frames(sizes)
            back = ep.gather_recv(outs, 6, force_tag=True)
            await ep.tag_send(struct.pack("<Q", n), 4)
            await ep.tag_send(struct.pack(f"<{n}Q", *sizes), 4)
            await ep.gather_send(frames, 5, force_tag=True)
            await asyncio.wait_for(back, 60)
            check_frames(outs, sizes, n)
        await ep.tag_send(struct.pack("<Q", 0), 4)
        assert (await s.done())["rounds"] == 4
        await s.finish()
    finally:
        s.close()


# ------------------------------------------------------------------ concurrency
@pytest.mark.timeout(60)
async def test_concurrent_gathers_same_endpoint(pair):
    """Two tasks gather on the same endpoint (different tags) while plain
    sends run beside them on the endpoint's own tag."""
    ab, ba = pair.ab, pair.ba
    rng = random.Random(1)

    async def gatherer(tag, rounds, seed):
        for r in range(rounds):
            n = rng.choice([1, 3, 17, 64])
            sizes = [rng.choice(SMALL + [70000]) for _ in range(n)]
            frames = send_frames(sizes, seed + r)
            outs = recv_frames(sizes)
            recv = ba.gather_recv(outs, tag)
            for _ in range(rng.randint(0, 2)):
                await asyncio.sleep(0)
            await asyncio.wait_for(asyncio.gather(ab.gather_send(frames, tag), recv), 20)
            check_frames(outs, sizes, seed + r)

    async def plain(rounds):
        for i in range(rounds):
            size = rng.choice(SMALL)
            out = bytearray(size)
            recv = ba.recv(out)
            await ab.send(pattern(size, i))
            assert await recv == size and out == pattern(size, i)
            await asyncio.sleep(0)

    await asyncio.wait_for(asyncio.gather(
        gatherer(1, 30, 1000), gatherer(2, 30, 2000), plain(200)), 50)


@pytest.mark.timeout(60)
async def test_concurrent_gathers_different_endpoints(pair):
    """Gathers on two endpoints to the same worker, each with its own tag,
    plus plain sends on a third, all at once."""
    p = pair
    ab2 = p.a.ep_from_address(p.b.address)
    ab3 = p.a.ep_from_address(p.b.address)
    try:
        ab2.send_tag = 0x3333
        ab3.send_tag = 0x4444

        async def gatherer(ep, tag, seed):
            for r in range(25):
                sizes = frame_sizes(8) if r % 5 == 0 else [SMALL[(r + i) % 4] for i in range(10)]
                frames = send_frames(sizes, seed + r)
                outs = recv_frames(sizes)
                recv = p.ba.gather_recv(outs, tag, force_tag=True)
                await asyncio.wait_for(asyncio.gather(ep.gather_send(frames), recv), 20)
                check_frames(outs, sizes, seed + r)

        async def plain():
            for i in range(150):
                out = bytearray(100)
                recv = p.b.tag_recv(out, 0x5555)
                await ab3.tag_send(pattern(100, i), 0x5555)
                await recv
                assert out == pattern(100, i)

        await asyncio.wait_for(asyncio.gather(
            gatherer(p.ab, 0x1111, 10), gatherer(ab2, 0x3333, 20), plain()), 50)
    finally:
        ab2.abort()
        ab3.abort()


# ------------------------------------------------------------------ more sizes
@pytest.mark.timeout(120)
async def test_1000_mixed_frames(local):
    """1000 frames of mixed sizes, 0 B to 4 MiB, across the eager/rendezvous
    threshold (alone and inside IOV runs): intact and in order."""
    rng = random.Random(1000)
    small = [0, 1, 100, THRESH - 1, THRESH, THRESH + 1, 65536, ALONE - 1]
    large = [ALONE, MiB, 4 * MiB]
    sizes = [rng.choice(large) if rng.random() < 0.03 else rng.choice(small)
             for _ in range(1000)]
    assert min(sizes) == 0 and max(sizes) == 4 * MiB
    kinds = {(n, iov) for _, n, _, iov in runs([bytearray(n) for n in sizes])}
    assert any(iov for _, iov in kinds) and any(n == 1 for n, _ in kinds)
    frames = send_frames(sizes, 77)
    outs = recv_frames(sizes)
    r = local.ep.gather_recv(outs)
    s = local.ep.gather_send(frames)
    await asyncio.wait_for(asyncio.gather(r, s), 90)
    check_frames(outs, sizes, 77)
    assert local.w.npending == 0


@pytest.mark.timeout(120)
@pytest.mark.parametrize("sizes", [
    [THRESH - 1, 2, THRESH + 1],             # one IOV message over the threshold
    [THRESH // 2] * 2,                        # exactly at it
    [1, 64 * MiB + 1, 0, 3],                  # >= 64 MiB alone between runs
    [ALONE - 1] * 4 + [1] * 3,                # a run ends at RUN_BYTES
], ids=["iov-rndv", "iov-at-threshold", "64MiB", "run-bytes-cap"])
async def test_sizes_around_limits(local_tcp, sizes):
    frames = send_frames(sizes, 5)
    outs = recv_frames(sizes)
    await asyncio.wait_for(asyncio.gather(local_tcp.ep.gather_send(frames),
                                          local_tcp.ep.gather_recv(outs)), 90)
    check_frames(outs, sizes, 5)


@pytest.mark.timeout(60)
async def test_header_messages(pair):
    """gather_send(frames, header=[...]): each header buffer a message of its
    own, then the frames' runs, all from one call."""
    ab, ba = pair.ab, pair.ba
    frames = send_frames([3, 4, 5], 9)
    s = ab.gather_send(frames, header=[b"hdr-one", b"two"])
    h1, h2 = bytearray(7), bytearray(3)
    assert await asyncio.wait_for(ba.recv(h1), 10) == 7
    assert await asyncio.wait_for(ba.recv(h2), 10) == 3
    outs = recv_frames([3, 4, 5])
    await asyncio.wait_for(ba.gather_recv(outs), 10)
    await s
    assert (h1, h2) == (b"hdr-one", b"two")
    check_frames(outs, [3, 4, 5], 9)
    # no frames: the header messages alone
    s = ab.gather_send([], header=[b"x"])
    h = bytearray(1)
    assert await asyncio.wait_for(ba.recv(h), 10) == 1 and h == b"x"
    await s
    # a bad header buffer raises before anything is posted
    keep = bytearray(b"keep")
    rc = sys.getrefcount(keep)
    with pytest.raises(TypeError):
        ab.gather_send([keep], header=[b"ok", 5])
    with pytest.raises(TypeError):
        ab.gather_send([keep], header=5)
    with pytest.raises(TypeError):
        ba.gather_recv([bytearray(1)], header=[b"x"])
    assert sys.getrefcount(keep) == rc
    assert pair.a.npending == pair.b.npending == 0


# ------------------------------------------------------------------ device frames
FAKE_DEVICE = r"""
import asyncio, sys
import numpy as np
import ucxx
from ucxx import _ucxx as U

class FakeDevice:
    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, False), "shape": arr.shape,
            "typestr": arr.dtype.str, "strides": None, "version": 3}

ctx = U.Context({"TLS": sys.argv[1], "RNDV_THRESH": "8192"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)
ep.send_tag = ep.recv_tag = 9

async def main():
    w.start(asyncio.get_running_loop())
    rng = np.random.default_rng(3)
    sizes = [5, 0, 100, 20000, 3, 1 << 20, 7, 7]
    dev = [False, True, False, True, False, True, True, False]
    src = [rng.integers(0, 255, n, dtype=np.uint8) for n in sizes]
    dst = [np.zeros(n, np.uint8) for n in sizes]
    send = [FakeDevice(a) if d else a for a, d in zip(src, dev)]
    recv = [FakeDevice(a) if d else a for a, d in zip(dst, dev)]
    got = U.Endpoint.gather_runs(send)
    assert got == U.Endpoint.gather_runs(recv), got
    assert all(not any(dev[r[0]:r[0] + r[1]]) for r in got if r[1] > 1), got
    await asyncio.wait_for(asyncio.gather(ep.gather_send(send), ep.gather_recv(recv)), 20)
    for a, b in zip(src, dst):
        assert np.array_equal(a, b)
    print("RUNS", got, flush=True)
    print("DEVICE GATHER OK", flush=True)

asyncio.run(main())
ep.abort(); w.close(); ctx.close()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["tcp", "posix,sysv,cma"], ids=["tcp", "shm"])
def test_mixed_host_device_list(tls):
    """A list mixing host and (fake) device frames: device frames travel
    alone, host frames in runs between them; both sides derive the same
    runs and every frame lands in its buffer."""
    import subprocess
    import textwrap

    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(FAKE_DEVICE), tls],
                          capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "DEVICE GATHER OK" in proc.stdout


# ------------------------------------------------------------------ same tag
@pytest.mark.timeout(60)
async def test_concurrent_gathers_same_tag(pair):
    """Two tasks gather on one endpoint and one tag at once, two tasks
    receive: each receiver gets one whole gather, never a mix."""
    ab, ba = pair.ab, pair.ba
    rng = random.Random(7)
    sizes = [100, 1, 0, THRESH + 1, 4 * MiB, 30, 200000, 5]

    for rnd in range(10):
        frames = {k: send_frames(sizes, 1000 * rnd + k) for k in (1, 2)}

        async def sender(k):
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            await ab.gather_send(frames[k])

        async def receiver():
            for _ in range(rng.randint(0, 3)):
                await asyncio.sleep(0)
            outs = recv_frames(sizes)
            await ba.gather_recv(outs)
            return outs

        got = await asyncio.wait_for(asyncio.gather(
            sender(1), sender(2), receiver(), receiver()), 30)
        seen = set()
        for outs in got[2:]:
            k = next(k for k in (1, 2) if as_bytes(outs[0]) == as_bytes(frames[k][0]))
            check_frames(outs, sizes, 1000 * rnd + k)
            seen.add(k)
        assert seen == {1, 2}


@pytest.mark.timeout(60)
async def test_gather_races_single_sends_same_tag(pair):
    """Gathers and single sends posted by different tasks on one tag, in
    random order: on the wire each gather is whole. The receiver posts in
    the order the sender posted and every frame matches."""
    ab, ba = pair.ab, pair.ba
    rng = random.Random(11)
    log = []
    reqs = []
    gsizes = [10, 20, ALONE, 0, 30, MiB, 1]

    async def gatherer():
        for i in range(20):
            await asyncio.sleep(0)
            frames = send_frames(gsizes, i)
            reqs.append(ab.gather_send(frames))
            log.append(("g", i))

    async def single():
        for i in range(60):
            for _ in range(rng.randint(0, 1)):
                await asyncio.sleep(0)
            n = rng.choice([0, 5, THRESH + 1, 50000])
            reqs.append(ab.send(pattern(n, 500 + i)))
            log.append(("s", i, n))

    await asyncio.gather(gatherer(), single())
    assert {e[0] for e in log[:20]} == {"g", "s"}  # really interleaved
    for entry in log:
        if entry[0] == "g":
            outs = recv_frames(gsizes)
            await asyncio.wait_for(ba.gather_recv(outs), 20)
            check_frames(outs, gsizes, entry[1])
        else:
            out = bytearray(entry[2])
            assert await asyncio.wait_for(ba.recv(out), 20) == entry[2]
            assert out == pattern(entry[2], 500 + entry[1])
    await asyncio.wait_for(asyncio.gather(*reqs), 20)


# ------------------------------------------------------------------ mismatch
def mismatch_cases():
    for name, sent, recvd, longer in (
            ("longer", [10, 20, 30], [10, 15, 30], True),
            ("shorter", [10, 20, 30], [10, 25, 30], False),
            ("rndv-longer", [10, 2 * THRESH, 30], [10, THRESH, 30], True),
            ("rndv-shorter", [10, THRESH, 30], [10, 3 * THRESH, 30], False),
            ("alone-longer", [5, ALONE + 10], [5, ALONE + 9], True),
            ("fewer-frames", [10, 20, 30], [10, 20], True)):
        for recv_first in (True, False):
            yield pytest.param(sent, recvd, longer, recv_first,
                               id=f"{name}-{'recv' if recv_first else 'send'}-first")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("sent,recvd,longer,recv_first", list(mismatch_cases()))
async def test_size_mismatch(pair, sent, recvd, longer, recv_first):
    """A message whose length is not that of its buffers: a clear
    UCXMessageTruncatedError naming both sizes; no request or buffer
    reference left; the message was consumed whole, so the endpoint keeps
    working, gathers included."""
    ab, ba = pair.ab, pair.ba
    frames = [pattern(n, i) for i, n in enumerate(sent)]
    outs = [bytearray(n) for n in recvd]
    rcs = [sys.getrefcount(o) for o in outs]
    if recv_first:
        r = ba.gather_recv(outs)
        s = ab.gather_send(frames)
    else:
        s = ab.gather_send(frames)
        for _ in range(50):
            pair.a.progress()
            pair.b.progress()
        r = ba.gather_recv(outs)
    recv_runs = runs(outs)
    sent_runs = runs(frames)
    bad = next(i for i, (x, y) in enumerate(zip(recv_runs, sent_runs)) if x[2] != y[2])
    first, count, nbytes, _ = recv_runs[bad]
    with pytest.raises(U.UCXMessageTruncatedError) as ei:
        await asyncio.wait_for(r, 10)
    msg = str(ei.value)
    where = f"frame {first}" if count == 1 else f"frames {first}-{first + count - 1}"
    assert where in msg and f"their {nbytes} bytes" in msg, msg
    if longer:
        assert "longer than" in msg and "truncated" in msg, msg
    else:
        assert f"is {sent_runs[bad][2]} bytes, shorter than" in msg, msg
    await asyncio.wait_for(s, 10)  # the sender is not told
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in outs] == rcs
    assert pair.a.npending == pair.b.npending == 0
    # every message of the sender was consumed: the next gather matches
    outs = recv_frames([7, 8])
    await asyncio.wait_for(asyncio.gather(ab.gather_send(send_frames([7, 8], 3)),
                                          ba.gather_recv(outs)), 10)
    check_frames(outs, [7, 8], 3)
    for size in (5, THRESH + 1):
        out = bytearray(size)
        await asyncio.wait_for(asyncio.gather(ba.send(pattern(size)), ab.recv(out)), 10)
        assert out == pattern(size)


@pytest.mark.timeout(30)
async def test_mismatch_fails_whole_gather_at_once(pair):
    """A run that mismatches while later runs have no message yet: the
    gather fails at once (the later runs are cancelled), and since it took
    only part of its messages the endpoint refuses further gathers; plain
    traffic still works."""
    ab, ba = pair.ab, pair.ba
    outs = [bytearray(90), bytearray(4 * MiB), bytearray(100)]
    rcs = [sys.getrefcount(o) for o in outs]
    r = ba.gather_recv(outs)
    await ab.send(pattern(100, 1))  # longer than the first run
    with pytest.raises(U.UCXMessageTruncatedError, match="frame 0 is 100 bytes, longer"):
        await asyncio.wait_for(r, 10)
    assert pair.b.npending == 0
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in outs] == rcs
    with pytest.raises(U.UCXError, match="unusable"):
        ba.gather_recv([bytearray(1)])
    out = bytearray(5)
    await asyncio.wait_for(asyncio.gather(ab.send(b"12345"), ba.recv(out)), 10)
    assert out == b"12345"


@pytest.mark.timeout(300)
async def test_10000_mismatches_leak_nothing(local_tcp):
    """10 000 size mismatches (longer and shorter, eager and rendezvous) on
    one endpoint: each a clear exception; refcounts, live objects, pending
    requests and RSS stay flat."""
    w, ep = local_tcp.w, local_tcp.ep
    frames = [pattern(10, 1), pattern(20, 2)]
    big = [pattern(THRESH, 3), pattern(THRESH, 4)]
    outs = {"longer": [bytearray(10), bytearray(15)], "shorter": [bytearray(10), bytearray(25)],
            "big": [bytearray(THRESH), bytearray(THRESH - 1)]}
    rcs = {k: [sys.getrefcount(o) for o in v] for k, v in outs.items()}

    def rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    async def one(i):
        kind = ("longer", "shorter", "big")[i % 3]
        s = ep.gather_send(big if kind == "big" else frames, 7, force_tag=True)
        r = ep.gather_recv(outs[kind], 7, force_tag=True)
        try:
            await r
        except U.UCXMessageTruncatedError:
            pass
        else:
            raise AssertionError("no error")
        await s

    for i in range(300):  # warm up free lists and allocator pools
        await one(i)
    gc.collect()
    base_rss, base_objs = rss(), len(gc.get_objects())
    for i in range(10000):
        await one(i)
    gc.collect()
    assert {k: [sys.getrefcount(o) for o in v] for k, v in outs.items()} == rcs
    assert w.npending == 0
    assert len(gc.get_objects()) - base_objs < 100
    grown = rss() - base_rss
    if "libasan" not in os.environ.get("LD_PRELOAD", ""):  # ASan keeps freed memory
        assert grown < 4 * MiB, f"RSS grew by {grown} bytes over 10000 mismatches"


# ------------------------------------------------------------------ cancel
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["task", "cancel"])
async def test_cancel_before_any_message(pair, how):
    """A gather cancelled before any of its messages arrived took nothing
    off the stream: it fails with UCXCanceledError and the endpoint is not
    poisoned; the next gather receives what is sent next."""
    ab, ba = pair.ab, pair.ba
    outs = [bytearray(100), bytearray(THRESH + 1), bytearray(4 * MiB)]
    rcs = [sys.getrefcount(o) for o in outs]
    r = ba.gather_recv(outs)
    await asyncio.sleep(0.01)
    assert not r.done()
    await _cancel(r, how)
    assert pair.b.npending == 0
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in outs] == rcs
    sizes = [100, THRESH + 1, 4 * MiB]
    outs = recv_frames(sizes)
    await asyncio.wait_for(asyncio.gather(ab.gather_send(send_frames(sizes, 4)),
                                          ba.gather_recv(outs)), 20)
    check_frames(outs, sizes, 4)


async def _cancel(r, how):
    if how == "task":
        async def waiter():
            return await r

        t = asyncio.ensure_future(waiter())
        await asyncio.sleep(0)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        for _ in range(5):
            await asyncio.sleep(0)
        assert r.done()
        with pytest.raises(U.UCXCanceledError):
            r.result()
    else:
        assert r.cancel() is True
        with pytest.raises(U.UCXCanceledError):
            await r
    assert r.status == UCS_ERR_CANCELED


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["task", "cancel"])
async def test_cancel_mid_gather_poisons(pair, how):
    """Cancelled after its first run took a message: the whole gather fails
    with UCXCanceledError, every buffer is released, and the endpoint
    refuses further gathers (the stream is between two messages of one
    gather); plain transfers still work."""
    ab, ba = pair.ab, pair.ba
    outs = [bytearray(100), bytearray(4 * MiB)]
    rcs = [sys.getrefcount(o) for o in outs]
    r = ba.gather_recv(outs)
    await ab.send(pattern(100, 1))  # only the first run's message
    for _ in range(20):
        await asyncio.sleep(0.001)
    assert outs[0] == pattern(100, 1)
    assert not r.done()
    await _cancel(r, how)
    assert pair.b.npending == 0
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in outs] == rcs
    with pytest.raises(U.UCXError, match="unusable"):
        ba.gather_recv([bytearray(1)])
    with pytest.raises(U.UCXError, match="unusable"):
        ba.gather_send([b"x"])
    out = bytearray(THRESH + 1)
    await asyncio.wait_for(asyncio.gather(ab.send(pattern(THRESH + 1, 2)), ba.recv(out)), 10)
    assert out == pattern(THRESH + 1, 2)


@pytest.mark.timeout(30)
async def test_cancel_gather_send_is_refused(pair):
    s = pair.ab.gather_send([pattern(4 * MiB), b"x"])
    assert s.cancel() is False
    outs = [bytearray(4 * MiB), bytearray(1)]
    await asyncio.wait_for(asyncio.gather(s, pair.ba.gather_recv(outs)), 10)
    assert outs[0] == pattern(4 * MiB) and outs[1] == b"x"


# ------------------------------------------------------------------ empty / bad lists
@pytest.mark.timeout(30)
async def test_empty_list(pair):
    for call in (lambda: pair.ab.gather_send([]), lambda: pair.ba.gather_recv([]),
                 lambda: pair.ab.gather_send(()), lambda: pair.ba.gather_recv(())):
        req = call()
        assert req.done()
        finished, value = drive(req)
        assert finished and value is None
    assert pair.a.npending == pair.b.npending == 0
    # not poisoned
    outs = [bytearray(3)]
    await asyncio.gather(pair.ab.gather_send([b"abc"]), pair.ba.gather_recv(outs))
    assert outs[0] == b"abc"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [5, "text", None, [1], object()],
                         ids=["int", "str", "None", "list", "object"])
@pytest.mark.parametrize("pos", [0, 1, 2])
async def test_bad_element_raises_before_posting(pair, bad, pos):
    ab, ba = pair.ab, pair.ba
    good_send = [bytearray(pattern(THRESH + 1)), bytearray(b"ok"), bytearray(b"fine")]
    good_recv = [bytearray(THRESH + 1), bytearray(2), bytearray(4)]
    rcs = [sys.getrefcount(b) for b in good_send + good_recv]
    for side, ep, good in (("send", ab, good_send), ("recv", ba, good_recv)):
        frames = list(good)
        frames[pos] = bad
        n0 = (pair.a.npending, pair.b.npending)
        with pytest.raises(TypeError):
            (ep.gather_send if side == "send" else ep.gather_recv)(frames)
        assert (pair.a.npending, pair.b.npending) == n0
    del frames
    assert [sys.getrefcount(b) for b in good_send + good_recv] == rcs
    # nothing was posted: the next gathers match frame for frame
    await asyncio.wait_for(asyncio.gather(ab.gather_send(good_send), ba.gather_recv(good_recv)), 10)
    assert good_recv == good_send


@pytest.mark.timeout(30)
async def test_bad_containers_and_buffers(pair):
    ab, ba = pair.ab, pair.ba
    for bad in (5, None, 1.5):
        with pytest.raises(TypeError):
            ab.gather_send(bad)
        with pytest.raises(TypeError):
            ba.gather_recv(bad)
    keep = bytearray(10)
    rc = sys.getrefcount(keep)
    with pytest.raises(BufferError):
        ba.gather_recv([keep, b"read-only"])
    with pytest.raises(BufferError):
        ba.gather_recv([keep, memoryview(bytearray(10))[::2]])
    assert sys.getrefcount(keep) == rc
    assert pair.b.npending == 0
    # an iterable that is not a list still works
    outs = [bytearray(1), bytearray(2)]
    await asyncio.gather(ab.gather_send(iter([b"a", b"bc"])), ba.gather_recv(tuple(outs)))
    assert outs == [b"a", b"bc"]
