"""Hostile and bad input: a catalogue of wrong calls and wrong bytes.

One test per row (``test_bad_input[<row id>]``). Each row makes one wrong
call or sends one hostile message and returns the exception it observed;
the test checks it against the row's expected exception. The ``leak_check``
marker (conftest) makes every row also prove that no fd, asyncio task or
thread outlived it. Rows that could take the interpreter down (corrupted
worker addresses, CUDA interfaces with absurd sizes, fork) run in a child
process, so a crash is reported as a failure instead of ending the run.

The catalogue is the list of rows below (summarised in docs/RELIABILITY.md,
"Bad input"); to print it as a table with the observed exceptions::

    UCXX_BAD_INPUT_TABLE=/tmp/bad_input.md pytest tests/test_bad_input.py
"""

from __future__ import annotations

import asyncio
import gc
import inspect
import logging
import os
import socket
import struct
import subprocess
import sys
import textwrap
import threading
import weakref
from dataclasses import dataclass, field

import numpy as np
import pytest

import ucxx
import ucxx.core
from ucxx import _ucxx as U
from ucxx._lib_async import exchange_peer_info as hs
from ucxx._lib_async import frames

pytestmark = pytest.mark.leak_check

HOST = "127.0.0.1"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
STEP_TIMEOUT = 10.0  # seconds any single awaited step may take


# ------------------------------------------------------------------ helpers
async def catch(f, timeout: float = STEP_TIMEOUT):
    """Call ``f()``, await the result if awaitable (bounded): the exception
    raised, or None."""
    try:
        r = f()
        if inspect.isawaitable(r):
            await asyncio.wait_for(_aw(r), timeout)
    except asyncio.TimeoutError as e:
        raise AssertionError(f"no answer within {timeout} s") from e
    except Exception as e:  # noqa: BLE001 - the point is to catch it
        return e
    return None


async def _aw(x):
    return await x


class Env:
    """What a row needs, created on demand and torn down after the row."""

    def __init__(self):
        self._pair = None
        self._listener = None
        self.cleanup = []

    async def pair(self):
        """(client endpoint, server endpoint), connected through a listener."""
        if self._pair is None:
            accepted: asyncio.Queue = asyncio.Queue()
            self._listener = ucxx.create_listener(accepted.put_nowait, host=HOST)
            ep = await ucxx.create_endpoint(HOST, self._listener.port)
            sep = await asyncio.wait_for(accepted.get(), STEP_TIMEOUT)
            self._pair = (ep, sep)
        return self._pair

    async def check_pair_works(self):
        """The pair still carries messages in order (nothing stray posted)."""
        ep, sep = await self.pair()
        buf = bytearray(5)
        r = sep.recv(buf)
        await ep.send(b"after")
        assert await asyncio.wait_for(_aw(r), STEP_TIMEOUT) == 5 and buf == b"after"

    async def close(self):
        for f in reversed(self.cleanup):
            r = f()
            if inspect.isawaitable(r):
                await asyncio.wait_for(_aw(r), STEP_TIMEOUT)
        if self._pair is not None:
            for e in self._pair:
                await asyncio.wait_for(e.close(), STEP_TIMEOUT)
        if self._listener is not None:
            self._listener.close()


def run_isolated(code: str, timeout: float = 60.0) -> subprocess.CompletedProcess:
    """Run ``code`` in a fresh interpreter; it prints ``RAISED <Type>`` or
    ``NORAISE``."""
    env = dict(os.environ)
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                          text=True, timeout=timeout, env=env)


class ChildOutcome(Exception):
    """How an isolated child ended when it did not raise in Python: killed by
    a signal (crash) or returned without raising."""


def isolated_outcome(p: subprocess.CompletedProcess):
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith(("RAISED", "NORAISE"))]
    if p.returncode != 0:
        tail = " | ".join(p.stderr.strip().splitlines()[-3:])
        sig = f"signal {-p.returncode}" if p.returncode < 0 else f"status {p.returncode}"
        return ChildOutcome(f"child process died ({sig}): {tail}")
    if not lines:
        return ChildOutcome(f"child printed nothing: {p.stderr[-500:]}")
    words = lines[-1].split(" ", 2)
    if words[0] == "NORAISE":
        return None
    import builtins

    exc_type = getattr(U, words[1], None) or getattr(builtins, words[1], None)
    if not (isinstance(exc_type, type) and issubclass(exc_type, Exception)):
        exc_type = ChildOutcome
    return exc_type(words[2] if len(words) > 2 else "")


ISOLATED_PRELUDE = """
import asyncio, sys, ucxx
from ucxx import _ucxx as U
def report(f):
    try:
        f()
    except Exception as e:
        print("RAISED", type(e).__name__, str(e).replace("\\n", " ")[:200], flush=True)
    else:
        print("NORAISE", flush=True)
"""


@dataclass
class Row:
    id: str
    input: str
    expected: tuple | type | None
    fn: object
    match: str | None = None
    marks: list = field(default_factory=list)


ROWS: list[Row] = []


def row(id, input, expected, match=None, marks=()):
    def deco(fn):
        ROWS.append(Row(id, input, expected, fn, match, list(marks)))
        return fn
    return deco


# ================================================================== buffers
@row("send-none", "ep.send(None)", TypeError, "bytes-like")
async def _(env):
    ep, _sep = await env.pair()
    e = await catch(lambda: ep.send(None))
    await env.check_pair_works()
    return e


@row("send-int", "ep.send(42)", TypeError, "bytes-like")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(42))


@row("send-str", "ep.send('text')", TypeError, "bytes-like")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send("text"))


@row("recv-into-bytes", "ep.recv(b'abc') (read-only)", BufferError, "not writable")
async def _(env):
    _ep, sep = await env.pair()
    e = await catch(lambda: sep.recv(b"abc"))
    await env.check_pair_works()
    return e


