"""The Dask ``distributed`` comm backend (``ucxx.distributed``), under its
own scheme ``ucxx-c://`` (``ucxx://`` is the same backend unless
distributed-ucxx is installed: tests/compat/test_dask_schemes.py).

The generic comm checks below follow the ones of distributed's own test-suite
(``distributed/comm/tests/test_comms.py`` and ``check_rpc`` of
``distributed/tests/test_core.py``). distributed's wheels do not ship its
tests, so they are written out here against the public comm API.
"""

from __future__ import annotations

import asyncio
import gc
import os
import signal
import subprocess
import sys
import threading
from functools import partial

import pytest

pytest.importorskip("distributed")
pytest.importorskip("pytest_asyncio")

import dask  # noqa: E402
from distributed.comm import (  # noqa: E402
    CommClosedError,
    connect,
    get_address_host,
    get_local_address_for,
    listen,
    parse_address,
    parse_host_port,
    resolve_address,
)
from distributed.comm.registry import backends, get_backend  # noqa: E402
from distributed.core import Server, Status, rpc  # noqa: E402
from distributed.protocol import Serialized, deserialize, serialize, to_serialize  # noqa: E402
from distributed.utils import get_ip  # noqa: E402

import ucxx  # noqa: E402
import ucxx.distributed as ud  # noqa: E402

SCHEME = ud.SCHEME_C  # "ucxx-c"
ADDR = f"{SCHEME}://127.0.0.1"
T = pytest.mark.timeout

# conftest.py: no asyncio task, thread or fd may be left behind by a test
pytestmark = pytest.mark.leak_check


@pytest.fixture(scope="module", autouse=True)
def _warm_up_distributed():
    """Threads distributed starts once per process and keeps (the offload
    executor) are started before the per-test leak baselines are taken.
    distributed's sampling profiler is off: on Python 3.12 and later (not
    3.11) each server starts a "Profile" thread that ends only once its
    event loop is closed, after the test's leak check."""
    from multiprocessing import resource_tracker

    from distributed.utils import _offload_executor

    _offload_executor.submit(lambda: None).result()
    # spawned worker processes start multiprocessing's resource tracker
    # (a process and a pipe kept until exit)
    resource_tracker.ensure_running()
    with dask.config.set({"distributed.worker.profile.enabled": False}):
        yield


@pytest.fixture(autouse=True)
async def _ucxx_backend(monkeypatch):
    """Use the backend this checkout defines (the entry point of an installed
    copy could name another one) and check that the test left no comm or
    listener of the backend open (closes still in flight may finish)."""
    monkeypatch.setitem(backends, SCHEME, ud.UCXXCBackend())
    yield
    for _ in range(250):
        gc.collect()
        if not ud._resources:
            break
        await asyncio.sleep(0.02)
    assert not ud._resources, f"comms/listeners left open: {ud._resources}"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _no_ucxx_tasks():
    """Wait until the loop runs no ucxx task (progress, control watchers)."""
    me = asyncio.current_task()
    for _ in range(100):
        left = [
            t
            for t in asyncio.all_tasks()
            if t is not me and not t.done() and "ucxx" in repr(t).lower()
        ]
        if not left:
            return
        await asyncio.sleep(0.02)
    raise AssertionError(f"ucxx tasks left running: {left}")


# --------------------------------------------------------------------------
# Pure functions
# --------------------------------------------------------------------------


@T(30)
def test_entry_point():
    from importlib.metadata import entry_points

    eps = {}
    for ep in entry_points(group="distributed.comm.backends"):
        if ep.value.startswith("ucxx.distributed:"):
            eps[ep.name] = ep
    assert set(eps) == {"ucxx", SCHEME}, "ucxx's distributed.comm.backends entry points"
    assert eps[SCHEME].load() is ud.UCXXCBackend
    assert eps["ucxx"].load() is ud.ucxx_scheme_backend


