"""Where one device-memory round trip's time goes, for whichever ``ucxx`` is
on sys.path (this package or RAPIDS'), through the API both have.

    python3 tests/gpu/probe.py [--mode blocking] [--object cupy] [--quick]

Two parts, both printed as tables:

1. Per-operation costs in one process, no transfer: allocating an array
   (``xp.arange`` + ``xp.zeros``, what the benchmark does per iteration
   without ``--reuse-alloc``), reading ``__cuda_array_interface__``, the
   refused host-buffer request (cupy on Python >= 3.12), an idle stream
   synchronisation, and a kernel launch followed by one.
2. Round trips to an echo server in a second process, as the benchmark
   does them, split into allocate / send / receive per iteration, for each
   size with fresh and reused arrays, plus 1 B of host memory as the
   baseline; the first iteration of each phase (fresh handles, cold
   caches) is shown apart from the median of the rest.

The environment picks the variant (UCX_* options, CUPY_* options); run it
once per variant (tests/gpu/run.sh does).
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import os
import queue
import statistics
import sys
import time

PLAN_FULL = [("1", 1, 300), ("1MiB", 1 << 20, 200), ("64MiB", 64 << 20, 30)]
PLAN_QUICK = [("1", 1, 20), ("1MiB", 1 << 20, 10), ("64MiB", 64 << 20, 3)]


def _xp(obj):
    if obj == "numpy":
        import numpy as xp
    else:
        import cupy as xp
    return xp


def _phases(plan):
    out = [("host 1 B", "numpy", 1, True, plan[0][2])]
    for label, n, iters in plan:
        for reuse in (True, False):
            out.append((f"{label} {'reuse' if reuse else 'fresh'}", None, n, reuse, iters))
    return out


def _finish(ucxx):
    for name in ("reset", "stop_notifier_thread"):
        fn = getattr(ucxx, name, None)
        if fn is not None:
            try:
                fn()
            except Exception as e:  # reported; the numbers are in
                print(f"probe: ucxx.{name}() failed: {e!r}", file=sys.stderr)


def _server(q, phases, obj, mode):
    import numpy as np
    import ucxx

    xp = _xp(obj)

    async def main():
        ucxx.init(progress_mode=mode)
        done = asyncio.get_running_loop().create_future()

        async def handler(ep):
            try:
                for _, kind, n, reuse, iters in phases:
                    m = np if kind == "numpy" else xp
                    msg = m.zeros(n, dtype="u1")
                    for _ in range(iters + 1):
                        if not reuse:
                            msg = m.zeros(n, dtype="u1")
                        await ep.recv(msg)
                        await ep.send(msg)
                ack = np.zeros(1, dtype="u1")
                await ep.recv(ack)
                await ep.close()
                done.set_result(None)
            except Exception as e:  # noqa: BLE001 - reported to the client
                done.set_exception(e)

        lf = ucxx.create_listener(handler, port=0)
        q.put(lf.port)
        await asyncio.wait_for(done, 300)
        lf.close()

    try:
        asyncio.run(main())
    finally:
        _finish(ucxx)


def _us(xs):
    return f"{statistics.median(xs) / 1e3:9.2f}" if xs else "        -"


def op_costs(xp, obj, quick=False):
    rows = []
    n_rep = 20 if quick else 200

    def timed(fn, reps=n_rep):
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter_ns()
            fn()
            ts.append(time.perf_counter_ns() - t0)
        return ts

    sync = (lambda: None) if obj == "numpy" else xp.cuda.Stream.null.synchronize
    for label, n in (("1 B", 1), ("1 MiB", 1 << 20), ("64 MiB", 64 << 20)):
        rows.append((f"arange+zeros {label}", timed(
            lambda n=n: (xp.arange(n, dtype="u1"), xp.zeros(n, dtype="u1")), n_rep // 4)))
        rows.append((f"arange+zeros+sync {label}", timed(
            lambda n=n: (xp.arange(n, dtype="u1"), xp.zeros(n, dtype="u1"), sync()), n_rep // 4)))
    a = xp.zeros(1, dtype="u1")
    if hasattr(a, "__cuda_array_interface__"):
        cai = a.__cuda_array_interface__
        print(f"# interface: version {cai.get('version')}, stream {cai.get('stream')!r}")
        rows.append(("read __cuda_array_interface__", timed(lambda: a.__cuda_array_interface__)))

    def refused():
        try:
            memoryview(a)
        except Exception:  # noqa: BLE001 - the refusal is what is timed
            pass

    rows.append(("memoryview(array) (refused on device)", timed(refused)))
    rows.append(("idle stream synchronise", timed(sync)))
    rows.append(("zeros(1) + stream synchronise", timed(lambda: (xp.zeros(1, dtype="u1"), sync()))))
    print("\n## Per-operation costs (median µs, this process)\n")
    for name, ts in rows:
        print(f"  {name:42} {_us(ts)}")


async def round_trips(ucxx, xp, phases, port):
    import numpy as np

    ep = await ucxx.create_endpoint("127.0.0.1", port)
    print("\n## Round trips (µs; first iteration, then the median of the rest)\n")
    print(f"  {'phase':16} {'alloc 1st':>10} {'send 1st':>10} {'recv 1st':>10} |"
          f" {'alloc':>9} {'send':>9} {'recv':>9} {'round trip':>10}")
    for name, kind, n, reuse, iters in phases:
        m = np if kind == "numpy" else xp
        s_reuse, r_reuse = m.arange(n, dtype="u1"), m.zeros(n, dtype="u1")
        t_a, t_s, t_r = [], [], []
        for _ in range(iters + 1):
            t0 = time.perf_counter_ns()
            if reuse:
                s, r = s_reuse, r_reuse
            else:
                s, r = m.arange(n, dtype="u1"), m.zeros(n, dtype="u1")
            t1 = time.perf_counter_ns()
            await ep.send(s)
            t2 = time.perf_counter_ns()
            await ep.recv(r)
            t3 = time.perf_counter_ns()
            t_a.append(t1 - t0)
            t_s.append(t2 - t1)
            t_r.append(t3 - t2)
        rt = [a + b + c for a, b, c in zip(t_a[1:], t_s[1:], t_r[1:])]
        print(f"  {name:16} {t_a[0] / 1e3:10.1f} {t_s[0] / 1e3:10.1f} {t_r[0] / 1e3:10.1f} |"
              f" {_us(t_a[1:])} {_us(t_s[1:])} {_us(t_r[1:])} {_us(rt):>10}", flush=True)
    await ep.send(np.ones(1, dtype="u1"))
    await asyncio.sleep(0.2)
    await ep.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--mode", default="blocking")
    ap.add_argument("--object", default="cupy")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    import ucxx

    xp = _xp(args.object)
    where = os.path.dirname(ucxx.__file__)
    print(f"# probe: ucxx from {where}, progress mode {args.mode}, object {args.object}")
    print("# environment: " + " ".join(f"{k}={v}" for k, v in sorted(os.environ.items())
                                       if k.startswith(("UCX_", "CUPY_"))))
    op_costs(xp, args.object, args.quick)
    phases = _phases(PLAN_QUICK if args.quick else PLAN_FULL)
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=_server, args=(q, phases, args.object, args.mode))
    p.start()
    try:
        port, t_end = None, time.monotonic() + 120
        while port is None:
            try:
                port = q.get(timeout=0.5)
            except queue.Empty:
                if not p.is_alive() or time.monotonic() > t_end:
                    print(f"probe: the echo server did not start (exit code {p.exitcode})")
                    return 1

        async def client():
            ucxx.init(progress_mode=args.mode)
            await round_trips(ucxx, xp, phases, port)

        asyncio.run(client())
    finally:
        _finish(ucxx)
        p.join(60)
        if p.exitcode is None:
            p.kill()
    return 0 if p.exitcode == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