@row("recv-readonly-memoryview", "recv into memoryview(...).toreadonly()", BufferError,
     "not writable")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.recv(memoryview(bytearray(4)).toreadonly()))


@row("recv-readonly-numpy", "recv into np.frombuffer(b'...')", (ValueError, BufferError),
     "read-only")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.recv(np.frombuffer(b"abcd", np.uint8)))


@row("recv-strided-numpy", "recv into np.zeros(10)[::2]", (ValueError, BufferError),
     "contiguous")
async def _(env):
    _ep, sep = await env.pair()
    e = await catch(lambda: sep.recv(np.zeros(10, np.uint8)[::2]))
    await env.check_pair_works()
    return e


@row("recv-strided-memoryview", "recv into memoryview(bytearray(10))[::2]",
     (ValueError, BufferError), "contiguous")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.recv(memoryview(bytearray(10))[::2]))


@row("recv-fortran-numpy", "recv into a Fortran-ordered 3x4 array", (ValueError, BufferError),
     "contiguous")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.recv(np.zeros((3, 4), np.uint8, order="F")))


@row("send-strided-numpy", "ep.send(np.arange(10)[::2])", (ValueError, BufferError),
     "contiguous")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(np.arange(10, dtype=np.uint8)[::2]))


@row("gather-send-not-a-list", "ep.gather_send(5)", TypeError, "sequence")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.gather_send(5))


@row("gather-send-bad-element", "ep.gather_send([b'a', None]): nothing is posted",
     TypeError, "bytes-like")
async def _(env):
    ep, _sep = await env.pair()
    e = await catch(lambda: ep.gather_send([b"a", None]))
    await env.check_pair_works()  # b"a" was not sent ahead of the error
    return e


@row("gather-recv-readonly-element", "ep.gather_recv([bytearray(1), b'x']): nothing posted",
     BufferError, "not writable")
async def _(env):
    _ep, sep = await env.pair()
    e = await catch(lambda: sep.gather_recv([bytearray(5), b"x"]))
    await env.check_pair_works()  # no receive was left posted
    return e


@row("resize-bytearray-pending-recv",
     "bytearray.extend() while a receive into it is pending", BufferError, "re-sized")
async def _(env):
    ep, sep = await env.pair()
    ba = bytearray(10)
    r = sep.recv(ba)
    e = await catch(lambda: ba.extend(b"x"))
    await ep.send(b"0123456789")
    assert await r == 10 and ba == b"0123456789"
    return e


@row("resize-numpy-pending-recv", "ndarray.resize() while a receive into it is pending",
     ValueError, "resize")
async def _(env):
    ep, sep = await env.pair()
    arr = np.zeros(10, np.uint8)
    r = sep.recv(arr)
    e = await catch(lambda: arr.resize(20))
    await ep.send(b"0123456789")
    assert await r == 10 and arr.tobytes() == b"0123456789"
    return e


@row("release-memoryview-pending-recv",
     "memoryview.release() while a receive into it is pending", BufferError, "export")
async def _(env):
    ep, sep = await env.pair()
    mv = memoryview(bytearray(10))
    r = sep.recv(mv)
    e = await catch(lambda: mv.release())
    await ep.send(b"abcdefghij")
    assert await r == 10 and bytes(mv) == b"abcdefghij"
    return e


class _Buf(bytearray):
    """A bytearray that can be weakly referenced."""


@row("drop-recv-buffer-in-flight",
     "the only reference to a pending receive's buffer dropped (+ gc)", None)
async def _(env):
    ep, sep = await env.pair()
    buf = _Buf(1 << 20)
    ref = weakref.ref(buf)
    r = sep.recv(buf)
    del buf
    gc.collect()
    assert ref() is not None, "the package let go of a buffer UCX writes into"
    await ep.send(b"z" * (1 << 20))
    assert await r == 1 << 20
    # The request released it on completion: nothing else referenced it.
    del r
    gc.collect()
    assert ref() is None, "the buffer outlived its request"
    return None


@row("drop-send-buffer-in-flight",
     "the only reference to a pending send's buffer dropped (+ gc)", None)
async def _(env):
    ep, sep = await env.pair()
    # 16 MiB: a rendezvous, pending until the receive is posted (a smaller,
    # eager send may complete at once into the socket buffers, and then
    # nothing reads the buffer any more).
    n = 16 << 20
    buf = _Buf(b"q" * n)
    ref = weakref.ref(buf)
    s = ep.send(buf)
    del buf
    gc.collect()
    assert not s.done()
    assert ref() is not None, "the package let go of a buffer UCX reads from"
    out = bytearray(n)
    assert await sep.recv(out) == n and out[:1] == b"q" and out[-1:] == b"q"
    await s
    del s
    gc.collect()
    assert ref() is None
    return None


class _Cuda:
    def __init__(self, iface):
        self.__cuda_array_interface__ = iface


@row("cuda-interface-empty", "an object whose __cuda_array_interface__ is {}", TypeError,
     "needs")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(_Cuda({})))


@row("cuda-interface-not-dict", "__cuda_array_interface__ = 5", TypeError, "dict")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(_Cuda(5)))


@row("cuda-interface-negative-shape", "__cuda_array_interface__ with shape (-1,)",
     ValueError, "negative")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(_Cuda(
        {"shape": (-1,), "typestr": "|u1", "data": (0, False), "version": 3})))


@row("cuda-interface-bad-typestr", "__cuda_array_interface__ with typestr 'zz'",
     TypeError, "typestr")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(_Cuda(
        {"shape": (4,), "typestr": "zz", "data": (0, False), "version": 3})))


@row("cuda-interface-size-overflow",
     "__cuda_array_interface__ whose shape x itemsize overflows 64 bits "
     "(shape (2**62, 8), '|u1', and 5 others), or whose bytes run past the end of "
     "the address space; isolated", OverflowError, "overflows")