@T(30)
def test_header_roundtrip():
    """The comm's headers are the package's one multi-frame format
    (ucxx._lib_async.frames), with CLOSE / HELLO in its application flags."""
    from ucxx._lib_async import frames

    for n in (0, 1, ud.INLINE, ud.INLINE + 1, 1000):
        sizes = [i * 7 for i in range(n)]
        kinds = [i % 2 for i in range(n)]
        msgs = ud.pack_header(sizes, kinds, ud.FLAG_HELLO)
        assert len(msgs[0]) <= ud.HEADER_SIZE
        flags, nframes = ud.unpack_header(msgs[0])
        assert (flags, nframes) == (ud.FLAG_HELLO, n)
        if n > ud.INLINE:
            assert len(msgs) == 2 and len(msgs[0]) == frames.PREFIX_SIZE
            assert len(msgs[1]) == 9 * n
            table = msgs[1]
        else:
            assert len(msgs) == 1
            table = msgs[0][frames.PREFIX_SIZE:]
        got = frames.decode_table(table, n, sum(sizes))
        assert list(got[0]) == sizes and list(got[1]) == kinds
    assert ud.unpack_header(ud._CLOSE_HEADER) == (ud.FLAG_CLOSE, 0)
    bad = bytearray(ud._CLOSE_HEADER)
    bad[0:2] = b"xx"
    with pytest.raises(ucxx.UCXError, match="magic"):
        ud.unpack_header(bad)
    bad = bytearray(ud._CLOSE_HEADER)
    bad[4] = 9
    with pytest.raises(ucxx.UCXError, match="version"):
        ud.unpack_header(bad)
    with pytest.raises(ucxx.UCXError, match="limit"):
        ud.unpack_header(ud.pack_header([1] * 20, [0] * 20)[0], max_frames=10)
    with pytest.raises(ucxx.UCXError, match="CLOSE header with frames"):
        ud.unpack_header(ud.pack_header([1], [0], ud.FLAG_CLOSE)[0])
    with pytest.raises(ucxx.UCXError):
        ud.unpack_header(b"short")


@T(30)
def test_address_functions():
    assert get_address_host(f"{SCHEME}://127.0.0.1:123") == "127.0.0.1"
    assert resolve_address(f"{SCHEME}://localhost:456") == f"{SCHEME}://127.0.0.1:456"
    assert resolve_address(f"{SCHEME}://0.0.0.0:456") == f"{SCHEME}://0.0.0.0:456"
    assert get_local_address_for(f"{SCHEME}://127.0.0.1:80") == f"{SCHEME}://127.0.0.1"
    assert get_backend(SCHEME).get_address_host_port("127.0.0.1:9") == ("127.0.0.1", 9)


# --------------------------------------------------------------------------
# Generic comm checks (as in distributed/comm/tests/test_comms.py)
# --------------------------------------------------------------------------


async def get_comm_pair(listen_addr, listen_args=None, connect_args=None, **kwargs):
    q = asyncio.Queue()

    async def handle_comm(comm):
        await q.put(comm)

    async with listen(listen_addr, handle_comm, **(listen_args or {}), **kwargs) as listener:
        comm = await connect(listener.contact_address, **(connect_args or {}), **kwargs)
    serv_comm = await q.get()
    return comm, serv_comm


def tcp_eq(expected_host, expected_port=None):
    def checker(loc):
        host, port = parse_host_port(loc)
        assert host == expected_host
        if expected_port is not None:
            assert port == expected_port
        else:
            assert 1023 < port < 65536

    return checker


async def check_client_server(addr, check_listen_addr=None, check_contact_addr=None):
    async def handle_comm(comm):
        try:
            scheme, loc = parse_address(comm.peer_address)
            assert scheme == bound_scheme
            msg = await comm.read()
            assert msg["op"] == "ping"
            msg["op"] = "pong"
            await comm.write(msg)
            msg = await comm.read()
            assert msg["op"] == "foobar"
        finally:
            await comm.close()

    # Arbitrary connection args are ignored
    listener = await listen(addr, handle_comm, xxx="bar")
    bound_addr = listener.listen_address
    bound_scheme, bound_loc = parse_address(bound_addr)
    assert bound_scheme == SCHEME
    if check_listen_addr is not None:
        check_listen_addr(bound_loc)
    contact_addr = listener.contact_address
    contact_scheme, contact_loc = parse_address(contact_addr)
    assert contact_scheme == bound_scheme
    if check_contact_addr is not None:
        check_contact_addr(contact_loc)
    else:
        assert contact_addr == bound_addr

    done = []

    async def client_communicate(key, delay=0):
        comm = await connect(listener.contact_address, xxx="foo")
        try:
            assert comm.peer_address == listener.contact_address
            await comm.write({"op": "ping", "data": key})
            await comm.write({"op": "foobar"})
            if delay:
                await asyncio.sleep(delay)
            msg = await comm.read()
            assert msg == {"op": "pong", "data": key}
            done.append(key)
        finally:
            await comm.close()

    await client_communicate(key=1234)
    await asyncio.gather(*[client_communicate(key=i, delay=0.05) for i in range(20)])
    assert set(done) == {1234} | set(range(20))
    listener.stop()


