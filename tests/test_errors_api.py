"""Failure paths: bad peers, dead peers, bad arguments, reset, callbacks."""

import asyncio
import logging
import os
import signal
import time

import pytest

import ucxx
import ucxx.core
from conftest import child_env, free_port
from ucxx._lib_async import exchange_peer_info as hs

pytestmark = pytest.mark.leak_check

HOST = "127.0.0.1"


async def _timed(coro):
    t0 = time.monotonic()
    try:
        await coro
    except BaseException as e:
        return e, time.monotonic() - t0
    return None, time.monotonic() - t0


# --------------------------------------------------------------- connecting
async def test_connect_nobody_listening():
    port = free_port()
    err, dt = await _timed(ucxx.create_endpoint(HOST, port, connect_timeout=3))
    assert isinstance(err, ucxx.UCXError), repr(err)
    assert str(port) in str(err)
    assert dt < 3 + 2


@pytest.mark.parametrize(
    "ip,port,needle",
    [
        ("300.1.2.3", 1234, "300.1.2.3"),
        ("no such host name!", 1234, "no such host name!"),
        ("", 1234, "''"),
        (HOST, -1, "-1"),
        (HOST, 70000, "70000"),
        (HOST, "80", "'80'"),
    ],
)
async def test_bad_address(ip, port, needle):
    with pytest.raises((ValueError, ucxx.UCXConfigError)) as ei:
        await ucxx.create_endpoint(ip, port)
    assert needle in str(ei.value)


def test_bad_listener_port():
    with pytest.raises(ValueError, match="70000"):
        ucxx.create_listener(lambda ep: None, port=70000)


async def _raw_tcp_server(answer: bytes | None):
    """A plain TCP server: never answers (None) or answers ``answer``."""
    writers = []

    async def handle(reader, writer):
        writers.append(writer)
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        try:
            await reader.read()  # hold the connection until the peer goes
        except ConnectionError:
            pass

    server = await asyncio.start_server(handle, HOST, 0)
    return server, writers


@pytest.mark.parametrize(
    "answer",
    [None, b"\x00" * 4096, os.urandom(4096), b"HTTP/1.1 400 Bad Request\r\n\r\n"],
    ids=["silent", "zeros", "random", "http"],
)
async def test_handshake_raw_tcp_server(answer):
    server, writers = await _raw_tcp_server(answer)
    port = server.sockets[0].getsockname()[1]
    timeout = 1.5
    try:
        err, dt = await _timed(ucxx.create_endpoint(HOST, port, connect_timeout=timeout))
        assert isinstance(err, ucxx.UCXError), repr(err)
        assert dt < timeout + 2, dt
        if answer is None:
            assert isinstance(err, ucxx.UCXTimedOutError), repr(err)
    finally:
        for w in writers:
            w.close()
            try:
                await w.wait_closed()
            except OSError:
                pass
        server.close()
        await server.wait_closed()
    # the aborted endpoint is gone: nothing still references the context
    assert ucxx.core._get_ctx().live_objects() == []


class RawListener:
    """A listener below the handshake: ``on_ep(c_ep)`` gets the C endpoint."""

    def __init__(self, on_ep):
        self.eps = []
        self.reqs = []

        def cb(c_ep):
            self.eps.append(c_ep)
            r = on_ep(c_ep)
            if r is not None:
                self.reqs.append(r)

        self.listener = ucxx.core._get_ctx().worker.listen(cb, port=0, host=HOST)

    def close(self):
        self.listener.close()
        for ep in self.eps:
            ep.abort()


@pytest.mark.parametrize(
    "payload,match",
    [
        (b"X" * hs.MSG_SIZE, "bad magic"),
        (hs.pack(1, 2, version=99), "version 99"),
        (hs.pack(1, 2)[:-1] + b"\x00", "checksum"),
    ],
    ids=["magic", "version", "checksum"],
)
async def test_handshake_ucx_peer_sends_garbage(payload, match):
    raw = RawListener(lambda c_ep: c_ep.stream_send(payload))
    try:
        err, dt = await _timed(ucxx.create_endpoint(HOST, raw.listener.port, connect_timeout=3))
        assert isinstance(err, ucxx.UCXError), repr(err)
        assert match in str(err)
        assert dt < 3
    finally:
        raw.close()