async def _(env):
    p = run_isolated(ISOLATED_PRELUDE + """
class C:
    def __init__(self, shape, typestr, ptr=0x1000):
        self.__cuda_array_interface__ = {"shape": shape, "typestr": typestr,
                                         "data": (ptr, False), "version": 3}
ctx = U.Context({"TLS": "tcp"}); w = U.Worker(ctx)
ep = w.ep_from_address(w.address)
CASES = [((2**62, 8), "|u1"),            # wraps to 0 without a check
         ((2**62,), "<f8"),              # 2**65: wraps to 0
         ((2**40, 2**30), "|u1"),        # 2**70
         ((3, 2**62), "|u1"),            # wraps to 2**62 (a "valid" size)
         ((2**61 + 1,), "<f4"),          # wraps to 4
         ((2**20,) * 4, "<c16")]         # 2**84
def f():
    first = None
    for shape, typestr in CASES:
        try:
            ep.tag_send(C(shape, typestr), 1)
        except OverflowError as e:
            first = first or e
        else:
            raise AssertionError(f"shape {shape} {typestr}: a transfer was posted")
    try:
        ep.tag_send(C((32,), "|u1", ptr=2**64 - 16), 1)
    except OverflowError as e:
        assert "address space" in str(e), e
    else:
        raise AssertionError("32 bytes at 2**64 - 16: a transfer was posted")
    raise first
report(f)
ep.abort(); w.close(); ctx.close()
""")
    return isolated_outcome(p)


@row("cuda-interface-empty-huge-extent",
     "__cuda_array_interface__ with shape (0, 2**62, 8): empty, no overflow; "
     "a zero-byte receive is posted and cancelled", None)
async def _(env):
    _ep, sep = await env.pair()
    r = sep._ep.tag_recv(_Cuda({"shape": (0, 2**62, 8), "typestr": "|u1",
                                "data": (0x1000, False), "version": 3}), 0xC0FFEE)
    r.cancel()
    e = await catch(lambda: r)
    assert isinstance(e, U.UCXCanceledError), e
    return None


# ===================================================================== tags
@row("tag-tuple", "ep.send(b'x', tag=('a',)) (a user tag is an int, str or bytes)",
     TypeError, "int, str or bytes")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(b"x", tag=("a",)))


@row("tag-float", "ep.recv(buf, tag=1.5)", TypeError, "int")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.recv(bytearray(1), tag=1.5))


@row("forced-tag-negative", "ep.send(b'x', tag=-1, force_tag=True)", ValueError, "2\\*\\*64")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(b"x", tag=-1, force_tag=True))


@row("forced-tag-too-big", "ep.send(b'x', tag=2**64, force_tag=True)", ValueError,
     "2\\*\\*64")
async def _(env):
    ep, _sep = await env.pair()
    return await catch(lambda: ep.send(b"x", tag=2 ** 64, force_tag=True))


@row("tag-recv-negative-mask", "ep.tag_recv(buf, 1, mask=-1)", ValueError, "2\\*\\*64")
async def _(env):
    _ep, sep = await env.pair()
    return await catch(lambda: sep.tag_recv(bytearray(1), 1, -1))


@row("mixed-tag-negative",
     "ep.send(b'x', tag=-1) (mixed tag): accepted as its low 64 bits; matches "
     "recv(tag=2**64-1)", None)
async def _(env):
    ep, sep = await env.pair()
    buf = bytearray(3)
    r = sep.recv(buf, tag=2 ** 64 - 1)
    await ep.send(b"neg", tag=-1)
    assert await asyncio.wait_for(_aw(r), STEP_TIMEOUT) == 3 and buf == b"neg"
    return None


@row("worker-recv-tag-str", "ucxx.recv(buf, tag='x')", TypeError, "int")
async def _(env):
    return await catch(lambda: ucxx.recv(bytearray(1), "x"))


# ==================================================================== sizes
@row("recv-buffer-too-small", "a 9-byte message into a 2-byte receive", U.UCXMessageTruncatedError)
async def _(env):
    ep, sep = await env.pair()
    r = sep.recv(bytearray(2))
    await ep.send(b"too long!")
    e = await catch(lambda: r)
    await env.check_pair_works()
    return e


async def _hostile(env, receive, msgs):
    """Post ``receive(server_ep)``, send raw ``msgs`` from the client on
    the connection's tag, return the receive's exception."""
    ep, sep = await env.pair()
    r = asyncio.ensure_future(receive(sep))
    for m in msgs:
        await ep.send(m)
    e = await catch(lambda: r)
    return e


@row("send-obj-huge-size", "send_obj size header announcing 2**63 bytes", ucxx.UCXError,
     "limit")
async def _(env):
    return await _hostile(env, lambda s: s.recv_obj(), [struct.pack("<Q", 2 ** 63)])


@row("send-obj-short-header", "send_obj size header of 4 bytes", ucxx.UCXError,
     "malformed size header")
async def _(env):
    return await _hostile(env, lambda s: s.recv_obj(), [b"\x01\x00\x00\x00"])


@row("send-obj-long-header", "send_obj size header of 9 bytes", U.UCXMessageTruncatedError)
async def _(env):
    return await _hostile(env, lambda s: s.recv_obj(), [b"\x01" * 9])


@row("send-obj-payload-longer", "send_obj announcing 3 bytes, payload of 6",
     U.UCXMessageTruncatedError)
async def _(env):
    return await _hostile(env, lambda s: s.recv_obj(), [struct.pack("<Q", 3), b"123456"])


@row("send-obj-over-configured-limit", "recv_obj with recv_multi_max_bytes=10, 11 announced",
     ucxx.UCXError, "limit of 10")
