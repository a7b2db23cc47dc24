"""Tagged transfers through ucxx._ucxx endpoints: sizes around the
eager/rendezvous threshold, every host buffer kind, one and two processes,
tcp and shared memory; immediate completion, truncation, cancellation and
argument errors."""

import asyncio
import gc
import struct
import sys

import numpy as np
import pytest

import _peer
from _util import (MiB, THRESH, TurnCounter, as_bytes, drive, local,  # noqa: F401
                   local_tcp, pattern, recv_buffers, send_buffers)
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

SIZES = [0, 1, THRESH - 1, THRESH + 1, MiB, 64 * MiB]
SIZE_IDS = ["0", "1", "thresh-1", "thresh+1", "1MiB", "64MiB"]
UCS_ERR_CANCELED = -16


def test_threshold_is_concrete():
    ctx = U.Context({"TLS": "tcp", "RNDV_THRESH": str(THRESH)})
    try:
        assert str(THRESH // 1024) + "K" in ctx.config["RNDV_THRESH"]
    finally:
        ctx.close()


# ------------------------------------------------------------------ one process
@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
async def test_sizes_one_process(local, size):
    data = pattern(size)
    # receive posted first
    out = bytearray(size)
    r = local.w.tag_recv(out, 10)
    await local.ep.tag_send(data, 10)
    assert await r == size
    assert out == data
    # send first (unexpected message, then the matching receive)
    out2 = bytearray(size)
    s = local.ep.tag_send(data, 11)
    r2 = local.ep.tag_recv(out2, 11)
    await asyncio.wait_for(asyncio.gather(s, r2), 30)
    assert r2.result() == size and out2 == data
    assert s.done() and s.result() is None
    assert local.w.npending == 0


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1000, THRESH + 7, 3 * MiB], ids=["eager", "rndv", "3MiB"])
async def test_send_recv_methods(local, size):
    """Endpoint.send/recv use send_tag/recv_tag (or a mixed / forced tag)."""
    ep, w = local.ep, local.w
    ep.send_tag = ep.recv_tag = 0x1234
    data = pattern(size, 3)
    out = bytearray(size)
    await asyncio.gather(ep.send(data), ep.recv(out))
    assert out == data
    out = bytearray(size)
    await asyncio.gather(ep.send(data, tag=99), ep.recv(out, tag=99))
    assert out == data
    out = bytearray(size)
    await asyncio.gather(ep.send(data, 5, True), w.tag_recv(out, 5))
    assert out == data
    # a mixed tag is not the plain tag
    out = bytearray(size)
    r = w.tag_recv(out, 99)
    s = ep.send(data, tag=99)
    for _ in range(5):
        await asyncio.sleep(0)
    assert not r.done()
    assert r.cancel()
    with pytest.raises(U.UCXCanceledError):
        await r
    # the message sent with the mixed tag is still there for its receiver
    out = bytearray(size)
    await asyncio.wait_for(asyncio.gather(s, ep.recv(out, tag=99)), 10)
    assert out == data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [1024, THRESH + 8], ids=["eager", "rndv"])
async def test_recv_buffer_kinds(local, size):
    data = pattern(size, 1)
    for name, buf in recv_buffers(size):
        r = local.w.tag_recv(buf, 20)
        await local.ep.tag_send(data, 20)
        assert await r == size, name
        assert as_bytes(buf) == data, name


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 1024, THRESH + 8], ids=["empty", "eager", "rndv"])
async def test_send_buffer_kinds(local, size):
    data = pattern(size, 2)
    for name, buf in send_buffers(data):
        out = bytearray(size)
        r = local.ep.tag_recv(out, 21)
        await local.ep.tag_send(buf, 21)
        assert await r == size, name
        assert out == data, name


