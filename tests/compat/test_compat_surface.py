"""The API surface RAPIDS ucxx's consumers use beyond the core transfers:
module-level names, ``ucxx.types``, ``ucxx.testing``, ``ucxx._cuda_context``,
the application context's RAPIDS methods and flags, every RAPIDS exception
class and the status each comes from, worker addresses."""

from __future__ import annotations

import asyncio
import multiprocessing
import os
import pickle
import subprocess
import sys
import textwrap

import pytest

import ucxx
from ucxx import _ucxx
from ucxx._lib_async.utils import UCXAddress, get_event_loop, hash64bits

T = pytest.mark.timeout

# RAPIDS ucxx 0.52's exception classes, with the status each one reports
# (None: raised by the library, not mapped from a status).
RAPIDS_EXCEPTIONS = {
    "UCXError": None,
    "UCXCanceledError": "UCS_ERR_CANCELED",
    "UCXCloseError": None,
    "UCXConfigError": None,
    "UCXConnectionResetError": "UCS_ERR_CONNECTION_RESET",
    "UCXMessageTruncatedError": "UCS_ERR_MESSAGE_TRUNCATED",
    "UCXNotConnectedError": "UCS_ERR_NOT_CONNECTED",
    "UCXUnreachableError": "UCS_ERR_UNREACHABLE",
    "UCXTimedOutError": "UCS_ERR_TIMED_OUT",
    "UCXNoMemoryError": "UCS_ERR_NO_MEMORY",
    "UCXNoResourceError": "UCS_ERR_NO_RESOURCE",
    "UCXInvalidParamError": "UCS_ERR_INVALID_PARAM",
    "UCXBusyError": "UCS_ERR_BUSY",
    "UCXUnsupportedError": "UCS_ERR_UNSUPPORTED",
    "UCXRejectedError": "UCS_ERR_REJECTED",
    "UCXNoDeviceError": "UCS_ERR_NO_DEVICE",
    "UCXEndpointTimeoutError": "UCS_ERR_ENDPOINT_TIMEOUT",
    "UCXBufferTooSmallError": "UCS_ERR_BUFFER_TOO_SMALL",
    "UCXAlreadyExistsError": "UCS_ERR_ALREADY_EXISTS",
    "UCXExceedsLimitError": "UCS_ERR_EXCEEDS_LIMIT",
    "UCXFirstEndpointFailureError": "UCS_ERR_FIRST_ENDPOINT_FAILURE",
    "UCXFirstLinkFailureError": "UCS_ERR_FIRST_LINK_FAILURE",
    "UCXIOError": "UCS_ERR_IO_ERROR",
    "UCXInvalidAddrError": "UCS_ERR_INVALID_ADDR",
    "UCXLastEndpointFailureError": "UCS_ERR_LAST_ENDPOINT_FAILURE",
    "UCXLastLinkFailureError": "UCS_ERR_LAST_LINK_FAILURE",
    "UCXNoElemError": "UCS_ERR_NO_ELEM",
    "UCXNoMessageError": "UCS_ERR_NO_MESSAGE",
    "UCXNoProgressError": "UCS_ERR_NO_PROGRESS",
    "UCXNotImplementedError": "UCS_ERR_NOT_IMPLEMENTED",
    "UCXOutOfRangeError": "UCS_ERR_OUT_OF_RANGE",
    "UCXShmemSegmentError": "UCS_ERR_SHMEM_SEGMENT",
    "UCXSomeConnectsFailedError": "UCS_ERR_SOME_CONNECTS_FAILED",
}

# ucs_status_t values (ucs/type/status.h, stable across UCX releases).
STATUS = {
    "UCS_ERR_NO_MESSAGE": -1, "UCS_ERR_NO_RESOURCE": -2, "UCS_ERR_IO_ERROR": -3,
    "UCS_ERR_NO_MEMORY": -4, "UCS_ERR_INVALID_PARAM": -5, "UCS_ERR_UNREACHABLE": -6,
    "UCS_ERR_INVALID_ADDR": -7, "UCS_ERR_NOT_IMPLEMENTED": -8,
    "UCS_ERR_MESSAGE_TRUNCATED": -9, "UCS_ERR_NO_PROGRESS": -10,
    "UCS_ERR_BUFFER_TOO_SMALL": -11, "UCS_ERR_NO_ELEM": -12,
    "UCS_ERR_SOME_CONNECTS_FAILED": -13, "UCS_ERR_NO_DEVICE": -14, "UCS_ERR_BUSY": -15,
    "UCS_ERR_CANCELED": -16, "UCS_ERR_SHMEM_SEGMENT": -17, "UCS_ERR_ALREADY_EXISTS": -18,
    "UCS_ERR_OUT_OF_RANGE": -19, "UCS_ERR_TIMED_OUT": -20, "UCS_ERR_EXCEEDS_LIMIT": -21,
    "UCS_ERR_UNSUPPORTED": -22, "UCS_ERR_REJECTED": -23, "UCS_ERR_NOT_CONNECTED": -24,
    "UCS_ERR_CONNECTION_RESET": -25, "UCS_ERR_FIRST_LINK_FAILURE": -40,
    "UCS_ERR_LAST_LINK_FAILURE": -59, "UCS_ERR_FIRST_ENDPOINT_FAILURE": -60,
    "UCS_ERR_ENDPOINT_TIMEOUT": -80, "UCS_ERR_LAST_ENDPOINT_FAILURE": -89,
}


