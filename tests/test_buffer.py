"""``__cuda_array_interface__`` parsing with fake device objects (no GPU
needed): malformed interfaces are rejected with TypeError / BufferError /
ValueError before anything is posted; a well-formed interface pointing at
host memory is accepted and, as UCX finds the memory is really host memory,
transfers correctly (checked in a child process so that a UCX that insists
on treating it as device memory cannot take the test run down)."""

import asyncio
import ctypes
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from _util import local  # noqa: F401
from ucxx import _ucxx as U

# leak check (conftest): no fd, task or thread outlives a test; no global
# context is needed, the tests make their own.
pytestmark = [pytest.mark.leak_check, pytest.mark.no_ctx]


class FakeDevice:
    """An object exporting only ``__cuda_array_interface__``."""

    def __init__(self, iface, keep=None):
        self.__cuda_array_interface__ = iface
        self.keep = keep  # the memory the pointer refers to


class RaisingInterface:
    @property
    def __cuda_array_interface__(self):
        raise RuntimeError("interface exploded")


def iface_of(arr, readonly=False, strides=None, **extra):
    d = {"data": (arr.ctypes.data, readonly), "shape": arr.shape,
         "typestr": arr.dtype.str, "strides": strides, "version": 3}
    d.update(extra)
    return d


HOST = np.zeros((4, 4), dtype=np.float32)


def fake(**changes):
    d = iface_of(HOST)
    for k, v in changes.items():
        if v is KeyError:
            d.pop(k)
        else:
            d[k] = v
    return FakeDevice(d, HOST)


BAD_TYPE = {
    "not-a-dict-list": FakeDevice([1, 2, 3]),
    "not-a-dict-none": FakeDevice(None),
    "not-a-dict-str": FakeDevice("data"),
    "missing-data": fake(data=KeyError),
    "missing-shape": fake(shape=KeyError),
    "missing-typestr": fake(typestr=KeyError),
    "data-not-tuple": fake(data=[HOST.ctypes.data, False]),
    "data-wrong-length": fake(data=(HOST.ctypes.data,)),
    "shape-not-tuple": fake(shape=[4, 4]),
    "shape-not-ints": fake(shape=(4, "4")),
    "typestr-short": fake(typestr="<f"),
    "typestr-letters": fake(typestr="<fx"),
    "typestr-zero": fake(typestr="<f0"),
    "typestr-not-str": fake(typestr=4),
    "strides-not-tuple": fake(strides=[16, 4]),
    "strides-wrong-length": fake(strides=(4,)),
    "pointer-not-int": fake(data=("0x1000", False)),
}

BAD_BUFFER = {
    "masked": fake(mask=np.ones((4, 4), bool).ctypes.data),
    "strides-fortran": fake(strides=(4, 16)),
    "strides-padded": fake(strides=(32, 4)),
    "strides-step": fake(strides=(16, 8)),
}

BAD_VALUE = {
    "negative-shape": fake(shape=(-1, 4)),
    "null-pointer": fake(data=(0, False)),
    "stream-zero": fake(stream=0),
}


def posts(w, ep):
    return {
        "ep.tag_send": lambda b: ep.tag_send(b, 1),
        "ep.send": lambda b: ep.send(b),
        "ep.am_send": lambda b: ep.am_send(b),
        "ep.gather_send": lambda b: ep.gather_send([b"ok", b]),
        "w.tag_recv": lambda b: w.tag_recv(b, 1),
        "ep.tag_recv": lambda b: ep.tag_recv(b, 1),
        "ep.gather_recv": lambda b: ep.gather_recv([bytearray(2), b]),
    }


async def still_works(w, ep):
    out = bytearray(5)
    await asyncio.wait_for(asyncio.gather(ep.tag_send(b"after", 2), w.tag_recv(out, 2)), 10)
    assert out == b"after"
    assert w.npending == 0


async def check_rejected(local, obj, exc):
    w, ep = local.w, local.ep
    rc = sys.getrefcount(obj)
    for name, post in posts(w, ep).items():
        with pytest.raises(exc):
            post(obj)
            pytest.fail(f"{name} accepted the object")
        assert w.npending == 0, name
    assert sys.getrefcount(obj) == rc, "a rejected object was kept"
    await still_works(w, ep)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(BAD_TYPE))