async def check_comm_closed_implicit(addr):
    async def handle_comm(comm):
        await comm.close()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.write({})
            await comm.read()
        comm.abort()

        comm = await connect(listener.contact_address)
        with pytest.raises(CommClosedError):
            await comm.read()
        comm.abort()


async def check_comm_closed_explicit(addr):
    a, b = await get_comm_pair(addr)
    a_read = a.read()
    b_read = b.read()
    await a.close()
    # In-flight reads abort with CommClosedError
    with pytest.raises(CommClosedError):
        await a_read
    with pytest.raises(CommClosedError):
        await b_read
    # New reads as well
    with pytest.raises(CommClosedError):
        await a.read()
    with pytest.raises(CommClosedError):
        await b.read()
    # And writes
    with pytest.raises(CommClosedError):
        await a.write({})
    with pytest.raises(CommClosedError):
        await b.write({})
    await b.close()


async def check_connect_timeout(addr):
    loop = asyncio.get_running_loop()
    t1 = loop.time()
    with pytest.raises(IOError):
        await connect(addr, timeout=0.15)
    dt = loop.time() - t1
    assert 1 >= dt >= 0.1


async def check_many_listeners(addr, n=100):
    async def handle_comm(comm):
        pass

    listeners = []
    for _ in range(n):
        listeners.append(await listen(addr, handle_comm))
    assert len({lst.listen_address for lst in listeners}) == n
    assert len({lst.contact_address for lst in listeners}) == n
    for lst in listeners:
        lst.stop()


async def check_listener_deserialize(addr, deserialize, in_value, check_out):
    q = asyncio.Queue()

    async def handle_comm(comm):
        try:
            msg = await comm.read()
        except Exception as exc:
            q.put_nowait(exc)
        else:
            q.put_nowait(msg)
        finally:
            await comm.close()

    async with listen(addr, handle_comm, deserialize=deserialize) as listener:
        comm = await connect(listener.contact_address)
    await comm.write(in_value)
    out_value = await q.get()
    if isinstance(out_value, Exception):
        raise out_value
    check_out(out_value)
    await comm.close()


async def check_connector_deserialize(addr, deserialize, in_value, check_out):
    done = asyncio.Event()

    async def handle_comm(comm):
        try:
            await comm.write(in_value)
            await done.wait()
        finally:
            await comm.close()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address, deserialize=deserialize)
    try:
        out_value = await comm.read()
        done.set()
    finally:
        await comm.close()
    check_out(out_value)


