"""The public Endpoint as RAPIDS ucxx's consumers use it: methods on the
class (introspection, ``mock.patch.object``), ``close()`` as a coroutine
usable from any loop, ``close_after_n_recv``, close callbacks with
arguments, probes, name tags, an endpoint the application drops; and the
two C fixes (endpoint repr, ``ep_from_sockaddr(host=...)``)."""

from __future__ import annotations

import asyncio
import gc
import inspect
import subprocess
import sys
import textwrap
import time
import weakref
from unittest import mock

import pytest

import ucxx
from ucxx import _ucxx

T = pytest.mark.timeout
HOST = "127.0.0.1"


async def _pair(**kw):
    accepted = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port, **kw)
    sep = await asyncio.wait_for(accepted.get(), 10)
    return lst, ep, sep


async def _close(*objs):
    for o in objs:
        if isinstance(o, ucxx.Listener):
            o.close()
        else:
            await o.close()


# ------------------------------------------------------- methods on the class
@T(30)
def test_signatures_on_the_class():
    for name, params in {
        "send": ["self", "buf", "tag", "force_tag"],
        "recv": ["self", "buf", "tag", "force_tag"],
        "gather_send": ["self", "buffers", "tag", "force_tag", "header"],
        "am_send": ["self", "buf"],
        "am_recv": ["self"],
        "close": ["self", "period", "max_attempts"],
        "abort": ["self", "period", "max_attempts"],
        "send_multi": ["self", "buffers", "tag", "force_tag"],
        "recv_obj": ["self", "tag", "allocator", "force_tag"],
        "tag_probe": ["self", "tag", "force_tag", "remove"],
        "recv_with_handle": ["self", "buffer", "probe_result"],
        "set_close_callback": ["self", "callback_func", "cb_args", "cb_kwargs"],
        "close_after_n_recv": ["self", "n", "count_from_ep_creation"],
    }.items():
        sig = inspect.signature(getattr(ucxx.Endpoint, name))
        assert list(sig.parameters) == params, name
    # the transfer methods are the C ones, found on the class
    assert ucxx.Endpoint.send is _ucxx.Endpoint.send
    assert ucxx.Endpoint.recv is _ucxx.Endpoint.recv
    assert issubclass(ucxx.Endpoint, _ucxx.Endpoint)
    assert inspect.iscoroutinefunction(ucxx.Endpoint.close)


@T(60)
async def test_patch_object_on_the_class_takes_effect():
    lst, ep, sep = await _pair()
    try:
        assert type(ep) is ucxx.Endpoint and type(sep) is ucxx.Endpoint
        assert ep.send.__self__ is ep and ep._ep is ep
        calls = []
        real = ucxx.Endpoint.send

        def spy(self, buf, tag=None, force_tag=False):
            calls.append(bytes(buf))
            return real(self, buf, tag, force_tag)

        with mock.patch.object(ucxx.Endpoint, "send", spy):
            await ep.send(b"abc")
            await sep.send(b"def")
        await ep.send(b"not seen")
        assert calls == [b"abc", b"def"]
        got = bytearray(8)
        assert await sep.recv(got) == 3 and await ep.recv(got) == 3
        assert await sep.recv(got) == 8
        with mock.patch.object(ucxx.Endpoint, "recv", autospec=True) as m:
            m.return_value = asyncio.sleep(0, result=42)
            assert await sep.recv(bytearray(1)) == 42
            m.assert_called_once()
    finally:
        await _close(ep, sep, lst)


@T(30)
def test_endpoints_are_not_made_directly():
    with pytest.raises(TypeError):
        ucxx.Endpoint(object())
    with pytest.raises(TypeError):
        _ucxx.Endpoint()


# ------------------------------------------------------------------- close
@T(60)
async def test_close_is_a_coroutine_and_idempotent():
    lst, ep, sep = await _pair()
    c1, c2 = ep.close(), ep.close()
    assert inspect.iscoroutine(c1)
    await asyncio.gather(c1, c2)
    await ep.close()
    assert ep.closed and ep.closed() and not ep.alive
    for _ in range(200):
        if sep.closed:
            break
        await asyncio.sleep(0.01)
    assert sep.closed
    await sep.close()
    lst.close()