async def _(env):
    _ep, sep = await env.pair()
    sep.recv_multi_max_bytes = 10
    return await _hostile(env, lambda s: s.recv_obj(), [struct.pack("<Q", 11)])


P = frames.PREFIX


def _hdr(count, total, flags=0, magic=b"UCXM", version=frames.VERSION):
    return P.pack(magic, version, flags, 0, count, total)


@row("multi-huge-count", "recv_multi header announcing 2**32-1 frames", ucxx.UCXError,
     "frames, more than the limit")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(2 ** 32 - 1, 0)])


@row("multi-huge-total", "recv_multi header announcing 2**64-1 bytes", ucxx.UCXError,
     "bytes, more than the limit")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(),
                          [_hdr(1, 2 ** 64 - 1) + struct.pack("<Q", 2 ** 64 - 1) + b"\0"])


@row("multi-truncated-header", "recv_multi header of 5 bytes", ucxx.UCXError, "too short")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [b"UCXM\x01"])


@row("multi-bad-magic", "recv_multi header with magic b'EVIL'", ucxx.UCXError, "bad magic")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(0, 0, magic=b"EVIL")])


@row("multi-bad-version", "recv_multi header with version 9", ucxx.UCXError, "version 9")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(0, 0, version=9)])


@row("multi-sizes-dont-add-up", "frame table sizes summing to 6, header total 5",
     ucxx.UCXError, "add up")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(),
                          [_hdr(1, 5) + struct.pack("<Q", 6) + b"\0"])


@row("multi-unknown-memtype", "frame table with memory type 7", ucxx.UCXError,
     "unknown memory type")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(),
                          [_hdr(1, 5) + struct.pack("<Q", 5) + b"\7"])


@row("multi-table-short", "inline frame table of 8 bytes for 2 frames", ucxx.UCXError,
     "28 bytes for 2 frames")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(2, 5) + struct.pack("<Q", 5)])


@row("multi-header-too-long", "recv_multi header message of 5004 bytes (max 4096)",
     U.UCXMessageTruncatedError)
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [b"UCXM" + b"\0" * 5000])


@row("multi-separate-table-short", "flag 'table follows', then a 7-byte table for 500 frames",
     ucxx.UCXError, "table of 7 bytes for 500 frames")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(500, 5, flags=1), b"\0" * 7])


@row("multi-separate-table-few-frames", "flag 'table follows' for 2 frames (they fit inline)",
     ucxx.UCXError, "separate table for 2 frames")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(2, 5, flags=1), b"\0" * 18])


@row("multi-flag-with-inline-table", "flag 'table follows' on a header with inline bytes",
     ucxx.UCXError, "separate table")
async def _(env):
    return await _hostile(env, lambda s: s.recv_multi(), [_hdr(1, 5, flags=1) + b"x"])


@row("multi-frame-longer-than-announced", "frame of 12 bytes where the table says 5",
     U.UCXMessageTruncatedError)
async def _(env):
    ep, sep = await env.pair()
    e = await _hostile(env, lambda s: s.recv_multi(),
                       [_hdr(1, 5) + struct.pack("<Q", 5) + b"\0", b"toolongframe"])
    # The frame's one message was consumed whole: the stream is between
    # two messages and further gathers are accepted.
    r = sep.gather_recv([bytearray(1)])
    assert r.cancel() is True
    with pytest.raises(U.UCXCanceledError):
        await r
    return e


@row("multi-cuda-frame-no-allocator", "a CUDA frame announced where no rmm/cupy/numba exists",
     ucxx.UCXError, "no CUDA allocator")
async def _(env):
    for mod in ("rmm", "cupy", "numba"):
        try:
            __import__(mod)
        except ImportError:
            continue
        pytest.skip(f"{mod} is installed: a CUDA allocator exists")
    return await _hostile(env, lambda s: s.recv_multi(),
                          [_hdr(1, 5) + struct.pack("<Q", 5) + b"\1"])


# ======================================================= active messages
async def _am_with_allocator(env, alloc):
    ep, sep = await env.pair()
    w = ucxx.core._get_ctx().worker
    w.register_am_allocator(U.MEMORY_TYPE_HOST, alloc)
    env.cleanup.append(lambda: w.register_am_allocator(U.MEMORY_TYPE_HOST, bytearray))
    r = asyncio.ensure_future(sep.am_recv())
    await ep.am_send(b"hello")
    return await catch(lambda: r)


@row("am-allocator-returns-int", "AM allocator returning 42", TypeError, "bytes-like")
async def _(env):
    return await _am_with_allocator(env, lambda n: 42)


@row("am-allocator-raises", "AM allocator raising ZeroDivisionError", ZeroDivisionError)
async def _(env):
    return await _am_with_allocator(env, lambda n: 1 / 0)


@row("am-allocator-too-small", "AM allocator returning 1 byte for 5", U.UCXMessageTruncatedError,
     "returned 1 bytes")
async def _(env):
    return await _am_with_allocator(env, lambda n: bytearray(1))


@row("am-allocator-readonly", "AM allocator returning bytes (read-only)", BufferError,
     "not writable")
async def _(env):
    return await _am_with_allocator(env, lambda n: bytes(n))


@row("am-allocator-not-callable", "ucxx.register_am_allocator(5)", TypeError)
async def _(env):
    return await catch(lambda: ucxx.register_am_allocator(5))


@row("am-allocator-bad-type", "ucxx.register_am_allocator(bytearray, 'gpu')", ValueError,
     "'host' or 'cuda'")
async def _(env):
    return await catch(lambda: ucxx.register_am_allocator(bytearray, "gpu"))


@row("am-allocator-unknown-memtype", "Worker.register_am_allocator(99, bytearray) (and -1, "
     "MEMORY_TYPE_UNKNOWN, 2**70): nothing stored", ValueError, "unknown memory type 99")