@pytest.mark.timeout(60)
async def test_typed_arrays_round_trip(local):
    """numpy arrays of several dtypes, 2-D, and array.array arrive intact."""
    import array

    w, ep = local.w, local.ep
    arrays = [
        np.arange(1000, dtype=np.int16),
        np.linspace(0, 1, 4096, dtype=np.float64),
        np.arange(12 * 700, dtype=np.float32).reshape(12, 700),
        (np.arange(3000) * 1j).astype(np.complex128),
        np.array([True, False] * 100),
    ]
    for a in arrays:
        out = np.empty_like(a)
        await asyncio.gather(ep.tag_send(a, 22), w.tag_recv(out, 22))
        np.testing.assert_array_equal(out, a)
    src = array.array("i", range(5000))
    dst = array.array("i", bytes(len(src) * src.itemsize))
    await asyncio.gather(ep.tag_send(src, 23), w.tag_recv(dst, 23))
    assert dst == src


# ------------------------------------------------------------------ immediate completion
async def _warm_up(w, ep):
    out = bytearray(1)
    await asyncio.gather(ep.tag_send(b"x", 1), w.tag_recv(out, 1))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("mode", ["blocking", "polling"])
async def test_immediate_completion_does_not_yield(mode):
    from _util import Local

    loc = Local("tcp", mode)
    loop = asyncio.get_running_loop()
    loc.w.start(loop)
    try:
        w, ep = loc.w, loc.ep
        await _warm_up(w, ep)
        # An eager send that UCX completes inline ...
        s = ep.tag_send(b"y" * 100, 30)
        assert s.done()
        finished, value = drive(s)
        assert finished and value is None
        # ... and a receive matching a message that already arrived.
        for _ in range(100):
            w.progress()
        out = bytearray(100)
        r = w.tag_recv(out, 30)
        assert r.done(), "the message had arrived: the receive should complete inline"
        counter = TurnCounter(loop)
        try:
            t0 = counter.turns
            assert await r == 100
            s2 = ep.tag_send(b"z" * 10, 31)
            assert s2.done()
            await s2
            assert counter.turns == t0, "await of a completed request yielded to the loop"
        finally:
            counter.stop()
        assert out == b"y" * 100
        out = bytearray(10)
        assert await w.tag_recv(out, 31) == 10 and out == b"z" * 10
        # Contrast: a receive with nothing to match suspends the task.
        r = w.tag_recv(out, 33)
        loop.call_later(0.01, lambda: ep.tag_send(b"v" * 10, 33))
        counter = TurnCounter(loop)
        try:
            t0 = counter.turns
            assert await r == 10 and out == b"v" * 10
            assert counter.turns > t0
        finally:
            counter.stop()
        r = w.tag_recv(out, 32)
        finished, fut = drive(r)
        while not finished and fut is None:
            # a busy yield (a wake-up came late: the loop looked busy)
            await asyncio.sleep(0)
            finished, fut = drive(r)
        assert not finished and isinstance(fut, asyncio.Future)
        await ep.tag_send(b"w" * 10, 32)
        assert await r == 10 and out == b"w" * 10
    finally:
        loc.close()


@pytest.mark.timeout(30)
async def test_reused_requests_start_fresh(local):
    """Dead Requests are kept for reuse: a reused one must carry nothing of
    its previous life (status, result, buffer export, future)."""
    w, ep = local.w, local.ep
    await _warm_up(w, ep)
    for i in range(40):
        out = bytearray(8)
        # completed inline: a send, then the receive of what already arrived
        await ep.tag_send(b"abcdefgh", 40)
        for _ in range(50):
            w.progress()
            if w.npending == 0:
                break
        r = w.tag_recv(out, 40)
        assert await r == 8 and out == b"abcdefgh"
        del r
        # a fresh pending receive reuses a dead Request's memory
        out2 = bytearray(4)
        p = w.tag_recv(out2, 41)
        assert not p.done() and p.status == 1
        with pytest.raises(asyncio.InvalidStateError):
            p.result()
        with pytest.raises(BufferError):
            out2.extend(b"x")  # exported: the pending receive holds it
        if i % 2:
            assert p.cancel()
            with pytest.raises(U.UCXCanceledError):
                await p
        else:
            await ep.tag_send(b"1234", 41)
            assert await p == 4 and out2 == b"1234"
        del p
        out2.extend(b"x")  # released once the request is done
    assert w.npending == 0


