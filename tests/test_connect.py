"""Connections: listener + endpoints, tags, close, composite messages."""

import asyncio
import gc
import random
import struct
import weakref

import numpy as np
import pytest

import ucxx
import ucxx.core
from conftest import child_env

pytestmark = pytest.mark.leak_check

HOST = "127.0.0.1"


class Server:
    """A listener on 127.0.0.1 that hands accepted endpoints to a queue (or
    runs ``handler`` on them) and records handler errors."""

    def __init__(self, handler=None, **kwargs):
        self.endpoints: asyncio.Queue = asyncio.Queue()
        self.errors: list = []
        self.handler = handler

        async def cb(ep):
            self.endpoints.put_nowait(ep)
            if self.handler is not None:
                try:
                    await self.handler(ep)
                except Exception as e:  # recorded, asserted by the test
                    self.errors.append(e)

        self.listener = ucxx.create_listener(cb, host=HOST, **kwargs)

    @property
    def port(self):
        return self.listener.port

    async def accept(self, timeout=10):
        return await asyncio.wait_for(self.endpoints.get(), timeout)

    def close(self):
        self.listener.close()


async def echo_obj(ep):
    while True:
        try:
            msg = await ep.recv_obj()
        except ucxx.UCXError:
            return
        await ep.send_obj(msg)


# ------------------------------------------------------------------ basics
async def test_endpoint_same_process(transport):
    server = Server(echo_obj)
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        assert ep.alive and not ep.closed and not ep.closed()
        assert isinstance(ep.uid, int) and ep.uid != sep.uid
        for size in (0, 1, 100, 8192, 1 << 20):
            data = np.random.randint(0, 255, size, dtype=np.uint8)
            await ep.send_obj(data)
            back = await ep.recv_obj()
            assert bytes(back) == data.tobytes()
        await ep.close()
        assert ep.closed and ep.closed() and not ep.alive
    finally:
        server.close()
    assert not server.errors


@pytest.mark.no_ctx
@pytest.mark.parametrize("mode", ["blocking", "polling", "thread", "thread-polling"])
async def test_progress_modes(mode):
    ucxx.init(progress_mode=mode)
    assert ucxx.core._ctx.progress_mode == mode
    server = Server(echo_obj)
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        for i in range(50):
            await ep.send_obj(b"x" * i)
            assert bytes(await ep.recv_obj()) == b"x" * i
        await ep.close()
    finally:
        server.close()
    assert not server.errors


async def test_hot_path_is_c():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        # The per-message methods are the C endpoint's bound methods.
        for name in ("send", "recv", "gather_send", "gather_recv", "am_send", "am_recv"):
            meth = getattr(ep, name)
            assert type(meth).__name__ == "builtin_function_or_method", name
            assert meth.__self__ is ep._ep
        # send/recv with the handshake tags, and user tags
        buf = bytearray(5)
        req = sep.recv(buf)
        await ep.send(b"hello")
        assert await req == 5 and buf == b"hello"
        await asyncio.gather(ep.send(b"tagged", tag=42), sep.recv(buf2 := bytearray(6), tag=42))
        assert buf2 == b"tagged"
        await asyncio.gather(
            ep.send(b"forced", tag=7, force_tag=True),
            sep.recv(buf3 := bytearray(6), tag=7, force_tag=True),
        )
        assert buf3 == b"forced"
        assert ep.send_tag == sep.recv_tag and ep.recv_tag == sep.send_tag
        await ep.close()
        await sep.close()
    finally:
        server.close()


async def test_send_recv_obj():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        await ep.send_obj(b"abc")
        assert await sep.recv_obj() == bytearray(b"abc")
        await sep.send_obj(memoryview(b"0123456789")[2:5])
        got = await ep.recv_obj(allocator=lambda n: np.empty(n, dtype=np.uint8))
        assert isinstance(got, np.ndarray) and got.tobytes() == b"234"
        await ep.send_obj(b"t", tag=5)
        assert await sep.recv_obj(tag=5) == b"t"
        await ep.close()
    finally:
        server.close()


