"""The device-memory code paths, exercised without a GPU.

Fake device objects export ``__cuda_array_interface__`` over host memory
(UCX finds the memory is host memory and moves it correctly), a fake
``libcuda.so.1`` stands in for the driver's ``cuStreamSynchronize``, and a
fake ``cupy`` package drives the benchmark CLI's ``-o cupy`` path. What
only a real GPU can show (cuda_copy / cuda_ipc transports, real stream
ordering, timings) is in tests/gpu/ and tests/gpu/run.sh.

Transfers of fake device memory run in child processes, so that a UCX
that treats the pointer as device memory cannot take the test run down.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from _util import local  # noqa: F401
from ucxx import _ucxx as U

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]


def _child_env(extra_path=None, **env):
    e = dict(os.environ)
    e.pop("UCXPY_IFNAME", None)
    e.setdefault("UCX_NET_DEVICES", "lo")
    path = [REPO] + ([extra_path] if extra_path else [])
    e["PYTHONPATH"] = os.pathsep.join(path + [e.get("PYTHONPATH", "")])
    e.update(env)
    return e


def _run_child(code, *argv, timeout=60, **kw):
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code), *argv],
                          capture_output=True, text=True, timeout=timeout,
                          env=_child_env(**kw))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    return proc.stdout


# ------------------------------------------------------------------ one read per buffer
class CountingDevice:
    """A device object whose interface is built on every access (as cupy's
    is) and counts the accesses; the dict it returns is rejected (bad
    typestr) so that nothing is posted."""

    def __init__(self):
        self.reads = 0

    @property
    def __cuda_array_interface__(self):
        self.reads += 1
        return {"data": (0x1000, False), "shape": (4,), "typestr": "<f?",
                "version": 3, "stream": None}


class RefusingBuffer(np.ndarray):
    """A host-buffer exporter whose buffer request fails (a strided view asked
    for a C-contiguous buffer), with a CUDA interface beside it: the shape
    of a cupy array on Python >= 3.12, whose ``__buffer__`` refuses."""

    reads = 0

    @property
    def __cuda_array_interface__(self):
        type(self).reads += 1
        return {"data": (0x1000, False), "shape": (4,), "typestr": "<f?",
                "version": 3, "stream": None}


def _refusing():
    RefusingBuffer.reads = 0
    return np.zeros(16, dtype="u1").view(RefusingBuffer)[::2]


class DunderBufferRefusing(CountingDevice):
    """Python >= 3.12: a class-level ``__buffer__`` gives the type a buffer
    slot, here one that refuses, as cupy's does."""

    def __buffer__(self, flags):
        raise BufferError("device memory has no host buffer")


KINDS = ["interface-only", "buffer-refusing"] + (
    ["dunder-buffer"] if sys.version_info >= (3, 12) else [])


def _posts(w, ep):
    return {
        "ep.tag_send": lambda b: ep.tag_send(b, 1),
        "ep.send": lambda b: ep.send(b),
        "ep.am_send": lambda b: ep.am_send(b),
        "w.tag_recv": lambda b: w.tag_recv(b, 1),
        "ep.tag_recv": lambda b: ep.tag_recv(b, 1),
    }


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", KINDS)
async def test_interface_read_once_per_buffer(local, kind):
    """Each post reads ``__cuda_array_interface__`` once: exporters build the
    dict on every access, so a second read is a second dict per message."""
    w, ep = local.w, local.ep
    make = {"interface-only": CountingDevice, "buffer-refusing": _refusing,
            "dunder-buffer": DunderBufferRefusing}[kind]
    for name, post in _posts(w, ep).items():
        obj = make()
        if kind == "dunder-buffer":
            with pytest.raises(BufferError):
                memoryview(obj)
        with pytest.raises(TypeError, match="typestr"):
            post(obj)
        reads = RefusingBuffer.reads if kind == "buffer-refusing" else obj.reads
        assert reads == 1, f"{name}: interface read {reads} times"
        assert w.npending == 0, name