# ------------------------------------------------------------------ truncation
@pytest.mark.timeout(30)
@pytest.mark.parametrize("order", ["recv-first", "send-first"])
@pytest.mark.parametrize("size", [100, THRESH + 1, MiB], ids=["eager", "rndv", "1MiB"])
async def test_truncation(local, size, order):
    w, ep = local.w, local.ep
    small = bytearray(10)
    if order == "recv-first":
        r = w.tag_recv(small, 40)
        s = ep.tag_send(pattern(size), 40)
    else:
        s = ep.tag_send(pattern(size), 40)
        for _ in range(50):  # let the message (or its announcement) arrive
            w.progress()
        r = w.tag_recv(small, 40)
    with pytest.raises(U.UCXMessageTruncatedError):
        await asyncio.wait_for(r, 10)
    try:
        await asyncio.wait_for(s, 10)
    except U.UCXError:
        pass  # the sender may or may not learn about it
    assert r.done() and r.status < 0
    # the endpoint and tag still work
    out = bytearray(size)
    await asyncio.gather(ep.tag_send(pattern(size, 9), 40), w.tag_recv(out, 40))
    assert out == pattern(size, 9)
    assert w.npending == 0


# ------------------------------------------------------------------ cancellation
@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["cancel", "task"])
@pytest.mark.parametrize("api", ["worker", "endpoint", "recv"])
async def test_cancel_pending_recv_then_reuse(local, how, api):
    w, ep = local.w, local.ep
    ep.send_tag = ep.recv_tag = 50
    size = THRESH + 1
    buf = bytearray(size)
    rc0 = sys.getrefcount(buf)
    post = {
        "worker": lambda b: w.tag_recv(b, 50),
        "endpoint": lambda b: ep.tag_recv(b, 50),
        "recv": lambda b: ep.recv(b),
    }[api]
    n0 = w.npending
    r = post(buf)
    assert not r.done() and w.npending == n0 + 1
    if how == "cancel":
        assert r.cancel() is True
        with pytest.raises(U.UCXCanceledError):
            await r
    else:
        async def waiter():
            return await r

        t = asyncio.ensure_future(waiter())
        for _ in range(3):
            await asyncio.sleep(0)
        assert not t.done()
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        for _ in range(3):
            await asyncio.sleep(0)
        assert r.done()
        with pytest.raises(U.UCXCanceledError):
            r.result()
    assert r.status == UCS_ERR_CANCELED
    assert r.cancel() is False
    assert w.npending == n0
    del r
    gc.collect()
    assert sys.getrefcount(buf) == rc0
    # Reuse: the next message on the same tag lands in the new buffer.
    data = pattern(size, 5)
    out = bytearray(size)
    r2 = post(out)
    await ep.tag_send(data, 50)
    assert await asyncio.wait_for(r2, 10) == size
    assert out == data
    assert buf == bytearray(size), "a cancelled receive wrote into its buffer"


@pytest.mark.timeout(30)
async def test_cancel_send_is_refused(local):
    s = local.ep.tag_send(pattern(4 * MiB), 51)
    assert s.cancel() is False
    out = bytearray(4 * MiB)
    await asyncio.gather(s, local.w.tag_recv(out, 51))
    assert out == pattern(4 * MiB)


# ------------------------------------------------------------------ argument errors
def _posts(w, ep):
    return {
        "worker.tag_recv": lambda b: w.tag_recv(b, 60),
        "ep.tag_recv": lambda b: ep.tag_recv(b, 60),
        "ep.recv": lambda b: ep.recv(b),
        "ep.tag_send": lambda b: ep.tag_send(b, 60),
        "ep.send": lambda b: ep.send(b),
        "ep.am_send": lambda b: ep.am_send(b),
        "ep.stream_send": lambda b: ep.stream_send(b),
    }


async def _check_still_works(w, ep):
    data = pattern(THRESH + 1, 11)
    out = bytearray(THRESH + 1)
    await asyncio.wait_for(asyncio.gather(ep.tag_send(data, 61), w.tag_recv(out, 61)), 10)
    assert out == data


@pytest.mark.timeout(30)
@pytest.mark.parametrize("bad", [1, "text", None, [1, 2], 1.5, object()],
                         ids=["int", "str", "None", "list", "float", "object"])