async def test_handshake_ucx_peer_silent():
    raw = RawListener(lambda c_ep: None)
    try:
        err, dt = await _timed(ucxx.create_endpoint(HOST, raw.listener.port, connect_timeout=1))
        assert isinstance(err, ucxx.UCXTimedOutError), repr(err)
        assert 0.9 < dt < 3
    finally:
        raw.close()


async def test_handshake_ucx_peer_short_message():
    raw = RawListener(lambda c_ep: c_ep.stream_send(hs.pack(1, 2)[:20]))
    try:
        err, dt = await _timed(ucxx.create_endpoint(HOST, raw.listener.port, connect_timeout=1))
        assert isinstance(err, ucxx.UCXTimedOutError), repr(err)
        assert dt < 3
    finally:
        raw.close()


@pytest.mark.parametrize("client", ["silent", "garbage"])
async def test_listener_drops_bad_client(caplog, client):
    calls = []
    lst = ucxx.create_listener(calls.append, host=HOST, connect_timeout=1)
    worker = ucxx.core._get_ctx().worker
    c_ep = worker.ep_from_sockaddr(HOST, lst.port)
    try:
        with caplog.at_level(logging.WARNING, logger="ucx"):
            if client == "garbage":
                await c_ep.stream_send(b"G" * hs.MSG_SIZE)
            deadline = time.monotonic() + 5
            while not any("dropped" in r.getMessage() for r in caplog.records):
                assert time.monotonic() < deadline, "the listener did not drop the client"
                await asyncio.sleep(0.05)
        assert calls == []
        assert lst.active_clients == 0
    finally:
        c_ep.abort()
        lst.close()


# ------------------------------------------------------------------ reset
@pytest.mark.no_ctx
async def test_reset_with_live_endpoint_names_it():
    accepted = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    sep = await asyncio.wait_for(accepted.get(), 10)
    lst.close()
    with pytest.raises(ucxx.UCXError) as ei:
        ucxx.reset()
    assert f"{ep.uid:#x}" in str(ei.value)
    assert f"{sep.uid:#x}" in str(ei.value)
    # Detached all the same: the next call gets a new context, the old one
    # stays usable for these endpoints until a later reset() closes it.
    assert ucxx.core._ctx is None
    old = ep._ctx
    assert ucxx.core._retired == [old]
    ucxx.reset()  # they are still open: nothing to raise about, nothing closed
    assert ucxx.core._retired == [old] and not old.worker.closed
    await ep.send(b"x")
    assert await sep.recv(bytearray(1)) == 1
    await ep.close()
    await sep.close()
    ucxx.reset()
    assert ucxx.core._ctx is None and ucxx.core._retired == []
    assert old.worker.closed


@pytest.mark.no_ctx
def test_reset_with_live_listener():
    lst = ucxx.create_listener(lambda ep: None, host=HOST)
    with pytest.raises(ucxx.UCXError, match="Listener"):
        ucxx.reset()
    lst.close()
    ucxx.reset()


@pytest.mark.no_ctx
def test_reset_after_objects_dropped():
    lst = ucxx.create_listener(lambda ep: None, host=HOST)
    del lst
    ucxx.reset()
    assert ucxx.core._ctx is None