async def _(env):
    w = ucxx.core._get_ctx().worker
    for bad in (-1, U.MEMORY_TYPE_UNKNOWN, 2**70):
        e = await catch(lambda: w.register_am_allocator(bad, bytearray))
        assert isinstance(e, ValueError) and "unknown memory type" in str(e), (bad, e)
    e = await catch(lambda: w.register_am_allocator(99, bytearray))
    w.register_am_allocator(U.MEMORY_TYPE_HOST, bytearray)  # a valid type still is
    return e


# ============================================================ addresses
@row("connect-bad-ip", "create_endpoint('300.1.2.3', 1234)", ValueError, "300.1.2.3")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint("300.1.2.3", 1234))


@row("connect-empty-host", "create_endpoint('', 1234)", ValueError, "invalid address")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint("", 1234))


@row("connect-port-negative", "create_endpoint(host, -1)", ValueError, "-1")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint(HOST, -1))


@row("connect-port-too-big", "create_endpoint(host, 70000)", ValueError, "70000")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint(HOST, 70000))


@row("connect-port-str", "create_endpoint(host, '80')", ValueError, "'80'")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint(HOST, "80"))


@row("connect-nobody-listening", "create_endpoint to a closed port (connect_timeout=3)",
     ucxx.UCXError, "cannot connect|failed")
async def _(env):
    with socket.socket() as s:
        s.bind((HOST, 0))
        port = s.getsockname()[1]
    return await catch(lambda: ucxx.create_endpoint(HOST, port, connect_timeout=3))


@row("listen-port-too-big", "create_listener(cb, port=70000)", ValueError, "70000")
async def _(env):
    return await catch(lambda: ucxx.create_listener(lambda ep: None, port=70000))


@row("listen-port-in-use", "create_listener on a port a socket already listens on",
     U.UCXBusyError, "cannot listen")
async def _(env):
    with socket.socket() as s:
        s.bind((HOST, 0))
        s.listen()
        return await catch(lambda: ucxx.create_listener(lambda ep: None,
                                                        port=s.getsockname()[1], host=HOST))


@row("listen-bad-host", "create_listener(cb, host='999.1.1.1')", ValueError, "999.1.1.1")
async def _(env):
    return await catch(lambda: ucxx.create_listener(lambda ep: None, host="999.1.1.1"))


@row("listen-callback-not-callable", "create_listener(5)", TypeError, "callable")
async def _(env):
    return await catch(lambda: ucxx.create_listener(5))


@row("worker-address-int", "create_endpoint_from_worker_address(12345)", TypeError,
     "bytes-like")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint_from_worker_address(12345))


@row("worker-address-7-bytes", "create_endpoint_from_worker_address(b'garbage')",
     U.UCXConfigError, "invalid UCX worker address")
async def _(env):
    return await catch(lambda: ucxx.create_endpoint_from_worker_address(b"garbage"))


@row("worker-address-truncated", "a real worker address cut to 8..24 bytes (header and "
     "worker id: 17 endpoints); isolated", ucxx.UCXError)
async def _(env):
    p = run_isolated(ISOLATED_PRELUDE + """
ctx = U.Context({"TLS": "tcp"}); w = U.Worker(ctx)
addr = w.address
errors = set()
for n in range(8, 25):
    try:
        w.ep_from_address(addr[:n]).abort()
    except U.UCXError as e:
        errors.add(type(e).__name__)
    w.progress()
w.close(); ctx.close()
def f():
    if errors:
        raise U.UCXInvalidParamError(",".join(sorted(errors)))
report(f)
""")
    return isolated_outcome(p)


@row("worker-address-bad-version", "a real worker address with a first byte whose version "
     "nibble is not 0 (v1) or 1 (v2): 0xff and the 223 others, each; isolated",
     U.UCXInvalidParamError, "unsupported address version 15 \\(first byte 0xff")
async def _(env):
    p = run_isolated(ISOLATED_PRELUDE + """
ctx = U.Context({"TLS": "tcp"}); w = U.Worker(ctx)
addr = w.address
def attempt(first):
    a = bytearray(addr); a[0] = first
    try:
        w.ep_from_address(bytes(a)).abort()
    except U.UCXInvalidParamError as e:
        assert "unsupported address version" in str(e), e
        return e
    raise AssertionError(f"first byte {first:#04x}: an endpoint was created")
def f():
    for first in range(256):
        if first & 0x0f >= 2 and first != 0xff:
            attempt(first)
    raise attempt(0xff)
report(f)
w.close(); ctx.close()
""")
    return isolated_outcome(p)


@row("worker-address-header-overrun", "worker addresses whose header announces more than "
     "they hold (uuid, client id, a 200-byte name), v1 and v2; isolated",
     U.UCXInvalidParamError, "too short for its header")
async def _(env):
    p = run_isolated(ISOLATED_PRELUDE + """
ctx = U.Context({"TLS": "tcp"}); w = U.Worker(ctx)
cases = [bytes([0x70]) + bytes(7),                       # v1: name, uuid, client id: 19
         bytes([0x20]) + bytes(8),                       # v1: uuid, no device byte: 10
         bytes([0x61, 0x06]) + bytes(14),                # v2: uuid, client id: 19
         bytes([0x61, 0x03]) + bytes(8) + bytes([200]) + bytes(40)]  # v2: name of 200
def f():
    for a in cases:
        try:
            w.ep_from_address(a).abort()
        except U.UCXInvalidParamError as e:
            assert "too short for its header" in str(e), (a.hex(), e)
            last = e
        else:
            raise AssertionError(f"{a.hex()}: an endpoint was created")
    raise last
report(f)
w.close(); ctx.close()
""")
    return isolated_outcome(p)