# ---------------------------------------------------------------- exceptions
@T(30)
@pytest.mark.parametrize("name", sorted(RAPIDS_EXCEPTIONS))
def test_every_rapids_exception_class_exists(name):
    cls = getattr(ucxx.exceptions, name)
    assert cls is getattr(ucxx, name) is getattr(_ucxx, name)
    assert issubclass(cls, ucxx.exceptions.UCXError)
    assert issubclass(ucxx.exceptions.UCXError, Exception)


@T(30)
@pytest.mark.parametrize(
    "name", sorted(n for n, s in RAPIDS_EXCEPTIONS.items() if s is not None)
)
def test_each_status_becomes_its_class(name):
    exc = _ucxx._status_exception(STATUS[RAPIDS_EXCEPTIONS[name]])
    assert type(exc) is getattr(ucxx.exceptions, name)
    assert str(exc)  # UCX's text for the status


@T(30)
def test_status_mapping_details():
    # A dead shared-memory peer: also a connection reset.
    assert issubclass(ucxx.UCXShmemSegmentError, ucxx.UCXConnectionResetError)
    # An unmapped error status is the base class; OK is not an error.
    assert type(_ucxx._status_exception(-99)) is ucxx.UCXError
    for bad in (0, 1, -101):
        with pytest.raises(ValueError):
            _ucxx._status_exception(bad)
    # Aliases of older spellings.
    assert ucxx.exceptions.UCXCanceled is ucxx.UCXCanceledError
    assert ucxx.exceptions.UCXMsgTruncated is ucxx.UCXMessageTruncatedError


@T(30)
@pytest.mark.no_ctx
def test_bad_option_is_config_and_invalid_param_error():
    ucxx.reset()
    with pytest.raises(ucxx.UCXInvalidParamError) as ei:
        ucxx.init({"SEG_SIZE": "invalid-size"})
    assert isinstance(ei.value, ucxx.UCXConfigError)
    assert "SEG_SIZE" in str(ei.value)
    assert ucxx.core._ctx is None


# ------------------------------------------------------------------- types
@T(30)
def test_tag_types():
    from ucxx.types import Tag, TagMask, TagMaskFull

    t = Tag(5)
    assert t == 5 and t.value == 5 and hash(t) == hash(5)
    assert isinstance(t, int) and repr(t) == "Tag(5)"
    assert Tag(2**64 - 1).value == 2**64 - 1
    assert TagMaskFull == TagMask(2**64 - 1) == 2**64 - 1
    assert Tag(3) != TagMask(4)
    for bad in (-1, 2**64):
        with pytest.raises(OverflowError):
            Tag(bad)
    for bad in ("1", 1.0, True):
        with pytest.raises(TypeError):
            TagMask(bad)
    assert pickle.loads(pickle.dumps(t)) == t


@T(30)
def test_hash64bits_is_stable_across_processes():
    h = hash64bits("msg_tag", b"seed", 7)
    assert 0 <= h < 2**64 and h == hash64bits("msg_tag", b"seed", 7)
    assert h != hash64bits("msg_tag", b"seed", 8)
    out = subprocess.run(
        [sys.executable, "-c",
         "from ucxx._lib_async.utils import hash64bits;"
         "print(hash64bits('msg_tag', b'seed', 7))"],
        capture_output=True, text=True, timeout=60, check=True,
        env={**os.environ, "PYTHONHASHSEED": "123"},
    )
    assert int(out.stdout) == h


@T(30)
def test_get_event_loop():
    async def inside():
        return get_event_loop() is asyncio.get_running_loop()

    assert asyncio.run(inside())
    loop = get_event_loop()  # no running loop: a usable loop
    try:
        assert loop.run_until_complete(asyncio.sleep(0, result=3)) == 3
    finally:
        loop.close()
        asyncio.set_event_loop(None)