@pytest.mark.timeout(30)
async def test_refusing_buffer_without_interface_is_buffer_error(local):
    """A buffer exporter that refuses and has no CUDA interface: BufferError
    naming the buffer requirement, chained to the exporter's error."""
    arr = np.zeros(16, dtype="u1")[::2]
    with pytest.raises(BufferError, match="C-contiguous") as ei:
        local.ep.tag_send(arr, 1)
    assert ei.value.__cause__ is not None
    assert local.w.npending == 0


class RaisingRefusing(np.ndarray):
    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("interface exploded")


@pytest.mark.timeout(30)
async def test_refusing_buffer_interface_error_propagates(local):
    """The interface of a buffer-refusing exporter fails: that error (not a
    BufferError about the host buffer) is what the caller sees."""
    obj = np.zeros(16, dtype="u1").view(RaisingRefusing)[::2]
    with pytest.raises(RuntimeError, match="exploded"):
        local.ep.tag_send(obj, 1)
    assert local.w.npending == 0


# ------------------------------------------------------------------ transfers through the device path
TRANSFERS = r"""
import asyncio, sys
import numpy as np
from ucxx import _ucxx as U

class Dev:
    def __init__(self, arr):
        self.arr = arr
    @property
    def __cuda_array_interface__(self):
        return {"data": (self.arr.ctypes.data, False), "shape": self.arr.shape,
                "typestr": self.arr.dtype.str, "version": 3, "stream": None}

class Refusing(np.ndarray):
    # buffer request fails (strided view); the interface names `backing`
    @property
    def __cuda_array_interface__(self):
        b = self.backing
        return {"data": (b.ctypes.data, False), "shape": b.shape,
                "typestr": b.dtype.str, "version": 3, "stream": None}

def refusing(backing):
    r = np.zeros(2 * backing.size, dtype="u1").view(Refusing)[::2]
    r.backing = backing
    return r

ctx = U.Context({"TLS": sys.argv[1], "RNDV_THRESH": "8192"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)
got_alloc = []

def cuda_alloc(n):
    d = Dev(np.zeros(n, dtype="u1"))
    got_alloc.append(n)
    return d

async def main():
    w.start(asyncio.get_running_loop())
    for n in (10, 100000):          # eager and rendezvous
        src = (np.arange(n) % 251).astype("u1")
        dst = np.zeros(n, dtype="u1")
        r = w.tag_recv(refusing(dst), 5)
        await asyncio.wait_for(ep.tag_send(refusing(src), 5), 10)
        assert await asyncio.wait_for(r, 10) == n
        assert np.array_equal(src, dst), n
    # active messages: a device sender's header names CUDA memory, the
    # receiver allocates with the CUDA allocator (rendezvous, any size)
    w.register_am_allocator(U.MEMORY_TYPE_CUDA, cuda_alloc)
    for n in (1, 5000, 300000):
        src = (np.arange(n) % 253).astype("u1")
        await asyncio.wait_for(ep.am_send(Dev(src)), 10)
        got = await asyncio.wait_for(ep.am_recv(), 10)
        assert isinstance(got, Dev), type(got)
        assert np.array_equal(got.arr, src), n
    assert got_alloc == [1, 5000, 300000], got_alloc
    # a host message still lands in host memory
    await asyncio.wait_for(ep.am_send(b"host"), 10)
    got = await asyncio.wait_for(ep.am_recv(), 10)
    assert bytes(got) == b"host"
    print("DEVICE PATH OK", flush=True)

asyncio.run(main())
ep.abort(); w.close(); ctx.close()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["tcp", "posix,sysv,cma"], ids=["tcp", "shm"])
def test_device_path_transfers(tls):
    """Buffer-refusing exporters go by their CUDA interface; active messages
    from a device sender arrive through the registered CUDA allocator."""
    out = _run_child(TRANSFERS, tls)
    assert "DEVICE PATH OK" in out


AM_NO_CUDA_ALLOCATOR = r"""
import asyncio, sys
import numpy as np
import ucxx
from ucxx import _ucxx as U

class Dev:
    def __init__(self, arr):
        self.arr = arr
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, False), "shape": arr.shape,
            "typestr": "|u1", "version": 3, "stream": None}