@row("worker-address-zeroed-bytes", "a real worker address with each byte after the "
     "header zeroed in turn, then cut to every length (one endpoint each); isolated",
     ucxx.UCXError, marks=[pytest.mark.xfail(strict=True, reason=(
         "UCX 1.22 does not validate worker addresses: zeroing one length field "
         "crashes ucp_ep_create (SIGSEGV in uct_tcp_ep_set_dest_addr, iface_addr "
         "NULL), and so, for some addresses (about 1 run in 15), does cutting one "
         "in its second device's part; worker addresses must come from a trusted "
         "peer"))])
async def _(env):
    p = run_isolated(ISOLATED_PRELUDE + """
ctx = U.Context({"TLS": "tcp"}); w = U.Worker(ctx)
addr = w.address
variants = []
for pos in range(1, len(addr)):
    a = bytearray(addr)
    a[pos] = 0
    variants.append(bytes(a))
variants += [addr[:n] for n in range(8, len(addr))]
errors = set()
for a in variants:
    try:
        w.ep_from_address(a).abort()
    except U.UCXError as e:
        errors.add(type(e).__name__)
    w.progress()
w.close(); ctx.close()
def f():
    raise U.UCXInvalidParamError(",".join(sorted(errors)))
report(f)
""", timeout=120)
    return isolated_outcome(p)


# ============================================================== options
@row("option-unknown-name", "init(options={'FOO_BAR_BAZ': '1'})", U.UCXConfigError,
     "FOO_BAR_BAZ", marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(options={"FOO_BAR_BAZ": "1"}))


@row("option-bad-value", "init(options={'RNDV_THRESH': 'lots'})", U.UCXConfigError,
     "RNDV_THRESH", marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(options={"RNDV_THRESH": "lots"}))


@row("option-name-not-str", "init(options={1: 'x'})", TypeError, "must be str",
     marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(options={1: "x"}))


@row("options-not-a-dict", "init(options='TLS=tcp')", (TypeError, ValueError),
     marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(options="TLS=tcp"))


@row("option-no-such-transport", "init(options={'TLS': 'nonexistent'})", ucxx.UCXError,
     marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(options={"TLS": "nonexistent"}))


@row("get-config-unknown-option", "ucxx._ucxx.get_config({'NO_SUCH_OPTION': 'y'})",
     U.UCXConfigError, "NO_SUCH_OPTION")
async def _(env):
    return await catch(lambda: U.get_config({"NO_SUCH_OPTION": "y"}))


@row("progress-mode-unknown", "init(progress_mode='turbo')", ValueError, "turbo",
     marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(progress_mode="turbo"))


@row("progress-mode-unknown-env", "$UCXPY_PROGRESS_MODE=warp, init()", ValueError,
     "UCXPY_PROGRESS_MODE", marks=[pytest.mark.no_ctx])
async def _(env):
    old = os.environ.get("UCXPY_PROGRESS_MODE")
    os.environ["UCXPY_PROGRESS_MODE"] = "warp"
    try:
        return await catch(lambda: ucxx.init())
    finally:
        if old is None:
            del os.environ["UCXPY_PROGRESS_MODE"]
        else:
            os.environ["UCXPY_PROGRESS_MODE"] = old


@row("progress-mode-unknown-worker", "_ucxx.Worker(ctx, 'turbo')", ValueError, "turbo",
     marks=[pytest.mark.no_ctx])
async def _(env):
    ctx = U.Context({"TLS": "tcp"})
    env.cleanup.append(ctx.close)
    return await catch(lambda: U.Worker(ctx, "turbo"))


@row("connect-timeout-negative", "init(connect_timeout=-1)", ValueError, "connect_timeout",
     marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(connect_timeout=-1))


@row("spin-us-bad", "init(spin_us='abc')", ValueError, "spin_us", marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(spin_us="abc"))


@row("init-twice", "init() twice", RuntimeError, "already", marks=[pytest.mark.no_ctx])
async def _(env):
    ucxx.init()
    env.cleanup.append(ucxx.reset)
    return await catch(lambda: ucxx.init())


@row("init-unknown-keyword", "init(bogus=1)", TypeError, "bogus", marks=[pytest.mark.no_ctx])
async def _(env):
    return await catch(lambda: ucxx.init(bogus=1))


# ========================================================== after close
async def _aborted_pair(env):
    ep, sep = await env.pair()
    ep.abort()
    sep.abort()
    return ep, sep


@row("send-after-abort", "ep.send() after ep.abort()", U.UCXCloseError)
async def _(env):
    ep, _ = await _aborted_pair(env)
    return await catch(lambda: ep.send(b"x"))


@row("recv-after-abort", "ep.recv() after ep.abort()", U.UCXCloseError)
async def _(env):
    ep, _ = await _aborted_pair(env)
    return await catch(lambda: ep.recv(bytearray(1)))


@row("gather-after-abort", "ep.gather_send() after ep.abort()", U.UCXCloseError)
async def _(env):
    ep, _ = await _aborted_pair(env)
    return await catch(lambda: ep.gather_send([b"x"]))


@row("am-send-after-abort", "ep.am_send() after ep.abort()", U.UCXCloseError)
async def _(env):
    ep, _ = await _aborted_pair(env)
    return await catch(lambda: ep.am_send(b"x"))


@row("send-obj-after-abort", "ep.send_obj() after ep.abort()", U.UCXCloseError)
async def _(env):
    ep, _ = await _aborted_pair(env)
    return await catch(lambda: ep.send_obj(b"x"))


@row("send-after-peer-closed", "ep.send() on the side whose peer closed it", U.UCXCloseError)
async def _(env):
    ep, sep = await env.pair()
    await ep.close()
    for _ in range(500):
        if sep.closed:
            break
        await asyncio.sleep(0.01)
    return await catch(lambda: sep.send(b"x"))