async def check_deserialize(addr):
    msg = {
        "op": "update",
        "x": b"abc",
        "to_ser": [to_serialize(123)],
        "ser": Serialized(*serialize(456)),
    }
    msg_orig = msg.copy()

    def check_out_false(out_value):
        out_value = out_value.copy()
        to_ser = out_value.pop("to_ser")
        ser = out_value.pop("ser")
        expected = msg_orig.copy()
        del expected["ser"]
        del expected["to_ser"]
        assert out_value == expected
        assert isinstance(ser, Serialized)
        assert deserialize(ser.header, ser.frames) == 456
        assert isinstance(to_ser, (tuple, list)) and len(to_ser) == 1
        (to_ser,) = to_ser
        if isinstance(to_ser, Serialized):
            assert deserialize(to_ser.header, to_ser.frames) == 123
        else:
            assert to_ser == to_serialize(123)

    def check_out_true(out_value):
        expected = msg.copy()
        expected["ser"] = 456
        expected["to_ser"] = [123]
        assert list(out_value.pop("to_ser")) == expected.pop("to_ser")
        assert out_value == expected

    await check_listener_deserialize(addr, False, msg, check_out_false)
    await check_connector_deserialize(addr, False, msg, check_out_false)
    await check_listener_deserialize(addr, True, msg, check_out_true)
    await check_connector_deserialize(addr, True, msg, check_out_true)

    # Long bytestrings, large enough to be transferred as separate payloads
    big = os.urandom(1024**2) * 4
    msg = {
        "op": "update",
        "x": big,
        "to_ser": (to_serialize(big),),
        "ser": Serialized(*serialize(big)),
    }
    msg_orig = msg.copy()

    def check_out(deserialize_flag, out_value):
        assert sorted(out_value) == sorted(msg_orig)
        out_value = out_value.copy()
        to_ser = out_value.pop("to_ser")
        ser = out_value.pop("ser")
        expected = msg_orig.copy()
        del expected["ser"]
        del expected["to_ser"]
        assert out_value == expected
        if deserialize_flag:
            assert isinstance(ser, (bytes, bytearray))
            assert bytes(ser) == big
        else:
            assert isinstance(ser, Serialized)
            assert deserialize(ser.header, ser.frames) == big
            assert isinstance(to_ser, tuple) and len(to_ser) == 1
            (to_ser,) = to_ser
            if isinstance(to_ser, Serialized):
                assert deserialize(to_ser.header, to_ser.frames) == big
            else:
                assert to_ser == to_serialize(big)

    await check_listener_deserialize(addr, False, msg, partial(check_out, False))
    await check_connector_deserialize(addr, False, msg, partial(check_out, False))
    await check_listener_deserialize(addr, True, msg, partial(check_out, True))
    await check_connector_deserialize(addr, True, msg, partial(check_out, True))


async def check_deserialize_roundtrip(addr):
    big = os.urandom(1024**2) * 4
    msg = {
        "op": "update",
        "x": big,
        "to_ser": [to_serialize(big)],
        "ser": Serialized(*serialize(big)),
    }
    for should_deserialize in (True, False):
        a, b = await get_comm_pair(addr, deserialize=should_deserialize)
        await a.write(msg)
        got = await b.read()
        await b.write(got)
        got = await a.read()
        assert sorted(got) == sorted(msg)
        for k in ("op", "x"):
            assert got[k] == msg[k]
        if should_deserialize:
            assert isinstance(got["to_ser"][0], (bytes, bytearray))
            assert isinstance(got["ser"], (bytes, bytearray))
        else:
            assert isinstance(got["to_ser"][0], (to_serialize, Serialized))
            assert isinstance(got["ser"], Serialized)
        await a.close()
        await b.close()


def _raise_eoferror():
    raise EOFError


class _EOFRaising:
    def __reduce__(self):
        return _raise_eoferror, ()


async def check_deserialize_eoferror(addr):
    """EOFError when deserializing closes the comm."""
    server_saw = asyncio.Event()

    async def handle_comm(comm):
        await comm.write({"data": to_serialize(_EOFRaising())})
        with pytest.raises(CommClosedError):
            await comm.read()
        server_saw.set()

    async with listen(addr, handle_comm) as listener:
        comm = await connect(listener.contact_address, deserialize=True)
        with pytest.raises(CommClosedError):
            await comm.read()
        assert comm.closed()
        await asyncio.wait_for(server_saw.wait(), 10)


async def check_repr(a, b):
    assert "closed" not in repr(a)
    assert "closed" not in repr(b)
    await a.close()
    assert "closed" in repr(a)
    assert a.local_address in repr(a)
    assert b.peer_address in repr(a)
    await b.close()
    assert "closed" in repr(b)
    assert a.local_address in repr(b)
    assert b.peer_address in repr(b)


async def check_addresses(a, b):
    assert a.peer_address == b.local_address
    assert a.local_address == b.peer_address
    a.abort()
    b.abort()


async def pingpong(comm):
    return b"pong"


async def check_rpc(listen_addr, rpc_addr=None):
    async with Server({"ping": pingpong}) as server:
        await server.listen(listen_addr)
        if rpc_addr is None:
            rpc_addr = server.address
        async with rpc(rpc_addr) as remote:
            response = await remote.ping()
            assert response == b"pong"
            assert remote.comms
            response = await remote.ping(close=True)
            assert response == b"pong"
            response = await remote.ping()
            assert response == b"pong"
        assert not remote.comms
        assert remote.status == Status.closed
        await asyncio.sleep(0)


