"""GPU checks: cupy arrays between two processes, send_multi/recv_multi and
active messages with device frames. Skipped without cupy or a CUDA device;
tests/gpu/run.sh runs them (and the GPU benchmark) on a GPU machine."""

import asyncio
import multiprocessing as mp
import os

import glob

import pytest

# No device: the reason says so (CI fails on skips that a missing package
# explains; cupy is installed where there is a GPU, by tests/gpu/run.sh).
if not glob.glob("/dev/nvidia[0-9]*"):
    pytest.skip("needs a CUDA GPU: this machine has none (tests/gpu/run.sh runs "
                "these on a GPU machine)", allow_module_level=True)
cupy = pytest.importorskip("cupy")
try:
    if cupy.cuda.runtime.getDeviceCount() < 1:
        raise RuntimeError("no device")
except Exception as e:  # noqa: BLE001 - any CUDA failure means "no GPU here"
    pytest.skip(f"no usable CUDA device: {e}", allow_module_level=True)

pytestmark = [pytest.mark.gpu]

# Around RAPIDS' UCX_RNDV_THRESH (8192) and this package's default within a
# host (intra:8m: device messages below 8 MiB go eagerly).
SIZES = [1, 1000, 8191, 8193, 1 << 20, (8 << 20) - 1, (8 << 20) + 1, 64 << 20, 256 << 20]
EARLY = 3 << 20


def _server(q, sizes, mode):
    import cupy
    import ucxx

    # Device memory allocated before UCX is initialised (UCX's memory-type
    # cache learns of it from the process's mappings, not from its hooks).
    early = cupy.empty(EARLY, dtype="u1")

    async def main():
        done = asyncio.get_running_loop().create_future()

        async def handler(ep):
            try:
                for n in sizes:
                    buf = cupy.empty(n, dtype="u1")
                    await ep.recv(buf)
                    await ep.send(buf)
                await ep.recv(early)
                await ep.send(early)
                frames = await ep.recv_multi()
                await ep.send_multi(frames)
                msg = await ep.am_recv()
                await ep.am_send(msg)
                await ep.close()
            finally:
                done.set_result(None)

        ucxx.init(progress_mode=mode)
        ucxx.register_am_allocator(lambda n: cupy.empty(n, dtype="u1"), "cuda")
        lst = ucxx.create_listener(handler, host="127.0.0.1")
        q.put(lst.port)
        await done
        lst.close()

    asyncio.run(main())


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["blocking", "thread"])
def test_cupy_two_processes(mode):
    import ucxx

    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_server, args=(q, SIZES, mode))
    p.start()
    port = q.get(timeout=120)
    # allocated before ucxx.init (see _server)
    early_src = cupy.random.randint(0, 255, EARLY, dtype="u1")
    early_dst = cupy.zeros(EARLY, dtype="u1")

    async def main():
        ucxx.init(progress_mode=mode)
        ucxx.register_am_allocator(lambda n: cupy.empty(n, dtype="u1"), "cuda")
        ep = await ucxx.create_endpoint("127.0.0.1", port)
        for n in SIZES:
            src = cupy.random.randint(0, 255, n, dtype="u1")
            dst = cupy.empty(n, dtype="u1")
            await ep.send(src)
            await ep.recv(dst)
            assert bool((src == dst).all()), n
        await ep.send(early_src)
        await ep.recv(early_dst)
        assert bool((early_src == early_dst).all()), "allocated before init"
        frames = [cupy.arange(100, dtype="f8"), cupy.empty(0, "u1"),
                  bytearray(b"host frame"), cupy.ones(3 << 20, "u1")]
        await ep.send_multi(frames)
        back = await ep.recv_multi()
        assert len(back) == 4
        assert hasattr(back[0], "__cuda_array_interface__")
        assert bool((cupy.asarray(back[0]).view("f8") == frames[0]).all())
        assert bytes(back[2]) == b"host frame"
        assert int(cupy.asarray(back[3]).sum()) == 3 << 20
        src = cupy.arange(1 << 20, dtype="u1")
        await ep.am_send(src)
        got = await ep.am_recv()
        assert bool((cupy.asarray(got) == src).all())
        await ep.close()

    try:
        asyncio.run(main())
    finally:
        ucxx.reset()
        p.join(60)
    assert p.exitcode == 0


@pytest.mark.timeout(120)
def test_stream_is_synchronised():
    """A producer's stream named in the interface is synchronised before the
    pointer goes to UCX (v3 interface with a non-default stream)."""
    import ucxx
    from ucxx import _ucxx as U

    s = cupy.cuda.Stream(non_blocking=True)
    ctx = U.Context({})
    w = U.Worker(ctx)
    ep = w.ep_from_address(w.address)

    async def main():
        with s:
            src = cupy.full(64 << 20, 7, dtype="u1")
            # Accessed under `with s`, the interface names stream s.
            assert src.__cuda_array_interface__.get("stream") not in (None, 1, 2)
            dst = cupy.empty_like(src)
            r = w.tag_recv(dst, 3)
            await ep.tag_send(src, 3)
            await r
        cupy.cuda.Device().synchronize()
        assert int(dst.min()) == 7

    asyncio.run(main())
    ep.abort()
    w.close()
    ctx.close()


@pytest.mark.timeout(600)
def test_benchmark_cli_cupy():
    import subprocess
    import sys

    out = subprocess.run(
        [sys.executable, "-m", "ucxx.benchmarks.send_recv", "-o", "cupy",
         "-n", "64MiB", "--n-iter", "20", "--no-detailed-report"],
        capture_output=True, text=True, timeout=500,
    )
    print(out.stdout)
    assert out.returncode == 0, out.stderr
    assert "Bandwidth (median)" in out.stdout