async def test_send_recv_multi():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        cases = [
            [],
            [b""],
            [b"a", b"", b"bcd"],
            [np.arange(1000, dtype=np.uint8), bytes(1 << 20)],
            [bytes([i % 256]) * (i % 7) for i in range(600)],  # table > 4 KiB
        ]
        for frames in cases:
            await asyncio.gather(ep.send_multi(frames), r := asyncio.ensure_future(sep.recv_multi()))
            got = r.result()
            assert len(got) == len(frames)
            for g, f in zip(got, frames):
                assert isinstance(g, np.ndarray) and g.dtype == np.uint8
                assert g.tobytes() == bytes(memoryview(f).cast("B"))
        # Concurrent recv_multi calls on one endpoint do not interleave.
        sends = [ep.send_multi([bytes([i]) * (i + 1), bytes([i])]) for i in range(10)]
        recvs = [sep.recv_multi() for _ in range(10)]
        res = await asyncio.gather(*recvs, *sends)
        for i, frames in enumerate(res[:10]):
            assert frames[0].tobytes() == bytes([i]) * (i + 1)
            assert frames[1].tobytes() == bytes([i])
        await ep.close()
    finally:
        server.close()


async def test_recv_multi_limits():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        sep.recv_multi_max_frames = 3
        send = asyncio.ensure_future(ep.send_multi([b"1", b"2", b"3", b"4"]))
        with pytest.raises(ucxx.UCXError, match="4 frames"):
            await sep.recv_multi()
        sep.recv_multi_max_frames = 100
        sep.recv_multi_max_bytes = 10
        with pytest.raises(ucxx.UCXError, match="bytes"):
            await asyncio.gather(ep.send_multi([bytes(11)]), sep.recv_multi())
        await send  # small eager sends complete without a matching receive
        await ep.close()
    finally:
        server.close()


async def test_gather():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        frames = [b"x" * 10, b"", b"y" * 100000]
        bufs = [bytearray(len(f)) for f in frames]
        await asyncio.gather(ep.gather_send(frames), sep.gather_recv(bufs))
        assert [bytes(b) for b in bufs] == frames
        await ep.close()
    finally:
        server.close()


async def test_am():
    server = Server()
    try:
        ep = await ucxx.create_endpoint(HOST, server.port)
        sep = await server.accept()
        await ep.am_send(b"active message")
        got = await sep.am_recv()
        assert bytes(got) == b"active message"
        await ep.close()
    finally:
        server.close()


async def test_worker_level_recv():
    addr = ucxx.get_worker_address()
    ep = await ucxx.create_endpoint_from_worker_address(addr)
    try:
        tag = 0xDEADBEEF
        buf = bytearray(4)
        r = asyncio.ensure_future(ucxx.recv(buf, tag))
        await ep.send(b"ping", tag=tag, force_tag=True)
        assert await r == 4 and buf == b"ping"
        # address as a bytes-like object
        ep2 = await ucxx.create_endpoint_from_worker_address(
            ucxx.get_ucx_address_from_buffer(memoryview(addr))
        )
        await ep2.send(b"pong", tag=tag + 1, force_tag=True)
        await ucxx.recv(buf, tag + 1)
        assert buf == b"pong"
        await ep2.close()
    finally:
        await ep.close()


# ---------------------------------------------------------- many clients
N_CLIENTS = 50
TAGS = [1, 2, 3, 7, 1000]
N_SEQ = 10
_MSG = struct.Struct("<IIQ")


async def _tag_server(ep):
    hdr = bytearray(8)
    await ep.recv(hdr)
    (cid,) = struct.unpack("<Q", hdr)

    async def per_tag(tag):
        for seq in range(N_SEQ):
            buf = bytearray(_MSG.size)
            await ep.recv(buf, tag=tag)
            c, t, s = _MSG.unpack(buf)
            assert (c, t, s) == (cid, tag, seq), f"cross-talk: got {(c, t, s)}"
            await ep.send(buf, tag=tag)

    await asyncio.gather(*(per_tag(t) for t in reversed(TAGS)))