@T(30)
def test_worker_address_type():
    addr = ucxx.get_worker_address()
    assert isinstance(addr, UCXAddress) and isinstance(addr, bytes)
    assert addr.length == len(addr) > 0
    assert bytes(memoryview(addr)) == addr
    again = ucxx.get_ucx_address_from_buffer(bytearray(addr))
    assert type(again) is UCXAddress and again == addr
    import numpy as np

    assert ucxx.get_ucx_address_from_buffer(np.frombuffer(addr, np.uint8)) == addr
    assert pickle.loads(pickle.dumps(addr)) == addr


# ----------------------------------------------------------------- testing
def _ok(x):
    assert x == 1


def _fails(x):
    raise KeyError(f"boom {x}")


@T(60)
def test_testing_helpers():
    from ucxx.testing import join_processes, run_in_subprocess, terminate_process

    mp = multiprocessing.get_context("spawn")
    q_ok, q_bad = mp.Queue(), mp.Queue()
    good = mp.Process(target=run_in_subprocess, args=(_ok, q_ok, 1))
    bad = mp.Process(target=run_in_subprocess, args=(_fails, q_bad, 2))
    good.start()
    bad.start()
    join_processes([good, bad], timeout=45)
    terminate_process(good, error_queue=q_ok)
    with pytest.raises(RuntimeError, match=r"(?s)exit code: 1.*KeyError: 'boom 2'"):
        terminate_process(bad, error_queue=q_bad)
    # A process still running is killed.
    slow = mp.Process(target=__import__("time").sleep, args=(60,))
    slow.start()
    with pytest.raises(RuntimeError, match="exit code: -9"):
        terminate_process(slow)


# ------------------------------------------------------------- CUDA helpers
@T(60)
def test_no_cuda_at_import_and_cuda_context_module():
    code = textwrap.dedent(
        """
        import sys
        before = set(sys.modules)  # (site may import a namespace package)
        import ucxx, ucxx._cuda_context as cc
        loaded = [m for m in set(sys.modules) - before
                  if m.split(".")[0] in ("cuda", "numba", "cupy", "rmm", "pynvml")]
        print(loaded, callable(cc.ensure_cuda_context),
              callable(cc.synchronize_default_stream))
        """
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True,
                         text=True, timeout=60, check=True)
    assert out.stdout.split() == ["[]", "True", "True"]


# ------------------------------------------------------- application context
@T(60)
@pytest.mark.no_ctx
async def test_context_rapids_methods():
    ucxx.reset()
    ctx = ucxx.core._get_ctx()
    assert ctx.progress_mode in ("blocking", "polling", "thread", "thread-polling")
    assert ctx.ucxx_worker == ucxx.get_ucxx_worker() == id(ctx.worker)
    assert ctx.ucp_worker == ucxx.get_ucp_worker() == ctx.worker.handle
    ctx.start_notifier_thread()
    ctx.stop_notifier_thread()
    ucxx.stop_notifier_thread()
    task = ucxx.continuous_ucx_progress(event_loop=asyncio.get_running_loop())
    assert task is ctx.continuous_ucx_progress() is ctx.worker.task
    ctx.clear_progress_tasks()
    assert ctx.continuous_ucx_progress() is task  # still progressing
    # distributed-ucxx keeps its own attributes on the context.
    ctx._dask_resources = set()
    ucxx.reset()


@T(60)
@pytest.mark.no_ctx
@pytest.mark.parametrize("mode", ["blocking", "thread"])
@pytest.mark.parametrize("delayed", [True, False, None])
@pytest.mark.parametrize("future", [True, False, None])
def test_capability_flags(monkeypatch, mode, delayed, future):
    monkeypatch.delenv("UCXPY_ENABLE_DELAYED_SUBMISSION", raising=False)
    monkeypatch.delenv("UCXPY_ENABLE_PYTHON_FUTURE", raising=False)
    ucxx.reset()
    ucxx.init(progress_mode=mode, enable_delayed_submission=delayed,
              enable_python_future=future)
    try:
        w = ucxx.core._get_ctx().worker
        want_delayed = mode.startswith("thread") if delayed is None else delayed
        assert w.enable_delayed_submission is want_delayed
        assert w.enable_python_future is bool(future)
    finally:
        ucxx.reset()


@T(60)
@pytest.mark.no_ctx
@pytest.mark.parametrize("value", ["0", "1"])
def test_capability_flags_from_env(monkeypatch, value):
    monkeypatch.setenv("UCXPY_ENABLE_DELAYED_SUBMISSION", value)
    monkeypatch.setenv("UCXPY_ENABLE_PYTHON_FUTURE", value)
    ucxx.reset()
    ucxx.init()
    try:
        w = ucxx.core._get_ctx().worker
        assert w.enable_delayed_submission is (value == "1")
        assert w.enable_python_future is (value == "1")
    finally:
        ucxx.reset()