@T(60)
@pytest.mark.asyncio
async def test_client_server():
    ip = get_ip()
    await check_client_server(ADDR, tcp_eq("127.0.0.1"))
    port = _free_port()
    await check_client_server(f"{SCHEME}://127.0.0.1:{port}", tcp_eq("127.0.0.1", port))
    await check_client_server(f"{SCHEME}://0.0.0.0", tcp_eq("0.0.0.0"), tcp_eq(ip))
    await check_client_server(f"{SCHEME}://", tcp_eq("0.0.0.0"), tcp_eq(ip))
    await _no_ucxx_tasks()


@T(60)
@pytest.mark.asyncio
async def test_comm_closed_implicit():
    await check_comm_closed_implicit(ADDR)


@T(60)
@pytest.mark.asyncio
async def test_comm_closed_explicit():
    await check_comm_closed_explicit(ADDR)


@T(60)
@pytest.mark.asyncio
async def test_connect_timeout():
    await check_connect_timeout(f"{SCHEME}://127.0.0.1:44444")


@T(60)
@pytest.mark.asyncio
async def test_many_listeners():
    await check_many_listeners(ADDR)
    await check_many_listeners(f"{SCHEME}://0.0.0.0", n=20)


@T(60)
@pytest.mark.asyncio
async def test_deserialize():
    await check_deserialize(f"{SCHEME}://")


@T(60)
@pytest.mark.asyncio
async def test_deserialize_roundtrip():
    await check_deserialize_roundtrip(ADDR)


@T(60)
@pytest.mark.asyncio
async def test_deserialize_eoferror():
    await check_deserialize_eoferror(ADDR)


@T(60)
@pytest.mark.asyncio
async def test_repr_and_addresses():
    a, b = await get_comm_pair(ADDR)
    assert a.local_address in repr(b)
    assert b.local_address in repr(a)
    await check_repr(a, b)
    a, b = await get_comm_pair(ADDR)
    await check_addresses(a, b)
    assert a.same_host and b.same_host


@T(60)
@pytest.mark.asyncio
async def test_rpc():
    await check_rpc(ADDR)
    await check_rpc(f"{SCHEME}://:0", None)
    await _no_ucxx_tasks()


# --------------------------------------------------------------------------
# Backend-specific behaviour
# --------------------------------------------------------------------------


@T(60)
@pytest.mark.asyncio
async def test_frames_one_gather_each_way():
    """A write is ONE gather_send (header + frames); a read is one header
    receive and ONE gather_recv; frame counts above the inline limit, empty
    frames and large frames go through unchanged."""
    import numpy as np

    from contextlib import ExitStack
    from unittest import mock

    a, b = await get_comm_pair(ADDR)
    calls = {"gather_send": 0, "send": 0, "gather_recv": 0}
    patches = ExitStack()

    def counting(ep, name):
        # The transfer methods are on the class: patch it, count ep's calls.
        orig = getattr(ucxx.Endpoint, name)

        def wrapper(self, *args, **kwargs):
            if self is ep:
                calls[name] += 1
            return orig(self, *args, **kwargs)

        patches.enter_context(mock.patch.object(ucxx.Endpoint, name, wrapper))

    counting(a._ep, "gather_send")
    counting(a._ep, "send")
    counting(b._ep, "gather_recv")
    try:
        arrays = [np.arange(i * 1000, dtype="u1") for i in range(40)]  # 40 frames, some empty
        big = np.random.default_rng(0).integers(0, 255, 20_000_000, dtype="u1")
        for msg in (
            {"op": "x", "arrays": [to_serialize(x) for x in arrays]},
            {"op": "y", "empty": to_serialize(b""), "e2": to_serialize(np.empty(0, "u1"))},
            {"op": "z", "big": to_serialize(big)},
            [],
        ):
            calls.update(gather_send=0, send=0, gather_recv=0)
            n = await a.write(msg)
            assert n > 0
            got = await b.read()
            assert calls["gather_send"] == 1 and calls["send"] == 0
            assert calls["gather_recv"] <= 1
            if isinstance(msg, list):
                assert list(got) == []
            elif msg["op"] == "x":
                for x, y in zip(arrays, got["arrays"]):
                    np.testing.assert_array_equal(x, y)
            elif msg["op"] == "y":
                assert bytes(got["empty"]) == b"" and len(got["e2"]) == 0
            else:
                np.testing.assert_array_equal(big, got["big"])
    finally:
        patches.close()
        await a.close()
        await b.close()