async def _tag_client(port, cid):
    ep = await ucxx.create_endpoint(HOST, port)
    try:
        await ep.send(struct.pack("<Q", cid))

        async def receive(tag):
            for seq in range(N_SEQ):
                buf = bytearray(_MSG.size)
                await ep.recv(buf, tag=tag)
                assert _MSG.unpack(buf) == (cid, tag, seq)

        receivers = [asyncio.ensure_future(receive(t)) for t in TAGS]
        # Interleave the tags: per-tag order is kept, the order of the tags
        # changes from one round to the next.
        tags = list(TAGS)
        for seq in range(N_SEQ):
            random.shuffle(tags)
            for t in tags:
                await ep.send(_MSG.pack(cid, t, seq), tag=t)
        await asyncio.gather(*receivers)
    finally:
        await ep.close()


async def test_many_clients_interleaved_tags(transport):
    server = Server(_tag_server)
    try:
        await asyncio.wait_for(
            asyncio.gather(*(_tag_client(server.port, i) for i in range(N_CLIENTS))), 60
        )
        for _ in range(N_CLIENTS):
            await server.accept()
    finally:
        server.close()
    assert not server.errors, server.errors[:3]


# ------------------------------------------------------------------ close
async def _pair(server):
    ep = await ucxx.create_endpoint(HOST, server.port)
    sep = await server.accept()
    return ep, sep


@pytest.mark.parametrize("closer", ["client", "server"])
async def test_close_one_side(transport, closer):
    server = Server()
    try:
        ep, sep = await _pair(server)
        closing, other = (ep, sep) if closer == "client" else (sep, ep)
        calls = []
        other.set_close_callback(lambda: calls.append("other"))
        closing.set_close_callback(lambda: calls.append("closing"))
        pending = asyncio.ensure_future(other.recv(bytearray(10)))
        await asyncio.sleep(0.01)
        await closing.close()
        assert closing.closed
        with pytest.raises(ucxx.UCXCanceledError):
            await asyncio.wait_for(pending, 10)
        assert other.closed()
        await other.close()  # idempotent after the peer closed
        await closing.close()  # idempotent
        await asyncio.sleep(0.05)
        assert sorted(calls) == ["closing", "other"]
        with pytest.raises(ucxx.UCXError):
            await other.send(b"after close")
    finally:
        server.close()


async def test_close_both_at_once(transport):
    server = Server()
    try:
        ep, sep = await _pair(server)
        calls = []
        ep.set_close_callback(calls.append, cb_args=("client",))
        sep.set_close_callback(calls.append, cb_args=("server",))
        r1 = asyncio.ensure_future(ep.recv(bytearray(1)))
        r2 = asyncio.ensure_future(sep.recv(bytearray(1)))
        await asyncio.wait_for(asyncio.gather(ep.close(), sep.close()), 10)
        assert ep.closed and sep.closed
        for r in (r1, r2):
            with pytest.raises(ucxx.UCXCanceledError):
                await r
        await asyncio.sleep(0.05)
        assert sorted(calls) == ["client", "server"]
    finally:
        server.close()


async def test_close_is_idempotent_and_concurrent():
    server = Server()
    try:
        ep, sep = await _pair(server)
        a, b = ep.close(), ep.close()
        await asyncio.gather(a, b)
        await ep.close()
        ep.abort()
        sep.abort()
        sep.abort()
        assert sep.closed
    finally:
        server.close()


async def test_abort_fails_pending():
    server = Server()
    try:
        ep, sep = await _pair(server)
        r = asyncio.ensure_future(ep.recv(bytearray(4)))
        await asyncio.sleep(0.01)
        ep.abort()
        with pytest.raises(ucxx.UCXCanceledError):
            await asyncio.wait_for(r, 10)
        await sep.close()
    finally:
        server.close()


# --------------------------------------------------------------- listener
async def test_listener_properties_and_close():
    calls = []
    lst = ucxx.create_listener(calls.append, host=HOST)
    assert isinstance(lst, ucxx.Listener)
    assert lst.port > 0 and lst.ip == HOST
    assert lst.closed is False  # a bool property, as in RAPIDS ucxx
    port = lst.port
    lst.close()
    lst.close()
    assert lst.closed is True
    with pytest.raises(ucxx.UCXError):
        await ucxx.create_endpoint(HOST, port, connect_timeout=2)
    assert calls == []


