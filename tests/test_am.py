"""Active messages: am_send / am_recv sizes (eager and rendezvous), queueing
until received, allocators, and pending receives failing on close."""

import asyncio
import sys

import numpy as np
import pytest

import _peer
from _util import THRESH, MiB, local, pattern  # noqa: F401
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]

SIZES = [0, 1, 8 * 1024, MiB, 16 * MiB]
SIZE_IDS = ["0", "1", "8KiB", "1MiB", "16MiB"]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", SIZES, ids=SIZE_IDS)
async def test_am_sizes(local, size):
    ep = local.ep
    data = pattern(size, 1)
    s = ep.am_send(data)
    got = await asyncio.wait_for(ep.am_recv(), 30)
    await asyncio.wait_for(s, 30)
    assert isinstance(got, bytearray)
    assert len(got) == size and got == data
    # receive posted before the message exists
    r = ep.am_recv()
    assert not r.done()
    await ep.am_send(np.frombuffer(data, np.uint8) if size else b"")
    got = await asyncio.wait_for(r, 30)
    assert got == data


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [100, THRESH + 1, MiB], ids=["eager", "rndv", "1MiB"])
async def test_am_queued_in_order(local, size):
    ep = local.ep
    msgs = [pattern(size, i) for i in range(5)]
    sends = [ep.am_send(m) for m in msgs]
    await asyncio.wait_for(asyncio.gather(*sends), 30)
    # give every message time to arrive and be queued
    for _ in range(20):
        await asyncio.sleep(0.001)
    got = [await asyncio.wait_for(ep.am_recv(), 10) for _ in range(5)]
    assert got == msgs
    # nothing left
    r = ep.am_recv()
    await asyncio.sleep(0.01)
    assert not r.done()
    await ep.am_send(b"last")
    assert await asyncio.wait_for(r, 10) == b"last"


@pytest.mark.timeout(60)
async def test_am_many_waiters(local):
    """Several am_recv pending at once are served in the order posted."""
    ep = local.ep
    recvs = [ep.am_recv() for _ in range(10)]
    for i in range(10):
        await ep.am_send(bytes([i]) * (i + 1))
    got = await asyncio.wait_for(asyncio.gather(*recvs), 10)
    assert got == [bytes([i]) * (i + 1) for i in range(10)]


@pytest.mark.timeout(60)
@pytest.mark.parametrize("size", [0, 100, THRESH + 1, 2 * MiB], ids=["0", "eager", "rndv", "2MiB"])
async def test_am_allocator(local, size):
    w, ep = local.w, local.ep
    calls = []

    def alloc(n):
        calls.append(n)
        return np.empty(n, "u1")

    w.register_am_allocator(U.MEMORY_TYPE_HOST, alloc)
    data = pattern(size, 3)
    await ep.am_send(data)
    got = await asyncio.wait_for(ep.am_recv(), 10)
    assert isinstance(got, np.ndarray) and got.dtype == np.uint8
    assert got.tobytes() == data
    assert calls == [size]
    # another allocator replaces it
    w.register_am_allocator(U.MEMORY_TYPE_HOST, lambda n: bytearray(n))
    await ep.am_send(data)
    got = await asyncio.wait_for(ep.am_recv(), 10)
    assert isinstance(got, bytearray) and got == data


