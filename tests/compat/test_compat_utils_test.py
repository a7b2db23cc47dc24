"""``ucxx._lib_async.utils_test``, the helpers RAPIDS ucxx's async test
suite imports (also in the processes it spawns): names, signatures and
behaviour."""

from __future__ import annotations

import asyncio
import inspect
import logging
import multiprocessing
import sys
import types

import numpy as np
import pytest

import ucxx
from ucxx._lib_async import utils_test as ut
from ucxx._lib_async.pytest_stash_keys import ASYNCIO_PLUGIN_TIMEOUT_STASH_KEY

T = pytest.mark.timeout

# What RAPIDS' tests import, with the parameters of each.
HELPERS = {
    "am_recv": ["ep"],
    "am_send": ["ep", "frames"],
    "captured_logger": ["logger", "level", "propagate"],
    "compute_timeouts": ["pytestconfig"],
    "get_cuda_devices": [],
    "get_num_gpus": [],
    "recv": ["ep"],
    "send": ["ep", "frames"],
    "wait_listener_client_handlers": ["listener"],
}


@T(10)
def test_helper_names_and_signatures():
    for name, params in HELPERS.items():
        sig = inspect.signature(getattr(ut, name))
        assert list(sig.parameters) == params, name
    for name in ("am_recv", "am_send", "recv", "send",
                 "wait_listener_client_handlers"):
        assert inspect.iscoroutinefunction(getattr(ut, name)), name


@T(10)
@pytest.mark.parametrize("timeout, expected", [
    (60.0, (50.0, 55.0)),     # T - 10, T - 5
    (600.0, (590.0, 595.0)),
    (5.0, (4.0, 4.5)),        # 0.8 T, 0.9 T
])
def test_compute_timeouts(timeout, expected):
    config = types.SimpleNamespace(stash=pytest.Stash())
    with pytest.raises(RuntimeError, match="stash"):
        ut.compute_timeouts(config)
    config.stash[ASYNCIO_PLUGIN_TIMEOUT_STASH_KEY] = timeout
    assert ut.compute_timeouts(config) == pytest.approx(expected)


@T(10)
def test_captured_logger():
    log = logging.getLogger("ucxx-test-captured")
    kept = logging.NullHandler()
    log.addHandler(kept)
    log.setLevel(logging.ERROR)
    try:
        with ut.captured_logger("ucxx-test-captured", logging.WARNING,
                                propagate=False) as out:
            assert not log.propagate
            log.info("hidden")
            log.warning("shown")
        assert out.getvalue() == "shown\n"
        assert log.handlers == [kept] and log.propagate
        assert log.level == logging.ERROR
        assert not log.isEnabledFor(logging.WARNING)
        with ut.captured_logger(log) as out:
            log.info("info too")
        assert out.getvalue() == "info too\n"
    finally:
        log.removeHandler(kept)
        log.setLevel(logging.NOTSET)


@T(10)
def test_cuda_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,2")
    assert ut.get_cuda_devices() == ["0", "2"]
    calls = []
    nvml = types.SimpleNamespace(
        nvmlInit=lambda: calls.append("init"),
        nvmlDeviceGetCount=lambda: 3,
        nvmlShutdown=lambda: calls.append("shutdown"),
    )
    monkeypatch.setitem(sys.modules, "pynvml", nvml)
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert ut.get_cuda_devices() == [0, 1, 2]
    assert ut.get_num_gpus() == 3
    assert calls == ["init", "shutdown"] * 2


async def _message_frames():
    from distributed.comm.utils import to_frames
    from distributed.protocol import to_serialize

    msg = {"data": to_serialize(np.arange(1000)),
           "empty": to_serialize(np.empty(0, dtype="u1"))}
    return await to_frames(msg, serializers=("dask", "pickle"))


def _check_message(msg):
    np.testing.assert_array_equal(msg["data"], np.arange(1000))
    assert msg["empty"].size == 0


async def _send_both(port):
    """Client side: one message with tag sends, one with active messages."""
    ep = await ucxx.create_endpoint(ucxx.get_address(), port)
    frames = await _message_frames()
    assert any(len(memoryview(f)) == 0 for f in frames)
    await ut.send(ep, frames)
    await ut.am_send(ep, frames)
    await ep.recv(np.empty(1, dtype="u1"))  # the server is done
    await ep.close()


async def _serve(send_from):
    """Listener receiving what ``_send_both`` sends; ``send_from(port)``
    starts the sender. Returns ``[(frames, msg)] * 2`` once the handler
    has finished."""
    got = []
    done = asyncio.Event()

    async def handler(ep):
        got.append(await ut.recv(ep))
        got.append(await ut.am_recv(ep))
        await ep.send(np.zeros(1, dtype="u1"))
        done.set()
        await ep.close()

    listener = ucxx.create_listener(handler)
    try:
        await send_from(listener.port)
        await asyncio.wait_for(done.wait(), 8)
        await asyncio.wait_for(ut.wait_listener_client_handlers(listener), 2)
        assert listener.active_clients == 0
    finally:
        listener.close()
    return got


@T(10)
async def test_send_recv_and_am_in_process():
    pytest.importorskip("distributed")
    got = await _serve(_send_both)
    assert len(got) == 2
    for frames, msg in got:
        _check_message(msg)
        assert any(memoryview(f).nbytes == 0 for f in frames)
    # recv: an empty host frame is b"" (nothing is received for it).
    assert any(isinstance(f, bytes) and f == b"" for f in got[0][0])


def _child(port, queue):
    """Spawned child (as RAPIDS' tests do): imports the helpers fresh."""
    import ucxx._lib_async.utils_test as child_ut

    asyncio.run(_send_both(port))
    queue.put(child_ut.__file__)


@T(10)
async def test_helpers_in_spawned_child():
    pytest.importorskip("distributed")
    mp = multiprocessing.get_context("spawn")
    queue = mp.Queue()
    procs = []

    async def start_child(port):
        proc = mp.Process(target=_child, args=(port, queue))
        proc.start()
        procs.append(proc)

    try:
        got = await _serve(start_child)
        for _, msg in got:
            _check_message(msg)
        path = await asyncio.to_thread(queue.get, True, 8)
        assert path == ut.__file__
        await asyncio.to_thread(procs[0].join, 8)
        assert procs[0].exitcode == 0
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.kill()
                proc.join()
