"""Helpers RAPIDS ucxx's async test suite imports from
``ucxx._lib_async.utils_test``, in its tests and in the processes they
spawn: same names, signatures and behaviour as RAPIDS', built on this
package's public API. Test code, not API: importing it needs pytest."""

from __future__ import annotations

import asyncio
import io
import logging
import os
from contextlib import contextmanager

import numpy as np
import pytest

import ucxx
from ucxx._lib_async.pytest_stash_keys import ASYNCIO_PLUGIN_TIMEOUT_STASH_KEY

_BROKEN = "SOMETHING TERRIBLE HAS HAPPENED IN THE TEST"
_CLOSED = (ucxx.exceptions.UCXCanceledError, ucxx.exceptions.UCXCloseError)


def get_num_gpus() -> int:
    """The number of GPUs NVML sees (needs pynvml)."""
    import pynvml

    pynvml.nvmlInit()
    try:
        return pynvml.nvmlDeviceGetCount()
    finally:
        pynvml.nvmlShutdown()


def get_cuda_devices() -> list:
    """``CUDA_VISIBLE_DEVICES`` split at commas (strings), else
    ``range(get_num_gpus())`` as a list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return visible.split(",")
    return list(range(get_num_gpus()))


def compute_timeouts(pytestconfig: pytest.Config) -> tuple[float, float]:
    """``(async_timeout, join_timeout)`` below the current test's asyncio
    timeout T, which the suite's conftest stores in ``pytestconfig.stash``:
    max(0.8 T, T - 10) and max(0.9 T, T - 5). Coroutines time out first,
    then subprocess joins, then the test, so each failure shows where it
    hung. RuntimeError if no timeout was stored."""
    try:
        timeout = pytestconfig.stash[ASYNCIO_PLUGIN_TIMEOUT_STASH_KEY]
    except KeyError:
        raise RuntimeError(
            "compute_timeouts(): no asyncio timeout in pytestconfig.stash; "
            "the test suite's conftest.py sets it in pytest_runtest_setup"
        ) from None
    return max(timeout * 0.8, timeout - 10), max(timeout * 0.9, timeout - 5)


@contextmanager
def captured_logger(logger, level=logging.INFO, propagate=None):
    """Send ``logger``'s records (a Logger or its name) at ``level`` and
    above to the yielded StringIO, instead of its handlers; ``propagate``,
    if not None, replaces its propagate flag. Everything is restored on
    exit."""
    if isinstance(logger, str):
        logger = logging.getLogger(logger)
    handlers, old_level = logger.handlers[:], logger.level
    old_propagate = logger.propagate
    stream = io.StringIO()
    logger.handlers[:] = [logging.StreamHandler(stream)]
    logger.setLevel(level)
    if propagate is not None:
        logger.propagate = propagate
    try:
        yield stream
    finally:
        logger.handlers[:] = handlers
        logger.setLevel(old_level)  # not ``.level =``: clears level caches
        logger.propagate = old_propagate


def _cuda_array(size: int):
    try:
        import rmm

        return rmm.DeviceBuffer(size=size)
    except ImportError:
        import numba.cuda

        return numba.cuda.device_array((size,), dtype="u1")


def _is_cuda(frame) -> bool:
    return hasattr(frame, "__cuda_array_interface__")


async def send(ep, frames) -> None:
    """Send Dask ``frames`` with tag messages: their count (uint64), which
    are CUDA (bool each), their sizes (uint64 each), then each non-empty
    frame. Skips the test if distributed is missing."""
    pytest.importorskip("distributed")
    from distributed.utils import nbytes

    await ep.send(np.array([len(frames)], dtype=np.uint64))
    await ep.send(np.array([_is_cuda(f) for f in frames], dtype=bool))
    await ep.send(np.array([nbytes(f) for f in frames], dtype=np.uint64))
    for frame in frames:
        if nbytes(frame) > 0:
            await ep.send(frame)


async def recv(ep):
    """Receive what ``send`` sent: ``(frames, msg)``, frames in host (numpy
    uint8) or CUDA memory as sent, an empty frame as ``b""`` (host) or an
    empty CUDA buffer, msg the Dask message they deserialize to."""
    pytest.importorskip("distributed")
    from distributed.comm.utils import from_frames

    try:
        count = np.empty(1, dtype=np.uint64)
        await ep.recv(count)
        is_cuda = np.empty(count[0], dtype=bool)
        await ep.recv(is_cuda)
        sizes = np.empty(count[0], dtype=np.uint64)
        await ep.recv(sizes)
    except _CLOSED as e:
        raise type(e)(_BROKEN) from e

    frames = []
    for cuda, size in zip(is_cuda.tolist(), sizes.tolist()):
        if cuda:
            frame = _cuda_array(size)
        elif size > 0:
            frame = np.empty(size, dtype=np.uint8)
        else:
            frame = b""
        if size > 0:
            await ep.recv(frame)
        frames.append(frame)
    return frames, await from_frames(frames)


async def am_send(ep, frames) -> None:
    """Send Dask ``frames`` as active messages: their count (uint64), then
    each frame."""
    await ep.am_send(np.array([len(frames)], dtype=np.uint64))
    for frame in frames:
        await ep.am_send(frame)


async def am_recv(ep):
    """Receive what ``am_send`` sent: ``(frames, msg)`` as ``recv``."""
    pytest.importorskip("distributed")
    from distributed.comm.utils import from_frames

    try:
        count = int(np.frombuffer(await ep.am_recv(), dtype=np.uint64)[0])
    except _CLOSED as e:
        raise type(e)(_BROKEN) from e

    frames = [await ep.am_recv() for _ in range(count)]
    return frames, await from_frames(frames)


async def wait_listener_client_handlers(listener) -> None:
    """Return once none of ``listener``'s connection handlers runs any
    more, progressing the worker meanwhile unless a progress thread does."""
    while listener.active_clients > 0:
        # A positive sleep (not 0) lets callbacks scheduled from other
        # threads run too.
        await asyncio.sleep(1e-9)
        if not ucxx.core._get_ctx().progress_mode.startswith("thread"):
            ucxx.progress()