ctx = U.Context({"TLS": "tcp"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)

async def main():
    w.start(asyncio.get_running_loop())
    await asyncio.wait_for(ep.am_send(Dev(np.ones(64, "u1"))), 10)
    try:
        await asyncio.wait_for(ep.am_recv(), 10)
    except ucxx.exceptions.UCXUnsupportedError as e:
        assert "memory type" in str(e), e
        print("REFUSED", flush=True)
    await asyncio.wait_for(ep.am_send(b"next"), 10)
    assert bytes(await asyncio.wait_for(ep.am_recv(), 10)) == b"next"

asyncio.run(main())
ep.abort(); w.close(); ctx.close()
"""


@pytest.mark.timeout(60)
def test_am_device_message_without_cuda_allocator():
    """A device message reaching a worker without a CUDA allocator fails
    that receive with UCXUnsupportedError; the next message still arrives."""
    out = _run_child(AM_NO_CUDA_ALLOCATOR)
    assert "REFUSED" in out


# ------------------------------------------------------------------ stream synchronisation
FAKE_LIBCUDA = r"""
#include <stdint.h>
#include <stdlib.h>
static int calls;
static uintptr_t last;
int cuStreamSynchronize(void *stream)
{
    const char *rc = getenv("FAKE_CUDA_RC");
    calls++;
    last = (uintptr_t)stream;
    return rc ? atoi(rc) : 0;
}
int fake_calls(void) { return calls; }
uintptr_t fake_last_stream(void) { return last; }
"""

STREAM_SYNC = r"""
import asyncio, ctypes, os, sys
import numpy as np
from ucxx import _ucxx as U

fake = ctypes.CDLL(os.path.join(sys.argv[1], "libcuda.so.1"))
fake.fake_last_stream.restype = ctypes.c_size_t

class Dev:
    def __init__(self, arr, stream):
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, False), "shape": arr.shape,
            "typestr": "|u1", "version": 3, "stream": stream}