@T(60)
@pytest.mark.no_ctx
def test_init_logs_at_info(caplog):
    import logging

    ucxx.reset()
    with caplog.at_level(logging.INFO, logger="ucx"):
        ucxx.init({"SEG_SIZE": "3M"})
    assert any("UCX context created" in r.getMessage() for r in caplog.records)
    ucxx.reset()


# -------------------------------------------------------------- tag probes
async def _pair():
    accepted = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait)
    ep = await ucxx.create_endpoint("127.0.0.1", lst.port)
    sep = await asyncio.wait_for(accepted.get(), 10)
    return lst, ep, sep


async def _probe_until(probe):
    for _ in range(5000):
        res = probe()
        if res.matched:
            return res
        ucxx.progress()
        await asyncio.sleep(0)
    raise AssertionError("no message arrived")


@T(60)
@pytest.mark.parametrize("api", ["endpoint", "context"])
@pytest.mark.parametrize("remove", [False, True])
async def test_tag_probe_and_recv_with_handle(api, remove):
    from ucxx.types import Tag

    lst, ep, sep = await _pair()
    try:
        ctx = ucxx.core._get_ctx()
        probe = (lambda: sep.tag_probe(remove=remove)) if api == "endpoint" else (
            lambda: ctx.tag_probe(Tag(sep.recv_tag), remove=remove))
        assert not probe().matched and probe().sender_tag is None
        await ep.send(b"0123456789")
        res = await _probe_until(probe)
        assert res.sender_tag == Tag(sep.recv_tag) and res.length == 10
        got = bytearray(10)
        if remove:
            assert res.handle is not None
            recv = sep.recv_with_handle if api == "endpoint" else ctx.recv_with_handle
            assert await recv(got, res) == 10
            with pytest.raises(ValueError, match="already received"):
                ctx.worker.tag_recv_with_handle(bytearray(10), res.handle)
            assert not probe().matched  # it left UCX's queue
        else:
            assert res.handle is None
            with pytest.raises(ValueError):
                await ctx.recv_with_handle(got, res)
            assert probe().matched  # still queued
            assert await sep.recv(got) == 10
        assert got == b"0123456789"
        # user tags: the probe finds what recv(buf, tag) would receive
        await ep.send(b"x", tag="name")
        res = await _probe_until(lambda: sep.tag_probe("name"))
        assert res.sender_tag == sep.recv_tag_for("name") and res.length == 1
        assert await sep.recv(bytearray(1), tag="name") == 1
    finally:
        await ep.close()
        await sep.close()
        lst.close()


@T(30)
def test_tag_recv_with_handle_rejects_bad_handles():
    w = ucxx.core._get_ctx().worker
    for bad in (None, 1, object(), b"handle"):
        with pytest.raises(TypeError):
            w.tag_recv_with_handle(bytearray(1), bad)
    with pytest.raises(TypeError):
        w.tag_probe("tag")
    assert w.tag_probe(12345) is None


# --------------------------------------------------------- cluster helpers
async def _cluster_worker(rank, eps, args):
    import numpy as np

    out = [ep.send(np.array([rank], dtype="u4")) for ep in eps.values()]
    got = np.empty(len(eps), dtype="u4")
    out += [ep.recv(got[i:i + 1]) for i, ep in enumerate(eps.values())]
    await asyncio.gather(*out)
    return int(got.sum())


@T(120)
def test_benchmark_cluster_helpers(tmp_path):
    from ucxx.benchmarks.utils import _run_cluster_server, _run_cluster_workers
    from ucxx.testing import join_processes, run_in_subprocess, terminate_process

    # The helpers fork: a child gets a working UCX only if the parent has no
    # context at that moment (UCX's async thread does not survive fork).
    ucxx.reset()
    server_file = str(tmp_path / "server.json")
    server, results, server_errors = _run_cluster_server(
        server_file, 3, error_wrapper=run_in_subprocess
    )
    import time

    deadline = time.monotonic() + 60
    while not (os.path.exists(server_file) and os.path.getsize(server_file)):
        assert time.monotonic() < deadline
        time.sleep(0.05)
    workers = _run_cluster_workers(server_file, 3, 3, 0, _cluster_worker,
                                   error_wrapper=run_in_subprocess)
    got = [results.get(timeout=90) for _ in range(3)]
    join_processes([w for w, _ in workers] + [server], timeout=60)
    for w, q in workers:
        terminate_process(w, error_queue=q)
    terminate_process(server, error_queue=server_errors)
    assert got == [1 + 2, 0 + 2, 0 + 1]  # the others' ranks, in rank order
