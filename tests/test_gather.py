"""gather_send / gather_recv: frame counts and sizes around the threshold,
concurrency on one and several endpoints beside plain traffic, size
mismatches poisoning the endpoint, cancellation, empty and bad lists."""

import asyncio
import gc
import random
import struct
import sys

import numpy as np
import pytest

import _peer
from _util import THRESH, MiB, Pair, as_bytes, drive, local, pattern  # noqa: F401
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

SMALL = [0, 1, THRESH - 1, THRESH + 1]
UCS_ERR_CANCELED = -16


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


# ------------------------------------------------------------------ mismatch


def mismatch_cases():
    for name, sizes in (("smaller", [10, 15, 30]), ("larger", [10, 25, 30]),
                        ("fewer-then-extra", [10, 20]),
                        ("rndv-smaller", [10, THRESH + 1, 30]),
                        ("rndv-larger", [10, 3 * THRESH, 30])):
        for recv_first in (True, False):
            yield pytest.param(sizes, recv_first,
                               id=f"{name}-{'recv' if recv_first else 'send'}-first")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("recv_sizes,recv_first", list(mismatch_cases()))
async def test_size_mismatch_poisons_endpoint(request, pair, recv_sizes, recv_first):
    name = request.node.callspec.id
    ab, ba = pair.ab, pair.ba
    frames = [pattern(10), pattern(2 * THRESH if "rndv" in name else 20), pattern(30)]
    outs = [bytearray(n) for n in recv_sizes]
    rcs = [sys.getrefcount(o) for o in outs]
    if recv_first:
        r = ba.gather_recv(outs)
        s = ab.gather_send(frames)
    else:
        # the frames are already there: the receives complete as posted
        s = ab.gather_send(frames)
        for _ in range(50):
            pair.a.progress()
            pair.b.progress()
        r = ba.gather_recv(outs)
    if len(recv_sizes) == len(frames):
        with pytest.raises(U.UCXMessageTruncatedError):
            await asyncio.wait_for(r, 10)
        assert outs[0] == pattern(10)
        await asyncio.wait_for(s, 10)  # the sender is not told
        # further gathers on the receiving endpoint are refused
        with pytest.raises(U.UCXError):
            ba.gather_recv([bytearray(1)])
        with pytest.raises(U.UCXError):
            ba.gather_send([b"x"])
        assert [sys.getrefcount(o) for o in outs] == rcs
    else:
        # the receiver asked for fewer frames: it completes, the extra
        # frame is an ordinary message left for whoever wants it
        await asyncio.wait_for(r, 10)
        extra = bytearray(30)
        await asyncio.wait_for(ba.recv(extra), 10)
        assert extra == pattern(30)
        await s
    # plain tagged traffic on the endpoint still works, both ways
    for size in (5, THRESH + 1):
        out = bytearray(size)
        await asyncio.wait_for(asyncio.gather(ab.send(pattern(size)), ba.recv(out)), 10)
        assert out == pattern(size)
        out = bytearray(size)
        await asyncio.wait_for(asyncio.gather(ba.send(pattern(size)), ab.recv(out)), 10)
        assert out == pattern(size)


# ------------------------------------------------------------------ cancel
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["task", "cancel"])
async def test_cancel_mid_gather(pair, how):
    ab, ba = pair.ab, pair.ba
    outs = [bytearray(100), bytearray(THRESH + 1), bytearray(4 * MiB)]
    rcs = [sys.getrefcount(o) for o in outs]
    r = ba.gather_recv(outs)
    # only the first frame arrives
    await ab.send(pattern(100, 1))
    for _ in range(20):
        await asyncio.sleep(0.001)
    assert outs[0] == pattern(100, 1)
    assert not r.done()
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
    assert pair.b.npending == 0
    del r
    gc.collect()
    assert [sys.getrefcount(o) for o in outs] == rcs
    # the endpoint's ordered stream is broken for gathers ...
    with pytest.raises(U.UCXError):
        ba.gather_recv([bytearray(1)])
    # ... but plain transfers still work
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