async def test_wrong_buffer_type(local, bad):
    w, ep = local.w, local.ep
    n0 = w.npending
    for name, post in _posts(w, ep).items():
        with pytest.raises(TypeError):
            post(bad)
        assert w.npending == n0, name
    await _check_still_works(w, ep)


READ_ONLY = {
    "bytes": lambda: b"abcdefgh" * 4,
    "memoryview-bytes": lambda: memoryview(b"abcdefgh" * 4),
    "readonly-memoryview": lambda: memoryview(bytearray(32)).toreadonly(),
    "numpy-readonly": lambda: np.frombuffer(b"\0" * 32, dtype=np.uint8),
}
NON_CONTIGUOUS = {
    "numpy-step": lambda: np.zeros(64, dtype=np.uint8)[::2],
    "numpy-2d-column": lambda: np.zeros((8, 8), dtype=np.float32)[:, 1],
    "numpy-transposed": lambda: np.zeros((4, 8), dtype=np.int32).T,
    "memoryview-step": lambda: memoryview(bytearray(64))[::2],
}




def kinds(table):
    return list(table)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", kinds(READ_ONLY))
async def test_read_only_recv_buffer(local, kind):
    w, ep = local.w, local.ep
    n0 = w.npending
    for name, post in _posts(w, ep).items():
        if "recv" not in name:
            continue
        with pytest.raises(BufferError):
            post(READ_ONLY[kind]())
        assert w.npending == n0, name
    await _check_still_works(w, ep)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", kinds(NON_CONTIGUOUS))
async def test_non_contiguous_buffer(local, kind):
    w, ep = local.w, local.ep
    n0 = w.npending
    for name, post in _posts(w, ep).items():
        buf = NON_CONTIGUOUS[kind]()
        rc0 = sys.getrefcount(buf)
        with pytest.raises(BufferError):
            post(buf)
        assert w.npending == n0, name
        assert sys.getrefcount(buf) == rc0, name
    await _check_still_works(w, ep)


@pytest.mark.timeout(30)
async def test_bad_tags(local_tcp):
    w, ep = local_tcp.w, local_tcp.ep
    with pytest.raises(TypeError):
        w.tag_recv(bytearray(1), "1")
    with pytest.raises(ValueError):
        w.tag_recv(bytearray(1), -1)
    with pytest.raises(ValueError):
        ep.tag_send(b"x", 1 << 64)
    with pytest.raises(TypeError):
        ep.send(b"x", tag=1.5)  # a user tag is an int, str or bytes
    with pytest.raises(TypeError):
        ep.send(b"x", tag=("a",))
    with pytest.raises(TypeError):
        ep.send(b"x", tag="a", force_tag=True)  # a forced tag is the UCX tag
    assert w.npending == 0
    await _check_still_works(w, ep)


@pytest.mark.timeout(30)
async def test_tag_mask(local_tcp):
    w, ep = local_tcp.w, local_tcp.ep
    out = bytearray(4)
    r = w.tag_recv(out, 0xAB00, 0xFF00)
    await ep.tag_send(b"mask", 0xAB42)
    assert await r == 4 and out == b"mask"