async def test_malformed_interface_type_error(local, case):
    await check_rejected(local, BAD_TYPE[case], TypeError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(BAD_BUFFER))
async def test_untransferable_layout_buffer_error(local, case):
    await check_rejected(local, BAD_BUFFER[case], BufferError)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("case", list(BAD_VALUE))
async def test_bad_values(local, case):
    await check_rejected(local, BAD_VALUE[case], ValueError)


@pytest.mark.timeout(30)
async def test_interface_property_error_propagates(local):
    await check_rejected(local, RaisingInterface(), RuntimeError)


@pytest.mark.timeout(30)
async def test_read_only_device_array_rejected_for_receive(local):
    w, ep = local.w, local.ep
    obj = fake(data=(HOST.ctypes.data, True))
    for name, post in posts(w, ep).items():
        if "recv" in name:
            with pytest.raises(BufferError):
                post(obj)
            assert w.npending == 0
    await still_works(w, ep)


def _libcuda_loadable() -> bool:
    try:
        ctypes.CDLL("libcuda.so.1")
    except OSError:
        return False
    return True


@pytest.mark.timeout(30)
@pytest.mark.skipif(_libcuda_loadable(), reason="a CUDA driver is present")
async def test_named_stream_without_driver(local):
    """Naming a stream asks the driver to synchronise it: without a driver
    that is a clear error, raised before posting."""
    await check_rejected(local, fake(stream=1), RuntimeError)


# ------------------------------------------------------------------ host memory behind the interface
HOST_BEHIND_INTERFACE = r"""
import asyncio, sys
import numpy as np
import ucxx
from ucxx import _ucxx as U

class FakeDevice:
    def __init__(self, arr, readonly=False, strides=None):
        self.arr = arr
        self.__cuda_array_interface__ = {
            "data": (arr.ctypes.data, readonly), "shape": arr.shape,
            "typestr": arr.dtype.str, "strides": strides, "version": 3,
            "stream": None, "mask": None}

ctx = U.Context({"TLS": sys.argv[1], "RNDV_THRESH": "8192"})
w = U.Worker(ctx)
ep = w.ep_from_address(w.address)

async def main():
    w.start(asyncio.get_running_loop())
    cases = [
        (np.arange(10, dtype="<f4"), None),                         # eager
        (np.arange(40000, dtype="<f4").reshape(200, 200), None),    # rendezvous, 2-D
        (np.arange(24, dtype="<i8").reshape(2, 3, 4), (96, 32, 8)), # explicit C strides
        (np.arange(8, dtype="<u2").reshape(8, 1), (2, 99)),         # size-1 dim: any stride
        (np.zeros(0, dtype="<f8"), None),                           # empty
    ]
    for src, strides in cases:
        dst = np.zeros_like(src)
        r = w.tag_recv(FakeDevice(dst, strides=strides), 7)
        s = ep.tag_send(FakeDevice(src, readonly=True, strides=strides), 7)
        n = await asyncio.wait_for(r, 10)
        await asyncio.wait_for(s, 10)
        assert n == src.nbytes, (n, src.nbytes)
        assert np.array_equal(src, dst), src.shape
    # mixed: device-interface sender, host receiver and vice versa
    src = np.arange(5000, dtype="<f8")
    dst = bytearray(src.nbytes)
    await asyncio.gather(ep.tag_send(FakeDevice(src), 8), w.tag_recv(dst, 8))
    assert bytes(dst) == src.tobytes()
    dst2 = np.zeros_like(src)
    await asyncio.gather(ep.tag_send(src, 9), w.tag_recv(FakeDevice(dst2), 9))
    assert np.array_equal(src, dst2)
    print("TRANSFERS OK", flush=True)

asyncio.run(main())
ep.abort(); w.close(); ctx.close()
"""


@pytest.mark.timeout(60)
@pytest.mark.parametrize("tls", ["tcp", "posix,sysv,cma"], ids=["tcp", "shm"])
def test_interface_over_host_memory_transfers(tls):
    env = dict(os.environ)
    env["PYTHONPATH"] = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(HOST_BEHIND_INTERFACE), tls],
                          capture_output=True, text=True, timeout=50, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:] + proc.stdout[-2000:]
    assert "TRANSFERS OK" in proc.stdout