async def test_listener_stops_when_collected():
    lst = ucxx.create_listener(lambda ep: None, host=HOST)
    port = lst.port
    ref = weakref.ref(lst)
    del lst
    gc.collect()
    assert ref() is None
    with pytest.raises(ucxx.UCXError):
        await ucxx.create_endpoint(HOST, port, connect_timeout=2)


async def test_listener_plain_function_callback():
    got = asyncio.Queue()
    lst = ucxx.create_listener(got.put_nowait, host=HOST)
    try:
        ep = await ucxx.create_endpoint(HOST, lst.port)
        sep = await asyncio.wait_for(got.get(), 10)
        assert isinstance(sep, ucxx.Endpoint)
        await ep.close()
        await sep.close()
    finally:
        lst.close()


async def test_listener_fixed_port():
    from conftest import free_port

    port = free_port()
    lst = ucxx.create_listener(lambda ep: None, port=port, host=HOST)
    try:
        assert lst.port == port
    finally:
        lst.close()


# ------------------------------------------------------------ two process
ECHO_SERVER = """
import asyncio, ucxx

async def main():
    done = asyncio.Event()
    async def handler(ep):
        while True:
            try:
                msg = await ep.recv_obj()
            except ucxx.UCXError:
                break
            await ep.send_obj(msg)
        done.set()
    lst = ucxx.create_listener(handler, host="127.0.0.1")
    print("PORT", lst.port, flush=True)
    await done.wait()
    lst.close()
    print("DONE", flush=True)

asyncio.run(main())
"""


async def test_two_process_echo(run_peer, transport):
    peer = run_peer(ECHO_SERVER, env=child_env(transport))
    port = int(await peer.expect("PORT"))
    ep = await ucxx.create_endpoint(HOST, port)
    for size in (1, 1000, 1 << 20):
        data = bytes(random.getrandbits(8) for _ in range(min(size, 64))) * (size // 64 + 1)
        await ep.send_obj(data)
        assert bytes(await ep.recv_obj()) == data
    await ep.close()
    assert await peer.expect("DONE") == ""
    assert await peer.wait() == 0


# Shared memory only (no tcp at all): sockaddr connections need tcp in UCX
# (the connection manager wires endpoints up over it), so this peer is
# reached by worker address, without the handshake.
ADDRESS_ECHO = """
import asyncio, ucxx

async def main():
    ucxx.continuous_ucx_progress()
    print("ADDR", ucxx.get_worker_address().hex(), flush=True)
    buf = bytearray(1 << 16)
    n = await ucxx.recv(buf, 1)
    ep = await ucxx.create_endpoint_from_worker_address(bytes(buf[:n]))
    while True:
        n = await ucxx.recv(buf, 2)
        if bytes(buf[:n]) == b"quit":
            break
        await ep.send(buf[:n], tag=3, force_tag=True)
    await ep.close()
    print("DONE", flush=True)

asyncio.run(main())
"""


@pytest.mark.no_ctx
async def test_two_process_shm_only_by_address(run_peer):
    tls = "posix,sysv,cma"
    ucxx.init(options={"TLS": tls})
    assert ucxx.get_active_transports() <= {"posix", "sysv", "cma", "self"}
    peer = run_peer(ADDRESS_ECHO, env=child_env(UCX_TLS=tls))
    addr = bytes.fromhex(await peer.expect("ADDR"))
    ep = await ucxx.create_endpoint_from_worker_address(addr)
    await ep.send(ucxx.get_worker_address(), tag=1, force_tag=True)
    for size in (1, 100, 60000):
        data = bytes(range(256)) * (size // 256 + 1)
        data = data[:size]
        buf = bytearray(size)
        r = asyncio.ensure_future(ucxx.recv(buf, 3))
        await ep.send(data, tag=2, force_tag=True)
        assert await asyncio.wait_for(r, 10) == size and buf == data
    await ep.send(b"quit", tag=2, force_tag=True)
    await peer.expect("DONE")
    await ep.close()
    assert await peer.wait() == 0