@row("send-after-close", "ep.send() after await ep.close() returned (up to 200 connections)",
     U.UCXCloseError)
async def _(env):
    accepted: asyncio.Queue = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host=HOST)
    env.cleanup.append(lst.close)
    seen = []
    for _ in range(200):
        ep = await ucxx.create_endpoint(HOST, lst.port)
        sep = await asyncio.wait_for(accepted.get(), STEP_TIMEOUT)
        await ep.close()
        await sep.close()
        e = await catch(lambda: ep.send(b"x"))
        seen.append(e)
        if not isinstance(e, U.UCXCloseError):
            return e
    return seen[0]


@row("worker-recv-after-close", "Worker.tag_recv() on a closed worker", U.UCXCloseError,
     marks=[pytest.mark.no_ctx])
async def _(env):
    ctx = U.Context({"TLS": "tcp"})
    w = U.Worker(ctx)
    w.close()
    env.cleanup.append(ctx.close)
    return await catch(lambda: w.tag_recv(bytearray(1), 1))


@row("worker-on-closed-context", "Worker(ctx) after ctx.close()", U.UCXCloseError,
     marks=[pytest.mark.no_ctx])
async def _(env):
    ctx = U.Context({"TLS": "tcp"})
    ctx.close()
    return await catch(lambda: U.Worker(ctx))


@row("context-close-with-worker", "Context.close() while a worker is open", ucxx.UCXError,
     "open worker", marks=[pytest.mark.no_ctx])
async def _(env):
    ctx = U.Context({"TLS": "tcp"})
    w = U.Worker(ctx)
    env.cleanup.append(ctx.close)
    env.cleanup.append(w.close)
    return await catch(lambda: ctx.close())


# ============================================================== threads
def _in_thread(f):
    out = []

    def run():
        try:
            f()
        except BaseException as e:  # noqa: BLE001
            out.append(e)
        else:
            out.append(None)

    t = threading.Thread(target=run)
    t.start()
    t.join(STEP_TIMEOUT)
    assert not t.is_alive()
    return out[0]


@row("send-from-other-thread", "ep.send() from a thread while the loop drives the worker",
     RuntimeError, "thread")
async def _(env):
    ep, _sep = await env.pair()
    e = _in_thread(lambda: ep.send(b"x"))
    await env.check_pair_works()
    return e


@row("progress-from-other-thread", "ucxx.progress() from another thread", RuntimeError,
     "thread")
async def _(env):
    await env.pair()
    return _in_thread(ucxx.progress)


@row("second-loop-in-thread", "asyncio.run(create_endpoint(...)) in another thread "
     "while this loop drives the worker", RuntimeError, "thread")
async def _(env):
    ep, _sep = await env.pair()
    port = env._listener.port
    return _in_thread(lambda: asyncio.run(ucxx.create_endpoint(HOST, port)))


# ================================================================= fork
@row("use-in-forked-child", "send/recv/progress/listen/address in a fork()ed child; "
     "the parent then round-trips", RuntimeError, "forked child")
async def _(env):
    ep, sep = await env.pair()
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: report and leave without running any cleanup
        try:
            os.close(r)
            results = []
            for f in (lambda: ep.send(b"x"), lambda: sep.recv(bytearray(1)),
                      ucxx.progress, lambda: ucxx.create_listener(lambda e: None),
                      ucxx.get_worker_address):
                try:
                    f()
                    results.append("NORAISE")
                except RuntimeError as e:
                    results.append("RuntimeError:" + str(e)[:60])
                except BaseException as e:  # noqa: BLE001
                    results.append(type(e).__name__)
            os.write(w, "\n".join(results).encode())
        finally:
            os._exit(0)
    os.close(w)
    # The child writes a few hundred bytes (less than a pipe holds) and exits.
    _, status = os.waitpid(pid, 0)
    try:
        data = os.read(r, 65536)
    finally:
        os.close(r)
    assert status == 0
    results = data.decode().splitlines()
    assert len(results) == 5 and all(x.startswith("RuntimeError") for x in results), results
    await env.check_pair_works()  # the parent is unaffected
    return RuntimeError(results[0].split(":", 1)[1])


# ============================================================ handshake
async def _raw_server(answer):
    writers = []

    async def handle(reader, writer):
        writers.append(writer)
        if answer == "close":
            writer.close()
            return
        if answer is not None:
            writer.write(answer)
            await writer.drain()
        try:
            await reader.read()
        except ConnectionError:
            pass

    server = await asyncio.start_server(handle, HOST, 0)
    return server, writers


async def _connect_raw(env, answer, timeout=1.5):
    server, writers = await _raw_server(answer)

    async def stop():
        for w in writers:
            w.close()
        server.close()
        await server.wait_closed()

    env.cleanup.append(stop)
    port = server.sockets[0].getsockname()[1]
    t0 = asyncio.get_running_loop().time()
    e = await catch(lambda: ucxx.create_endpoint(HOST, port, connect_timeout=timeout))
    assert asyncio.get_running_loop().time() - t0 < timeout + 3
    assert ucxx.core._get_ctx().live_objects() == []
    return e


@row("handshake-raw-tcp-garbage", "create_endpoint to a TCP server answering 4 KiB of "
     "random bytes", ucxx.UCXError)
async def _(env):
    return await _connect_raw(env, os.urandom(4096))


@row("handshake-raw-tcp-http", "create_endpoint to a TCP server answering an HTTP error",
     ucxx.UCXError)
async def _(env):
    return await _connect_raw(env, b"HTTP/1.1 400 Bad Request\r\n\r\n")


@row("handshake-raw-tcp-silent", "create_endpoint to a TCP server that never answers",
     U.UCXTimedOutError, "timed out")
async def _(env):
    return await _connect_raw(env, None)