ctx = U.Context({"TLS": "tcp"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)

async def main():
    w.start(asyncio.get_running_loop())
    src = (np.arange(4096) % 256).astype("u1")
    dst = np.zeros_like(src)
    n0 = fake.fake_calls()
    r = w.tag_recv(Dev(dst, 0xdead00), 1)       # consumer's stream
    assert fake.fake_calls() == n0 + 1
    assert fake.fake_last_stream() == 0xdead00
    await asyncio.wait_for(ep.tag_send(Dev(src, 2), 1), 10)  # per-thread
    assert fake.fake_calls() == n0 + 2
    assert fake.fake_last_stream() == 2
    await asyncio.wait_for(r, 10)
    assert np.array_equal(src, dst)
    await asyncio.wait_for(asyncio.gather(
        ep.tag_send(Dev(src, None), 2), w.tag_recv(dst, 2)), 10)
    assert fake.fake_calls() == n0 + 2, "stream None was synchronised"
    print("SYNC OK", flush=True)

asyncio.run(main())
ep.abort(); w.close(); ctx.close()
"""

SYNC_FAILS = r"""
import asyncio, sys
import numpy as np
from ucxx import _ucxx as U

arr = np.zeros(64, "u1")
class Dev:
    __cuda_array_interface__ = {"data": (arr.ctypes.data, False),
                                "shape": (64,), "typestr": "|u1",
                                "version": 3, "stream": 1}

ctx = U.Context({"TLS": "tcp"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)
try:
    ep.tag_send(Dev(), 1)
except RuntimeError as e:
    assert "cuStreamSynchronize failed (700)" in str(e), e
    assert w.npending == 0
    print("SYNC ERROR OK", flush=True)
ep.abort(); w.close(); ctx.close()
"""


@pytest.fixture(scope="module")
def fake_libcuda(tmp_path_factory):
    cc = shutil.which(os.environ.get("CC", "cc")) or shutil.which("gcc")
    if cc is None:
        pytest.fail("a C compiler is needed to build the fake libcuda.so.1")
    d = tmp_path_factory.mktemp("fakecuda")
    (d / "fake.c").write_text(FAKE_LIBCUDA)
    subprocess.run([cc, "-shared", "-fPIC", "-o", str(d / "libcuda.so.1"),
                    str(d / "fake.c")], check=True, timeout=60)
    return str(d)


@pytest.mark.timeout(60)
def test_named_stream_is_synchronised(fake_libcuda):
    """A stream named in the interface is synchronised with the driver's
    cuStreamSynchronize once per buffer, before posting; ``None`` is not."""
    out = _run_child(STREAM_SYNC, fake_libcuda,
                     LD_LIBRARY_PATH=fake_libcuda + os.pathsep
                     + os.environ.get("LD_LIBRARY_PATH", ""))
    assert "SYNC OK" in out


@pytest.mark.timeout(60)
def test_stream_sync_failure_is_an_error(fake_libcuda):
    """A failing cuStreamSynchronize raises RuntimeError with the driver's
    code and posts nothing."""
    out = _run_child(SYNC_FAILS, FAKE_CUDA_RC="700",
                     LD_LIBRARY_PATH=fake_libcuda + os.pathsep
                     + os.environ.get("LD_LIBRARY_PATH", ""))
    assert "SYNC ERROR OK" in out


# ------------------------------------------------------------------ the benchmark CLI's -o cupy path
FAKE_CUPY = r'''
"""A stand-in for cupy over host memory, enough for the benchmark CLI."""
import os
import numpy as _np
from numpy import uint8  # noqa: F401

class ndarray:
    def __init__(self, a):
        self._a = a
        self.nbytes = a.nbytes
        self.shape = a.shape
        self.dtype = a.dtype

    @property
    def __cuda_array_interface__(self):
        return {"data": (self._a.ctypes.data, False), "shape": self._a.shape,
                "typestr": self._a.dtype.str, "strides": None, "version": 3,
                "stream": None}


def arange(n, dtype=None):
    return ndarray((_np.arange(n) % 256).astype(dtype or "i8"))


def zeros(n, dtype=None):
    return ndarray(_np.zeros(n, dtype=dtype))


def empty(n, dtype=None):
    return ndarray(_np.empty(n, dtype=dtype))


def asarray(x):
    if isinstance(x, ndarray):
        return x
    i = x.__cuda_array_interface__
    n = 1
    for d in i["shape"]:
        n *= d
    import ctypes
    buf = (ctypes.c_char * (n * _np.dtype(i["typestr"]).itemsize)).from_address(i["data"][0])
    return ndarray(_np.frombuffer(buf, dtype=i["typestr"]).copy())


def asnumpy(x):
    return asarray(x)._a.copy()


class cuda:
    class profiler:
        start = staticmethod(lambda: None)
        stop = staticmethod(lambda: None)

    class runtime:
        deviceSynchronize = staticmethod(lambda: None)
'''


@pytest.fixture(scope="module")
def fake_cupy(tmp_path_factory):
    d = tmp_path_factory.mktemp("fakecupy")
    (d / "cupy").mkdir()
    (d / "cupy" / "__init__.py").write_text(FAKE_CUPY)
    return str(d)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("extra", [
    [], ["--reuse-alloc"], ["-x", "2"], ["--enable-am"],
    ["--progress-mode", "thread"],
], ids=["fresh", "reuse", "multi", "am", "thread"])
def test_benchmark_cli_cupy_path(fake_cupy, extra):
    """``-o cupy`` end to end on fake device arrays: allocation per iteration
    or reused, send_multi/recv_multi with device frames, AM with the CUDA
    allocator, and the final echo check."""
    proc = subprocess.run(
        [sys.executable, "-m", "ucxx.benchmarks.send_recv", "-o", "cupy",
         "-n", "100kB", "--n-iter", "5", "--n-warmup-iter", "1",
         "-s", "127.0.0.1", "--no-detailed-report", *extra],
        capture_output=True, text=True, timeout=100, cwd=REPO,
        env=_child_env(fake_cupy, UCX_TLS="tcp"))
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "| cupy" in proc.stdout
    assert "Latency (median)" in proc.stdout