def _close_without_a_running_loop(use_uvloop: bool) -> str:
    return textwrap.dedent(
        f"""
        import asyncio
        import ucxx

        if {use_uvloop!r}:
            import uvloop
            uvloop.install()

        async def connect():
            accepted = asyncio.Queue()
            lst = ucxx.create_listener(accepted.put_nowait, host="127.0.0.1")
            ep = await ucxx.create_endpoint("127.0.0.1", lst.port)
            sep = await accepted.get()
            return lst, ep, sep

        loop = asyncio.new_event_loop()
        lst, ep, sep = loop.run_until_complete(connect())
        closing = ep.close()          # no loop running: a coroutine object
        assert asyncio.iscoroutine(closing)
        loop.run_until_complete(closing)
        assert ep.closed
        # the other end, closed from a different loop than the one it was
        # accepted on (that loop is closed first)
        loop.run_until_complete(asyncio.sleep(0.1))
        loop.close()
        other = asyncio.new_event_loop()
        other.run_until_complete(sep.close())
        assert sep.closed
        lst.close()
        other.close()
        ucxx.reset()
        print("ok")
        """
    )


@T(120)
@pytest.mark.parametrize("use_uvloop", [False, True], ids=["asyncio", "uvloop"])
def test_close_without_a_running_loop(use_uvloop):
    if use_uvloop:
        pytest.importorskip("uvloop")
    out = subprocess.run(
        [sys.executable, "-W", "error::RuntimeWarning", "-c",
         _close_without_a_running_loop(use_uvloop)],
        capture_output=True, text=True, timeout=100,
    )
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
    assert "never awaited" not in out.stderr


@T(60)
async def test_dropped_endpoint_closes_gracefully():
    lst, ep, sep = await _pair()
    pending = asyncio.ensure_future(ep.recv(bytearray(1)))
    await asyncio.sleep(0.05)
    ref = weakref.ref(sep)
    del sep
    gc.collect()
    # the peer's pending receive fails as after close(), not as a reset
    with pytest.raises(ucxx.UCXCanceledError):
        await asyncio.wait_for(pending, 10)
    for _ in range(500):
        if ref() is None:
            break
        gc.collect()
        await asyncio.sleep(0.01)
    assert ref() is None
    await ep.close()
    lst.close()


@T(60)
@pytest.mark.parametrize("side", ["client", "server"])
async def test_own_close_cancels_pending_receives_even_if_the_peer_resets(side):
    """Both sides wait in a receive; one side closes while its receive is
    pending. The peer answers the close by closing, and its endpoint going
    away reaches this side before the close ends: this side's receive fails
    with UCXCanceledError (its own close ended it), not with a reset."""
    lst, ep, sep = await _pair()
    me, peer = (ep, sep) if side == "client" else (sep, ep)

    async def answer():
        with pytest.raises(ucxx.UCXCanceledError):
            await peer.recv(bytearray(10**6))
        await peer.close()

    other = asyncio.ensure_future(answer())
    with pytest.raises(ucxx.UCXCanceledError):
        await asyncio.gather(me.recv(bytearray(10**6)), me.close())
    await asyncio.wait_for(other, 10)
    await me.close()
    lst.close()


@T(30)
async def test_dropped_endpoint_posts_its_close_message_at_once():
    """An endpoint dropped while open posts its close message when it is
    collected: the peer learns of the close at its next progress, even if
    the loop never runs the rest of the close."""
    lst, ep, sep = await _pair()
    await asyncio.sleep(0.05)  # both control receives posted
    ctrl = ep._state.ctrl_req
    assert ctrl is not None and not ctrl.done()
    del sep
    gc.collect()
    # no await: the loop does not run
    for _ in range(2000):
        ucxx.progress()
        if ctrl.done():
            break
        time.sleep(0.001)
    assert ctrl.done()
    await ep.close()
    lst.close()