@T(60)
@pytest.mark.asyncio
async def test_reply_then_close():
    """A message written just before close() is still delivered, even when
    the reader reads it only after the writer has gone (small and large)."""
    import numpy as np

    big = np.arange(5_000_000, dtype="u1")
    results = asyncio.Queue()

    async def handle_comm(comm):
        msg = await comm.read()
        payload = {"small": 1} if msg == "small" else {"big": to_serialize(big)}
        await comm.write(payload)
        await comm.close()
        results.put_nowait("closed")

    async with listen(ADDR, handle_comm) as listener:
        for kind in ("small", "big"):
            comm = await connect(listener.contact_address)
            await comm.write(kind)
            if kind == "small":
                assert await asyncio.wait_for(results.get(), 10) == "closed"
            else:
                await asyncio.sleep(0.3)
            got = await comm.read()
            if kind == "small":
                assert got == {"small": 1}
            else:
                np.testing.assert_array_equal(got["big"], big)
                assert await asyncio.wait_for(results.get(), 10) == "closed"
            with pytest.raises(CommClosedError):
                await comm.read()
            assert comm.closed()
            with pytest.raises(CommClosedError):
                await comm.write("more")


@T(60)
@pytest.mark.asyncio
async def test_peer_abort_fails_pending_read():
    a, b = await get_comm_pair(ADDR)
    reader = asyncio.ensure_future(b.read())
    await asyncio.sleep(0.05)
    a.abort()
    with pytest.raises(CommClosedError):
        await asyncio.wait_for(reader, 15)
    assert b.closed()
    with pytest.raises(CommClosedError):
        await b.write({"x": 1})


@T(60)
@pytest.mark.asyncio
async def test_cancelled_read_aborts_comm():
    a, b = await get_comm_pair(ADDR)
    with pytest.raises(asyncio.TimeoutError):
        await asyncio.wait_for(b.read(), 0.05)
    assert b.closed()
    await a.close()
    await b.close()


@T(60)
@pytest.mark.asyncio
async def test_device_frame_without_allocator(monkeypatch):
    """A header announcing a CUDA frame, in a process without rmm/cupy/numba,
    gives a clear error (and aborts the comm) instead of corrupting the stream."""
    from ucxx._lib_async import frames

    monkeypatch.setattr(frames, "_device", None)
    for mod in ("rmm", "cupy", "numba", "numba.cuda"):
        monkeypatch.setitem(sys.modules, mod, None)
    a, b = await get_comm_pair(ADDR)
    hdr = ud.pack_header([8], [ud.KIND_CUDA])
    await a._ep.gather_send([b"12345678"], header=hdr)
    with pytest.raises(RuntimeError, match="rmm, cupy or numba"):
        await b.read()
    assert b.closed()
    await a.close()


@T(60)
@pytest.mark.asyncio
async def test_connect_refused_is_oserror():
    connector = get_backend(SCHEME).get_connector()
    with pytest.raises(OSError):
        await asyncio.wait_for(connector.connect("127.0.0.1:44445"), 10)


@T(60)
@pytest.mark.asyncio
async def test_listen_port_in_use():
    async def handle_comm(comm):
        await comm.close()

    async with listen(ADDR, handle_comm) as listener:
        port = listener.port
        other = listen(f"{SCHEME}://127.0.0.1:{port}", handle_comm)
        with pytest.raises(OSError):
            await other.start()


@T(60)
@pytest.mark.no_ctx
@pytest.mark.asyncio
async def test_context_released_after_last_comm():
    """Once the last comm and listener are gone, the backend releases what it
    created: no ucxx task on the loop, and the ucxx context is reset."""
    ucxx.reset()  # start without a context (also done by the no_ctx marker)
    a, b = await get_comm_pair(ADDR)
    assert ud._resources
    await a.close()
    await b.close()
    await _no_ucxx_tasks()
    assert not ud._resources
    assert ucxx.core._ctx is None


