"""Fairness: a 1 ms timer beside a full-speed ping-pong in the same event loop.

One process runs, in one asyncio loop, a *ticker* (``await
asyncio.sleep(tick)`` in a loop, recording how late each wake-up is
against its deadline, the time of the sleep call plus ``tick``) and a
ping-pong of ``--n-bytes`` messages (1 by default) with an echo peer in a
second process, as fast as it goes, both for ``--duration`` seconds after
a warm-up. Reported: the ticker's wake-up count and lateness (p50, p99,
max), and the ping-pong's round trips per second and median one-way time
in the same window. Both processes use only
the public API (``ucxx.init``, ``create_listener``, ``create_endpoint``,
``Endpoint.send/recv/close``), so the same code runs on this package and on
RAPIDS ucxx.

    python benchmarks/fairness.py                          # every mode, ours and RAPIDS, tcp
    python benchmarks/fairness.py --packages ours --modes polling --spin-us default,0,50
    python benchmarks/fairness.py --duration 0.3 --json    # small and fast
    python benchmarks/fairness.py --packages ours --modes polling --tls shm --n-bytes 1M

``--spin-us`` values go to ``ucxx.init(spin_us=...)`` of this package's
processes (``default`` passes nothing; a value the package rejects is
reported as that cell's error); RAPIDS has no such setting and runs once per
mode.

Library use (tests, ``anchors.py``)::

    from fairness import measure          # benchmarks/ on sys.path
    r = measure("polling", spin_us=None, duration=0.5)
    r["late_ms"]["p99"], r["ticks"], r["rt_per_s"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import anchor_util as au  # noqa: E402
from ref.run_ref import parse_size  # noqa: E402

SCRIPT = str(HERE / "fairness.py")
PING, STOP = 1, 0


# ---------------------------------------------------------------- roles
def _init(ucxx, args) -> None:
    kw = {"progress_mode": args.mode}
    if args.spin_us not in (None, "default"):
        try:
            kw["spin_us"] = float(args.spin_us)
        except ValueError:
            kw["spin_us"] = args.spin_us
    ucxx.init(**kw)


async def _echo(args) -> None:
    """The peer: echo every message until one that starts with STOP."""
    import numpy as np
    import ucxx

    _init(ucxx, args)
    done = asyncio.Event()

    async def handler(ep):
        buf = np.zeros(args.n_bytes, dtype="u1")
        try:
            while True:
                await ep.recv(buf)
                if buf[0] == STOP:
                    break
                await ep.send(buf)
            await ep.close()
        finally:
            done.set()

    lf = ucxx.create_listener(handler)
    print(f"PORT {lf.port}", flush=True)
    await done.wait()
    lf.close()
    ucxx.stop_notifier_thread()


async def _measure(args) -> None:
    """The measuring process: ticker and ping-pong in one loop."""
    import numpy as np
    import ucxx

    _init(ucxx, args)
    ep = await ucxx.create_endpoint(args.address, args.port)
    buf = np.full(args.n_bytes, PING, dtype="u1")
    for _ in range(args.warmup):
        await ep.send(buf)
        await ep.recv(buf)

    tick = args.tick_ms / 1e3
    late: list[float] = []
    rts: list[float] = []
    clock = time.monotonic
    end = clock() + args.duration

    async def ticker():
        while True:
            deadline = clock() + tick
            await asyncio.sleep(tick)
            now = clock()
            late.append(now - deadline)
            if now >= end:
                return

    async def pingpong():
        if not args.traffic:
            return
        while True:
            t = clock()
            await ep.send(buf)
            await ep.recv(buf)
            now = clock()
            rts.append(now - t)
            if now >= end:
                return

    t0 = clock()
    await asyncio.gather(ticker(), pingpong())
    window = clock() - t0
    buf[0] = STOP
    await ep.send(buf)
    await ep.close()
    ucxx.stop_notifier_thread()

    late.sort()
    rts.sort()
    res = {
        "ticks": len(late),
        "expected_ticks": int(args.duration / tick),
        "late_ms": {"p50": au.percentile(late, 50) * 1e3,
                    "p99": au.percentile(late, 99) * 1e3,
                    "max": late[-1] * 1e3 if late else None},
        "round_trips": len(rts),
        "rt_per_s": len(rts) / window if window > 0 else 0.0,
        "one_way_median_us": au.percentile(rts, 50) / 2 * 1e6 if rts else None,
        "window_s": window,
    }
    try:  # this package's spin counters; RAPIDS has none
        w = ucxx.core._get_ctx().worker
        res["spin_stats"] = dict(w.spin_stats, spin_us=w.spin_us)
    except AttributeError:
        pass
    print("RESULT " + json.dumps(res), flush=True)


# --------------------------------------------------------------- driver
def measure(mode: str = "blocking", spin_us: str | float | None = None, *,
            package: str = "ours", duration: float = 3.0, tls: str = "tcp",
            tick_ms: float = 1.0, warmup: int = 500, traffic: bool = True,
            n_bytes: int = 1,
            python: str | None = None, rapids_python: str | None = None,
            net_devices: str = au.NET_DEVICES, address: str = au.ADDRESS,
            env: dict | None = None, timeout: float | None = None) -> dict:
    """One fairness measurement (two fresh processes). ``spin_us`` None or
    ``"default"`` passes nothing to ``ucxx.init``. Returns the measuring
    process's figures (see the module docstring); AnchorError if a process
    fails or prints no result."""
    py = python or au.python_for(package, rapids=rapids_python)
    penv = au.package_env(package, tls, net_devices)
    penv.update(env or {})
    timeout = timeout if timeout is not None else 60.0 + 2 * duration
    common = ["--mode", mode, "--n-bytes", str(n_bytes)]
    if package == "ours" and spin_us not in (None, "default"):
        common += ["--spin-us", str(spin_us)]
    out = {"package": package, "mode": mode, "tls": tls, "duration": duration,
           "n_bytes": n_bytes,
           "tick_ms": tick_ms, "traffic": traffic,
           "spin_us": "default" if package == "ours" and spin_us in (None, "default")
           else (str(spin_us) if package == "ours" else None)}
    procs = []
    try:
        srv = au.spawn([py, SCRIPT, "--role", "echo", *common], penv)
        procs.append(srv)
        s_out, s_err = au.Lines(srv.stdout), au.Lines(srv.stderr)
        m = s_out.wait_for(r"^PORT (\d+)", 60)
        if m is None:
            raise au.AnchorError("echo peer printed no port:\n" + s_err.text()[-2000:])
        cmd = [py, SCRIPT, "--role", "measure", "--port", m.group(1), "--address", address,
               "--duration", str(duration), "--tick-ms", str(tick_ms),
               "--warmup", str(warmup), *common] + ([] if traffic else ["--no-traffic"])
        cli = au.spawn(cmd, penv)
        procs.append(cli)
        c_out, c_err = au.Lines(cli.stdout), au.Lines(cli.stderr)
        m = c_out.wait_for(r"^RESULT (.*)$", timeout)
        if m is None:
            raise au.AnchorError("the measuring process printed no result:\n"
                                 + c_err.text()[-2000:])
        out.update(json.loads(m.group(1)))
        for p in (cli, srv):
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                pass
        return out
    finally:
        for p in procs:
            if p.poll() is None:
                au.kill_group(p)
                p.wait(5)


def spins_for(package: str, spins: list[str]) -> list[str | None]:
    return spins if package == "ours" else [None]


def table(results: list[dict]) -> str:
    rows = ["| package | transport | mode | spin_us | ticks (of ~N) | late p50 ms | "
            "late p99 ms | late max ms | round trips/s | one-way median µs |",
            "|---|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        spin = r.get("spin_us") or "–"
        head = f"| {r['package']} | {r['tls']} | {r['mode']} | {spin} |"
        if "error" in r:
            rows.append(head + f" failed: {r['error'].strip().splitlines()[-1][:90]} "
                        "| | | | | |")
            continue
        lm = r["late_ms"]
        ow = r.get("one_way_median_us")
        rows.append(head + f" {r['ticks']} ({r['expected_ticks']}) | {lm['p50']:.3f} | "
                    f"{lm['p99']:.3f} | {lm['max']:.3f} | {r['rt_per_s']:,.0f} | "
                    + (f"{ow:.1f} |" if ow is not None else "– |"))
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packages", default="ours,rapids")
    p.add_argument("--modes", default=",".join(au.MODES))
    p.add_argument("--spin-us", default="default",
                   help="comma list of spin budgets for this package (default: "
                   "'default', i.e. not passed; e.g. auto,0,50)")
    p.add_argument("--tls", default="tcp", help="comma list of tcp, shm")
    p.add_argument("--duration", type=float, default=3.0, help="seconds (default 3)")
    p.add_argument("--tick-ms", type=float, default=1.0)
    p.add_argument("--n-bytes", type=parse_size, default=1,
                   help="ping-pong message size (default 1; 1K, 1M, ...)")
    p.add_argument("--warmup", type=int, default=500, help="round trips before the window")
    p.add_argument("--no-traffic", dest="traffic", action="store_false",
                   help="the ticker alone (connected, no ping-pong)")
    p.add_argument("--rapids-python", default=None,
                   help=f"RAPIDS interpreter (default ${au.RAPIDS_ENV} or "
                   f"{au.DEFAULT_RAPIDS_PYTHON})")
    p.add_argument("--net-devices", default=au.NET_DEVICES)
    p.add_argument("--json", action="store_true", help="one JSON object per run")
    p.add_argument("--role", choices=("echo", "measure"), help=argparse.SUPPRESS)
    p.add_argument("--mode", default="blocking", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--address", default=au.ADDRESS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.role:
        if args.role == "echo":
            asyncio.run(_echo(args))
        else:
            asyncio.run(_measure(args))
        return 0

    spins = [s.strip() for s in args.spin_us.split(",") if s.strip()]
    results = []
    for pkg in [x for x in args.packages.split(",") if x]:
        if pkg == "rapids" and au.rapids_python(args.rapids_python) is None:
            print(f"skipped: {au.missing_rapids_message(args.rapids_python)}", flush=True)
            continue
        for tls in [x for x in args.tls.split(",") if x]:
            for mode in [x for x in args.modes.split(",") if x]:
                for spin in spins_for(pkg, spins):
                    try:
                        r = measure(mode, spin, package=pkg, duration=args.duration,
                                    tls=tls, tick_ms=args.tick_ms, warmup=args.warmup,
                                    traffic=args.traffic, n_bytes=args.n_bytes,
                                    rapids_python=args.rapids_python,
                                    net_devices=args.net_devices)
                    except au.AnchorError as exc:
                        r = {"package": pkg, "mode": mode, "tls": tls,
                             "spin_us": spin if pkg == "ours" else None, "error": str(exc)}
                    results.append(r)
                    if args.json:
                        print(json.dumps(r), flush=True)
    if not args.json:
        print(table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