@row("handshake-raw-tcp-closes", "create_endpoint to a TCP server that closes at once",
     ucxx.UCXError)
async def _(env):
    return await _connect_raw(env, "close")


async def _ucx_peer_says(env, payload, timeout=3):
    eps = []

    def cb(c_ep):
        eps.append(c_ep)
        c_ep.stream_send(payload)

    lst = ucxx.core._get_ctx().worker.listen(cb, port=0, host=HOST)

    def stop():
        lst.close()
        for c in eps:
            c.abort()

    env.cleanup.append(stop)
    return await catch(lambda: ucxx.create_endpoint(HOST, lst.port, connect_timeout=timeout))


@row("handshake-bad-magic", "a UCX listener answering the handshake with 32 x b'X'",
     ucxx.UCXError, "bad magic")
async def _(env):
    return await _ucx_peer_says(env, b"X" * hs.MSG_SIZE)


@row("handshake-bad-version", "handshake message with protocol version 99", ucxx.UCXError,
     "version 99")
async def _(env):
    return await _ucx_peer_says(env, hs.pack(1, 2, version=99))


@row("handshake-bad-checksum", "handshake message with a wrong checksum", ucxx.UCXError,
     "checksum")
async def _(env):
    return await _ucx_peer_says(env, hs.pack(1, 2)[:-1] + b"\0")


@row("handshake-short", "20 of the 32 handshake bytes, then silence", U.UCXTimedOutError)
async def _(env):
    return await _ucx_peer_says(env, hs.pack(1, 2)[:20], timeout=1)


@row("handshake-garbage-client", "a client sending 32 garbage bytes to a ucxx listener: "
     "dropped (logged); the next good client is served", None)
async def _(env):
    calls = []
    lst = ucxx.create_listener(calls.append, host=HOST, connect_timeout=1)
    env.cleanup.append(lst.close)
    c_ep = ucxx.core._get_ctx().worker.ep_from_sockaddr(HOST, lst.port)
    env.cleanup.append(c_ep.abort)
    logger = logging.getLogger("ucx")
    seen = []
    handler = logging.Handler()
    handler.emit = lambda rec: seen.append(rec.getMessage())
    logger.addHandler(handler)
    old_level = logger.level
    logger.setLevel(logging.WARNING)
    try:
        await c_ep.stream_send(b"G" * hs.MSG_SIZE)
        for _ in range(500):
            if any("dropped" in m for m in seen):
                break
            await asyncio.sleep(0.01)
        assert any("dropped" in m for m in seen), seen
    finally:
        logger.removeHandler(handler)
        logger.setLevel(old_level)
    assert calls == []
    good = await ucxx.create_endpoint(HOST, lst.port)
    for _ in range(500):
        if calls:
            break
        await asyncio.sleep(0.01)
    assert len(calls) == 1
    await good.close()
    await calls[0].close()
    return None


@row("control-message-bad-magic", "16 bytes b'EVIL...' on the peer's control tag: the "
     "endpoint aborts, its pending receive fails", U.UCXCanceledError)
async def _(env):
    ep, sep = await env.pair()
    pending = asyncio.ensure_future(sep.recv(bytearray(4)))
    await ep._ep.tag_send(b"EVIL" + b"\0" * 12, ep._ctrl_send_tag)
    e = await catch(lambda: pending)
    assert not sep.alive
    return e


@row("control-message-oversized", "64 bytes on the peer's control tag: the endpoint "
     "aborts, its pending receive fails", U.UCXCanceledError)
async def _(env):
    ep, sep = await env.pair()
    pending = asyncio.ensure_future(sep.recv(bytearray(4)))
    await ep._ep.tag_send(b"X" * 64, ep._ctrl_send_tag)
    e = await catch(lambda: pending)
    assert not sep.alive
    return e


# ================================================================ tests
OBSERVED: dict[str, str] = {}


def _describe(e) -> str:
    if e is None:
        return "no exception"
    msg = str(e).replace("|", "/").replace("\n", " ")
    if len(msg) > 90:
        msg = msg[:87] + "..."
    return f"`{type(e).__name__}`: {msg}" if msg else f"`{type(e).__name__}`"


def _expected_names(exp) -> str:
    if exp is None:
        return "no exception"
    if isinstance(exp, tuple):
        return " or ".join(f"`{t.__name__}`" for t in exp)
    return f"`{exp.__name__}`"


@pytest.fixture(scope="module", autouse=True)
def _write_table():
    yield
    path = os.environ.get("UCXX_BAD_INPUT_TABLE")
    if not path:
        return
    with open(path, "w") as f:
        f.write("| # | row | input | expected | observed |\n|---|---|---|---|---|\n")
        for i, r in enumerate(ROWS, 1):
            obs = OBSERVED.get(r.id, "(not run)")
            xf = " (xfail, section 6)" if any(m.name == "xfail" for m in r.marks) else ""
            inp = r.input.replace("|", "\\|")
            f.write(f"| {i} | `{r.id}` | {inp} | {_expected_names(r.expected)} | "
                    f"{obs}{xf} |\n")


assert len({r.id for r in ROWS}) == len(ROWS), "duplicate row ids"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("row", [pytest.param(r, id=r.id, marks=r.marks) for r in ROWS])
async def test_bad_input(row):
    env = Env()
    try:
        observed = await row.fn(env)
    finally:
        await env.close()
    OBSERVED[row.id] = _describe(observed)
    if row.expected is None:
        assert observed is None, f"unexpected {observed!r}"
        return
    assert isinstance(observed, row.expected), (
        f"expected {_expected_names(row.expected)}, observed {observed!r}")
    if row.match is not None:
        import re

        assert re.search(row.match, str(observed)), (
            f"{type(observed).__name__} message {str(observed)!r} does not say {row.match!r}")


def test_catalogue_size():
    assert len(ROWS) >= 30