# ------------------------------------------------------ close_after_n_recv
@T(60)
@pytest.mark.parametrize("kind", ["tag", "am"])
async def test_close_after_n_recv(kind):
    lst, ep, sep = await _pair()
    try:
        async def send(n):
            for _ in range(n):
                await (sep.send(b"x") if kind == "tag" else sep.am_send(b"x"))

        async def recv(n):
            for _ in range(n):
                await (ep.recv(bytearray(1)) if kind == "tag" else ep.am_recv())

        await send(3)
        await recv(3)
        assert ep.recv_count == 3
        with pytest.raises(ucxx.UCXError, match="cannot be less than current recv_count"):
            ep.close_after_n_recv(2, count_from_ep_creation=True)
        ep.close_after_n_recv(5, count_from_ep_creation=True)
        with pytest.raises(ucxx.UCXError, match="has already been set to: 5"):
            ep.close_after_n_recv(1)
        await send(2)
        await recv(1)
        assert not ep.closed
        await recv(1)
        assert ep.closed
        assert isinstance(ep, ucxx.Endpoint)
    finally:
        await _close(ep, sep, lst)


@T(60)
async def test_close_after_zero_more_recv_aborts_now():
    lst, ep, sep = await _pair()
    ep.close_after_n_recv(0)
    assert ep.closed
    await _close(sep, lst)


# ---------------------------------------------------- callbacks, probes, tags
@T(60)
async def test_close_callback_arguments():
    lst, ep, sep = await _pair()
    calls = []
    ep.set_close_callback(lambda *a, **k: calls.append((a, k)), (1, 2), {"k": 3})
    await ep.close()
    for _ in range(100):
        if calls:
            break
        await asyncio.sleep(0.01)
    assert calls == [((1, 2), {"k": 3})]
    # set after the close: called soon
    late = []
    ep.set_close_callback(late.append, ("late",))
    await asyncio.sleep(0.05)
    assert late == ["late"]
    await _close(sep, lst)


@T(60)
async def test_am_probe_raise_on_error_and_accessors():
    lst, ep, sep = await _pair()
    try:
        assert ep.am_probe() is False
        await sep.am_send(b"am")
        for _ in range(500):
            if ep.am_probe():
                break
            await asyncio.sleep(0.005)
        assert ep.am_probe() is True
        got = await ep.am_recv()
        import numpy as np

        assert isinstance(got, np.ndarray) and got.dtype == np.uint8  # as RAPIDS
        assert bytes(got) == b"am" and ep.am_probe() is False
        ep.raise_on_error()  # healthy: nothing
        assert ep._tags == {"msg_send": ep.send_tag, "msg_recv": ep.recv_tag}
        assert ep.ucp_endpoint == ep.handle > 0
        assert ep.ucp_worker == ucxx.get_ucp_worker()
        assert ep.ucxx_worker == ucxx.get_ucxx_worker()
        assert ep.ucxx_endpoint == id(ep)
        assert ep._ctx is ucxx.core._get_ctx()
    finally:
        await _close(ep, sep, lst)


@T(60)
async def test_name_tags():
    lst, ep, sep = await _pair()
    try:
        r2 = asyncio.ensure_future(sep.recv(bytearray(2), tag="second"))
        await ep.send(b"1", tag="first")
        await ep.send(b"22", tag="second")
        got = bytearray(1)
        assert await sep.recv(got, tag="first") == 1 and got == b"1"
        assert await r2 == 2
        assert sep.recv_tag_for("first") != sep.recv_tag_for("second")
        assert sep.recv_tag_for(b"first") == sep.recv_tag_for("first")
        assert sep.recv_tag_for() == sep.recv_tag
        assert sep.recv_tag_for(7, force_tag=True) == 7
    finally:
        await _close(ep, sep, lst)


@T(60)
async def test_name_tags_are_the_same_in_every_process():
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(
            """
            import ucxx
            from ucxx import _ucxx as U
            c = U.Context({"TLS": "tcp"}); w = U.Worker(c)
            ep = w.ep_from_address(w.address)
            ep.recv_tag = 99
            print(ep.recv_tag_for("a name"))
            ep.abort(); w.close(); c.close()
            """)],
        capture_output=True, text=True, timeout=60, check=True,
        env={"PYTHONHASHSEED": "7", **__import__("os").environ},
    )
    ctx = _ucxx.Context({"TLS": "tcp"})
    w = _ucxx.Worker(ctx)
    try:
        c_ep = w.ep_from_address(w.address)
        c_ep.recv_tag = 99
        assert c_ep.recv_tag_for("a name") == int(out.stdout)
        c_ep.abort()
    finally:
        w.close()
        ctx.close()