@T(60)
def test_config_applied():
    """``distributed.comm.ucxx.*`` reaches ucxx.init (fresh interpreter)."""
    code = (
        "import dask, ucxx, ucxx.distributed as ud\n"
        "dask.config.set({'distributed.comm.ucxx.tls': 'tcp',"
        " 'distributed.comm.ucxx.progress-mode': 'polling',"
        " 'distributed.comm.ucxx.environment': {'rndv-thresh': '16K'}})\n"
        "ud.init_once()\n"
        "ctx = ucxx.core._ctx\n"
        "print(ctx.progress_mode, ctx.config['TLS'], ctx.config['RNDV_THRESH'])\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith(("UCX_", "UCXPY_"))}
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=50, env=env
    )
    assert out.returncode == 0, out.stderr
    mode, tls, rndv = out.stdout.split()
    assert mode == "polling"
    assert tls == "tcp"
    assert "16k" in rndv.lower()


# --------------------------------------------------------------------------
# Clusters
# --------------------------------------------------------------------------

def _frames():
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(42)
    n = 20_000
    left = pd.DataFrame({"key": rng.integers(0, 5_000, n), "a": rng.random(n)})
    right = pd.DataFrame({"key": np.arange(5_000), "b": rng.random(5_000)})
    return left, right


def _local_cluster(processes: bool = True):
    """A LocalCluster of two one-thread workers on this package's scheme."""
    from distributed import LocalCluster

    return LocalCluster(protocol=SCHEME, n_workers=2, threads_per_worker=1,
                        processes=processes, dashboard_address=":0", asynchronous=True)


def _sorted(df, by):
    return df.sort_values(by).reset_index(drop=True)


@pytest.mark.slow
@T(240)
@pytest.mark.asyncio
async def test_local_cluster_merge_and_shuffle():
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client

    left, right = _frames()
    expected = _sorted(left.merge(right, on="key"), ["key", "a"])
    async with _local_cluster() as cluster:
        assert cluster.scheduler_address.startswith(f"{SCHEME}://")
        async with Client(cluster, asynchronous=True) as client:
            await client.wait_for_workers(2)
            workers = await client.run(os.getpid)
            assert len(workers) == 2
            assert all(w.startswith(f"{SCHEME}://") for w in workers)
            ddl = dd.from_pandas(left, npartitions=6)
            ddr = dd.from_pandas(right, npartitions=4)
            for method in ("tasks", "p2p"):
                joined = ddl.merge(ddr, on="key", shuffle_method=method)
                got = await client.compute(joined)
                pd.testing.assert_frame_equal(_sorted(got, ["key", "a"]), expected)
                shuffled = ddl.shuffle("key", shuffle_method=method)
                parts = await client.gather(client.compute(shuffled.to_delayed()))
                # every key lives in exactly one output partition
                owners = {}
                for i, part in enumerate(parts):
                    for k in part["key"].unique():
                        assert owners.setdefault(k, i) == i
                pd.testing.assert_frame_equal(
                    _sorted(pd.concat(parts), ["key", "a"]), _sorted(left, ["key", "a"])
                )
            # Worker-to-worker transfers happened over ucxx
            bw = await client.run_on_scheduler(lambda dask_scheduler: dict(dask_scheduler.bandwidth_workers))
            assert all(a.startswith(f"{SCHEME}://") and b.startswith(f"{SCHEME}://") for a, b in bw)
    await _no_ucxx_tasks()


def _slow_inc(x, delay=0.05):
    import time

    time.sleep(delay)
    return x + 1


@pytest.mark.slow
@T(240)
@pytest.mark.asyncio
async def test_worker_killed_mid_computation():
    from distributed import Client

    async with _local_cluster() as cluster:
        async with Client(cluster, asynchronous=True) as client:
            pids = await client.run(os.getpid)
            futures = client.map(_slow_inc, range(60), pure=False)
            total = client.submit(sum, futures)
            # let some tasks finish (and some results live on the victim)
            while sum(f.status == "finished" for f in futures) < 10:
                await asyncio.sleep(0.02)
            victim_addr, victim_pid = sorted(pids.items())[0]
            os.kill(victim_pid, signal.SIGKILL)
            assert await asyncio.wait_for(total.result(), 120) == sum(range(1, 61))
            # the nanny brings the worker back and the cluster keeps working
            await asyncio.wait_for(client.wait_for_workers(2), 60)
            assert await client.submit(_slow_inc, 1, delay=0, pure=False) == 2
            new_pids = await client.run(os.getpid)
            assert victim_pid not in new_pids.values()
    await _no_ucxx_tasks()