@pytest.mark.timeout(30)
async def test_am_allocator_errors_surface(local):
    w, ep = local.w, local.ep

    def failing(n):
        raise MemoryError("no room")

    w.register_am_allocator(U.MEMORY_TYPE_HOST, failing)
    await ep.am_send(b"abc")
    with pytest.raises(MemoryError, match="no room"):
        await asyncio.wait_for(ep.am_recv(), 10)
    w.register_am_allocator(U.MEMORY_TYPE_HOST, lambda n: 42)
    await ep.am_send(b"abc")
    with pytest.raises(TypeError):
        await asyncio.wait_for(ep.am_recv(), 10)
    # the endpoint still delivers once the allocator is sane again
    w.register_am_allocator(U.MEMORY_TYPE_HOST, bytearray)
    await ep.am_send(b"fine")
    assert await asyncio.wait_for(ep.am_recv(), 10) == b"fine"
    with pytest.raises(TypeError):
        w.register_am_allocator("host", bytearray)
    with pytest.raises(TypeError):
        w.register_am_allocator(U.MEMORY_TYPE_HOST, 5)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("size", [
    pytest.param(100, id="eager"),
    pytest.param(THRESH + 1, id="rndv"),
])
async def test_am_allocator_too_small_is_an_error(local, size):
    """An allocator that returns fewer bytes than the message must not make
    am_recv return silently truncated data."""
    w, ep = local.w, local.ep
    w.register_am_allocator(U.MEMORY_TYPE_HOST, lambda n: bytearray(n // 2))
    await ep.am_send(pattern(size))
    with pytest.raises((U.UCXError, BufferError, ValueError)):
        got = await asyncio.wait_for(ep.am_recv(), 10)
        pytest.fail(f"am_recv returned {len(got)} of {size} bytes without an error")


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how", ["close", "abort"])
async def test_am_recv_pending_then_endpoint_closed(local, how):
    ep = local.ep
    r = ep.am_recv()
    r2 = ep.am_recv()

    async def waiter():
        return await r2

    t = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    assert not r.done()
    if how == "close":
        await ep.close()
    else:
        ep.abort()
    with pytest.raises(U.UCXCanceledError):
        await asyncio.wait_for(r, 5)
    with pytest.raises(U.UCXCanceledError):
        await asyncio.wait_for(t, 5)
    with pytest.raises(U.UCXCloseError):
        ep.am_recv()


@pytest.mark.timeout(30)
async def test_am_send_buffer_released(local):
    ep = local.ep
    for size in (10, 2 * MiB):
        src = bytearray(pattern(size))
        rc = sys.getrefcount(src)
        s = ep.am_send(src)
        got = await asyncio.wait_for(ep.am_recv(), 10)
        await s
        assert got == src
        assert sys.getrefcount(src) == rc


@pytest.mark.timeout(90)
@pytest.mark.parametrize("tl", ["tcp", "shm", "shm_eh"])
async def test_am_two_processes(tl):
    s = await _peer.connect(tl, "am_echo", count=len(SIZES) + 5)
    try:
        ep = s.ep
        for size in SIZES:
            data = pattern(size, 5)
            await asyncio.wait_for(ep.am_send(data), 30)
            got = await asyncio.wait_for(ep.am_recv(), 30)
            assert got == data, size
        # queued on the way back
        for i in range(5):
            await ep.am_send(pattern(1000, i))
        got = [await asyncio.wait_for(ep.am_recv(), 10) for _ in range(5)]
        assert got == [pattern(1000, i) for i in range(5)]
        assert (await s.done())["messages"] == len(SIZES) + 5
        await s.finish()
    finally:
        s.close()


@pytest.mark.timeout(30)
async def test_dropped_am_recv_does_not_swallow_a_message(local):
    import gc

    ep = local.ep
    ep.am_recv()  # the Request is dropped while waiting
    gc.collect()
    await ep.am_send(b"kept")
    await asyncio.sleep(0.01)
    assert await asyncio.wait_for(ep.am_recv(), 10) == b"kept"


@pytest.mark.timeout(30)
async def test_cancelled_am_recv_task_does_not_swallow_a_message(local):
    ep = local.ep
    r = ep.am_recv()

    async def waiter():
        return await r

    t = asyncio.ensure_future(waiter())
    await asyncio.sleep(0)
    t.cancel()
    with pytest.raises(asyncio.CancelledError):
        await t
    assert r.done()
    with pytest.raises(U.UCXCanceledError):
        r.result()
    await ep.am_send(b"next")
    assert await asyncio.wait_for(ep.am_recv(), 10) == b"next"
    # cancel() on a waiting am_recv too
    r = ep.am_recv()
    assert r.cancel() is True
    with pytest.raises(U.UCXCanceledError):
        await r
    await ep.am_send(b"again")
    assert await asyncio.wait_for(ep.am_recv(), 10) == b"again"