# --------------------------------------------------------------- C fixes
@T(30)
def test_c_endpoint_repr_shows_the_uid():
    ctx = _ucxx.Context({"TLS": "tcp"})
    w = _ucxx.Worker(ctx)
    try:
        c_ep = w.ep_from_address(w.address)
        assert repr(c_ep) == f"<ucxx.Endpoint uid={c_ep.uid:#x} open>"
        c_ep.abort()
        assert repr(c_ep) == f"<ucxx.Endpoint uid={c_ep.uid:#x} closed>"
        assert "%" not in repr(c_ep)
    finally:
        w.close()
        ctx.close()


@T(30)
@pytest.mark.parametrize("how", ["positional", "keywords"])
def test_ep_from_sockaddr_bad_host_by_keyword(how):
    ctx = _ucxx.Context({"TLS": "tcp"})
    w = _ucxx.Worker(ctx)
    try:
        with pytest.raises(ValueError, match="cannot resolve address 'no-such-host.invalid'"):
            if how == "keywords":
                w.ep_from_sockaddr(host="no-such-host.invalid", port=12345)
            else:
                w.ep_from_sockaddr("no-such-host.invalid", 12345)
    finally:
        w.close()
        ctx.close()


# ---------------------------------------------------------------- listener
@T(60)
async def test_listener_dropped_with_handlers_running_warns(caplog):
    import logging

    release = asyncio.Event()

    async def handler(ep):
        await release.wait()
        await ep.close()

    lst = ucxx.create_listener(handler, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    for _ in range(500):
        if lst.active_clients:
            break
        await asyncio.sleep(0.01)
    assert lst.active_clients == 1 and lst.closed is False
    with caplog.at_level(logging.WARNING, logger="ucx"):
        del lst
        gc.collect()
    assert any(r.getMessage().startswith("Listener object is being destroyed, but 1 client")
               for r in caplog.records)
    release.set()
    await ep.close()


@T(60)
@pytest.mark.parametrize("failure", ["handshake", "callback"])
async def test_listener_handler_logs_text_and_keeps_nothing(caplog, monkeypatch, failure):
    """The connection handler logs a failure with its traceback as text and
    drops what it holds before it stops counting as active."""
    import logging

    from ucxx._lib_async import listener as lmod

    class Ctx:
        pass

    class Clients:
        def __init__(self):
            self.n = 0

        def inc(self, ident):
            self.n += 1

        def dec(self, ident):
            frame = inspect.currentframe().f_back
            assert frame.f_code.co_name == "_listener_handler_coroutine"
            held = {k: frame.f_locals[k] for k in ("ctx", "endpoint", "conn_request", "ep")}
            assert held == dict.fromkeys(held), held
            self.n -= 1

    class Conn:
        handle = 1

        def raise_on_error(self):
            pass

    async def exchange(**kw):
        if failure == "handshake":
            raise RuntimeError("exchange went wrong")
        return {"msg_tag": 1, "ctrl_tag": 2}

    async def callback(ep):
        raise RuntimeError("callback went wrong")

    monkeypatch.setattr(lmod, "exchange_peer_info", exchange)
    monkeypatch.setattr(lmod, "Endpoint", lambda endpoint, ctx, tags: object())
    ctx, clients = Ctx(), Clients()
    ref = weakref.ref(ctx)
    with caplog.at_level(logging.ERROR, logger="ucx"):
        await lmod._listener_handler_coroutine(
            conn_request=Conn(), ctx=ctx, func=callback, endpoint_error_handling=True,
            connect_timeout=1, ident=0, active_clients=clients,
        )
    del ctx
    gc.collect()
    assert ref() is None and clients.n == 0
    rec = caplog.records[-1]
    want = ("Unexpected error in listener handler coroutine" if failure == "handshake"
            else "Uncaught listener callback error")
    assert rec.getMessage().startswith(want) and rec.exc_info is None
    assert "RuntimeError: " + ("exchange" if failure == "handshake" else "callback") in rec.getMessage()