def _lane_transports():
    """The transports of this process's open ucxx endpoints (a worker's)."""
    import ucxx.core

    ctx = ucxx.core._ctx
    return sorted({t for ep in list(ctx._endpoints) if ep.alive for t, _ in ep.transports})


@pytest.mark.slow
@T(300)
@pytest.mark.asyncio
async def test_local_cluster_on_shared_memory_survives_a_kill_during_shuffle():
    """With the default settings the workers of one host talk shared memory
    (a posix or sysv lane on their endpoints); a worker SIGKILLed during a
    p2p shuffle leaves a computation that completes with the right result."""
    pytest.importorskip("pandas")
    pytest.importorskip("pyarrow")
    import dask.dataframe as dd
    import pandas as pd
    from distributed import Client

    left, _right = _frames()
    async with _local_cluster() as cluster:
        async with Client(cluster, asynchronous=True) as client:
            await client.wait_for_workers(2)
            ddl = dd.from_pandas(left, npartitions=8)
            # Worker-to-worker traffic first, so that their endpoints exist.
            await client.compute(ddl.shuffle("key", shuffle_method="p2p").to_delayed()[0])
            lanes = await client.run(_lane_transports)
            assert all({"posix", "sysv"} & set(t) for t in lanes.values()), lanes
            pids = await client.run(os.getpid)
            shuffled = ddl.map_partitions(
                lambda df: (__import__("time").sleep(0.2), df)[1], meta=left.iloc[:0]
            ).shuffle("key", shuffle_method="p2p")
            fut = client.compute(shuffled.to_delayed())
            await asyncio.sleep(0.5)
            os.kill(sorted(pids.values())[0], signal.SIGKILL)
            parts = await asyncio.wait_for(client.gather(fut), 180)
            pd.testing.assert_frame_equal(
                _sorted(pd.concat(parts), ["key", "a"]), _sorted(left, ["key", "a"])
            )
    await _no_ucxx_tasks()


def _count_fds():
    return len(os.listdir("/proc/self/fd"))


def _native_threads():
    names = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                names.append(f.read().strip())
        except OSError:
            pass
    return sorted(names)


@pytest.mark.slow
@pytest.mark.no_ctx
@T(240)
@pytest.mark.asyncio
async def test_cluster_start_stop_no_leaks():
    """Start and stop a ucxx cluster 20 times in one process: after each
    stop, threads, native threads, fds and asyncio tasks are back to what
    they were after the first one."""
    from distributed import Client

    async def cycle():
        async with _local_cluster(processes=False) as cluster:
            async with Client(cluster, asynchronous=True) as client:
                fut = client.submit(_slow_inc, 1, delay=0, pure=False)
                assert await fut == 2
                futs = client.map(_slow_inc, range(10), delay=0, pure=False)
                assert await client.submit(sum, futs) == sum(range(1, 11))
        gc.collect()
        await _no_ucxx_tasks()
        await asyncio.sleep(0.05)

    def snapshot():
        me = asyncio.current_task()
        return (
            # the loop's default executor grows on demand (bounded); it is
            # the test's and shut down below
            sum(not t.name.startswith("test-default-executor") for t in threading.enumerate()),
            # threads Python does not know about (UCX's, ...)
            len(_native_threads()) - threading.active_count(),
            _count_fds(),
            len([t for t in asyncio.all_tasks() if t is not me and not t.done()]),
        )

    from concurrent.futures import ThreadPoolExecutor

    executor = ThreadPoolExecutor(4, thread_name_prefix="test-default-executor")
    asyncio.get_running_loop().set_default_executor(executor)
    try:
        ucxx.reset()  # start without a context (also done by the no_ctx marker)
        await cycle()  # warm-up: thread pools and imports that stay
        base = snapshot()
        for _ in range(19):
            await cycle()
            assert not ud._resources
            assert ucxx.core._ctx is None
        end = snapshot()
    finally:
        executor.shutdown(wait=True)
    assert end[0] <= base[0], f"Python threads {base[0]} -> {end[0]}: {threading.enumerate()}"
    assert end[1] <= base[1], f"non-Python threads {base[1]} -> {end[1]}"
    assert end[2] <= base[2], f"fds {base[2]} -> {end[2]}"
    assert end[3] <= base[3], f"asyncio tasks {base[3]} -> {end[3]}"