# ------------------------------------------------------------------ two processes
@pytest.mark.timeout(120)
@pytest.mark.parametrize("tl", ["tcp", "shm", "shm_eh"])
async def test_two_process_sizes(tl):
    s = await _peer.connect(tl, "echo")
    try:
        assert s.peer_info["error_handling"] == (tl != "shm")
        assert s.ep.error_handling == (tl != "shm")
        w, ep = s.w, s.ep
        for size in SIZES:
            data = pattern(size, 4)
            out = bytearray(size)
            r = ep.tag_recv(out, 3)
            await ep.tag_send(struct.pack("<Q", size), 1)
            await ep.tag_send(data, 2)
            assert await asyncio.wait_for(r, 60) == size, size
            assert out == data, size
        # every buffer kind, both directions
        for size in (1024, THRESH + 8):
            data = pattern(size, 6)
            sends = send_buffers(data)
            for (rname, rbuf), (sname, sbuf) in zip(recv_buffers(size), sends * 2):
                r = w.tag_recv(rbuf, 3)
                await ep.tag_send(struct.pack("<Q", size), 1)
                await ep.tag_send(sbuf, 2)
                assert await asyncio.wait_for(r, 30) == size
                assert as_bytes(rbuf) == data, (rname, sname)
        await ep.tag_send(struct.pack("<Q", _peer.STOP), 1)
        n_kinds = len(recv_buffers(1024)) + len(recv_buffers(THRESH + 8))
        assert (await s.done())["messages"] == len(SIZES) + n_kinds
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
async def test_two_process_pipelined(tl):
    """Many messages in flight at once, receives posted before the sends."""
    s = await _peer.connect(tl, "echo")
    try:
        w, ep = s.w, s.ep
        sizes = [(i * 977) % (3 * THRESH) for i in range(300)]
        outs = [bytearray(n) for n in sizes]
        recvs = [ep.tag_recv(o, 3) for o in outs]
        sends = []
        for i, n in enumerate(sizes):
            sends.append(ep.tag_send(struct.pack("<Q", n), 1))
            sends.append(ep.tag_send(pattern(n, i), 2))
        await asyncio.wait_for(asyncio.gather(*sends, *recvs), 60)
        for i, (n, o) in enumerate(zip(sizes, outs)):
            assert o == pattern(n, i), i
        await ep.tag_send(struct.pack("<Q", _peer.STOP), 1)
        assert (await s.done())["messages"] == len(sizes)
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tl", ["tcp", "shm"])
async def test_two_process_truncation_and_cancel(tl):
    """Across processes: a too-small receive fails with truncation, a
    cancelled receive takes nothing, and the endpoint carries on."""
    s = await _peer.connect(tl, "echo")
    try:
        w, ep = s.w, s.ep

        async def echo(size, seed, out):
            r = ep.tag_recv(out, 3)
            await ep.tag_send(struct.pack("<Q", size), 1)
            await ep.tag_send(pattern(size, seed), 2)
            return await asyncio.wait_for(r, 30)

        for size in (100, THRESH + 1, MiB):
            with pytest.raises(U.UCXMessageTruncatedError):
                await echo(size, 1, bytearray(10))
            out = bytearray(size)
            assert await echo(size, 2, out) == size and out == pattern(size, 2)
            # a pending receive cancelled before the echo comes
            stale = bytearray(size)
            r = ep.tag_recv(stale, 3)
            assert r.cancel()
            with pytest.raises(U.UCXCanceledError):
                await r
            out = bytearray(size)
            assert await echo(size, 3, out) == size and out == pattern(size, 3)
            assert stale == bytearray(size)
        assert w.npending == 0
        await ep.tag_send(struct.pack("<Q", _peer.STOP), 1)
        assert (await s.done())["messages"] == 9
        await s.finish()
    finally:
        s.close()


# ------------------------------------------------------------------ stream API
@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [1, 1000, THRESH + 1, MiB], ids=["1", "1000", "thresh+1", "1MiB"])
async def test_stream_send_recv(local_tcp, size):
    """stream_recv waits for exactly len(buf) bytes, however they arrive."""
    ep = local_tcp.ep
    data = pattern(size, 8)
    out = bytearray(size)
    r = ep.stream_recv(out)
    half = size // 2
    await ep.stream_send(data[:half])
    await ep.stream_send(data[half:])
    assert await asyncio.wait_for(r, 10) == size
    assert out == data


@pytest.mark.timeout(30)
async def test_request_result_and_repr(local_tcp):
    w, ep = local_tcp.w, local_tcp.ep
    out = bytearray(3)
    r = w.tag_recv(out, 70)
    assert "pending" in repr(r)
    await asyncio.gather(ep.tag_send(b"abc", 70), r)
    assert r.result() == 3 and r.result() == 3
    assert await r == 3  # awaiting again returns the same result
    assert "pending" not in repr(r)
    r = w.tag_recv(bytearray(1), 71)
    r.cancel()
    for _ in range(2):
        with pytest.raises(U.UCXCanceledError):
            r.result()
    with pytest.raises(U.UCXCanceledError):
        await r