# --------------------------------------------------------- listener callback
@pytest.mark.parametrize("kind", ["function", "coroutine"])
async def test_listener_callback_exception_is_logged(caplog, kind):
    loop = asyncio.get_running_loop()
    loop_errors = []
    loop.set_exception_handler(lambda loop, ctx: loop_errors.append(ctx))
    seen = asyncio.Event()

    if kind == "function":
        def cb(ep):
            seen.set()
            ep.abort()
            raise RuntimeError("boom from the callback")
    else:
        async def cb(ep):
            seen.set()
            ep.abort()
            raise RuntimeError("boom from the callback")

    lst = ucxx.create_listener(cb, host=HOST)
    try:
        with caplog.at_level(logging.ERROR, logger="ucx"):
            ep = await ucxx.create_endpoint(HOST, lst.port)
            await asyncio.wait_for(seen.wait(), 10)
            for _ in range(20):
                await asyncio.sleep(0.01)
        # Logged as text (traceback included), so that the record keeps no
        # frame, endpoint or context alive.
        recs = [r for r in caplog.records if "RuntimeError: boom" in r.getMessage()]
        assert recs, caplog.text
        assert all(r.exc_info is None for r in recs)
        await ep.close()
    finally:
        lst.close()
        loop.set_exception_handler(None)
    assert loop_errors == []


# -------------------------------------------------------------- dead peers
ACCEPT_AND_IDLE = """
import asyncio, ucxx

async def main():
    eps = []
    def handler(ep):
        eps.append(ep)
        print("ACCEPTED", flush=True)
    lst = ucxx.create_listener(handler, host="127.0.0.1")
    print("PORT", lst.port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


async def _connect_to_idle_peer(run_peer, transport):
    peer = run_peer(ACCEPT_AND_IDLE, env=child_env(transport))
    port = int(await peer.expect("PORT"))
    ep = await ucxx.create_endpoint(HOST, port)
    await peer.expect("ACCEPTED")
    return peer, ep


async def test_peer_killed_during_recv(run_peer, transport):
    peer, ep = await _connect_to_idle_peer(run_peer, transport)
    calls = []
    ep.set_close_callback(lambda: calls.append(1))
    pending = asyncio.ensure_future(ep.recv(bytearray(100)))
    await asyncio.sleep(0.2)
    assert not pending.done()
    os.kill(peer.pid, signal.SIGKILL)
    err, dt = await _timed(asyncio.wait_for(pending, 10))
    assert isinstance(err, ucxx.UCXError), repr(err)
    assert dt < 10
    await asyncio.sleep(0.05)
    assert calls == [1]
    assert not ep.alive
    await ep.close()


async def test_peer_killed_during_large_send(run_peer, transport):
    import numpy as np

    peer, ep = await _connect_to_idle_peer(run_peer, transport)
    data = np.ones(64 << 20, dtype=np.uint8)
    pending = asyncio.ensure_future(ep.send(data))
    await asyncio.sleep(0.3)
    os.kill(peer.pid, signal.SIGKILL)
    err, dt = await _timed(asyncio.wait_for(pending, 10))
    if err is None:
        # The whole message left before the kill (UCX buffered it); the next
        # operation must then fail instead.
        err, dt = await _timed(asyncio.wait_for(ep.recv(bytearray(1)), 10))
    assert isinstance(err, ucxx.UCXError), repr(err)
    assert dt < 10
    await ep.close()


# ------------------------------------------------------------ misc errors
async def test_operations_after_close_raise():
    lst = ucxx.create_listener(lambda ep: None, host=HOST)
    try:
        ep = await ucxx.create_endpoint(HOST, lst.port)
        await ep.close()
        for op in (lambda: ep.send(b"x"), lambda: ep.recv(bytearray(1)),
                   lambda: ep.send_obj(b"x"), lambda: ep.recv_obj()):
            with pytest.raises(ucxx.UCXError):
                await op()
    finally:
        lst.close()


async def test_truncated_message():
    got = asyncio.Queue()
    lst = ucxx.create_listener(got.put_nowait, host=HOST)
    try:
        ep = await ucxx.create_endpoint(HOST, lst.port)
        sep = await asyncio.wait_for(got.get(), 10)
        r = asyncio.ensure_future(sep.recv(bytearray(2)))
        await ep.send(b"too long")
        with pytest.raises(ucxx.UCXMessageTruncatedError):
            await r
        await ep.close()
        await sep.close()
    finally:
        lst.close()


async def test_bad_worker_address_type():
    with pytest.raises(TypeError):
        await ucxx.create_endpoint_from_worker_address(12345)
