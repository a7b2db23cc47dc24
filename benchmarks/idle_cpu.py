"""CPU used while connected and idle, for this package and for RAPIDS ucxx.

Two processes of the same package (the public API only: ``ucxx.init``,
``create_listener``, ``create_endpoint``, ``Endpoint.send/recv/close``,
which both packages have) connect, exchange ``--messages`` 1-byte round
trips, then each posts a receive that is never satisfied (``--pending``
chooses which side) and reports ``IDLE``. After ``--settle`` seconds the
driver reads both processes' CPU time (user + system, all threads: the
process CPU-time clock, nanosecond resolution) over ``--seconds`` of that
idleness, then tells them to close.

    python benchmarks/idle_cpu.py                         # ours and RAPIDS, every mode, tcp
    python benchmarks/idle_cpu.py --packages ours --modes blocking,thread --tls tcp,shm
    python benchmarks/idle_cpu.py --rapids-python /path/to/venv/bin/python --json

Library use (``anchors.py``, tests)::

    from idle_cpu import measure          # benchmarks/ on sys.path
    r = measure("ours", "blocking", tls="tcp", seconds=3.0)
    r["server_cpu_s"], r["client_cpu_s"]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

import anchor_util as au  # noqa: E402

SCRIPT = str(HERE / "idle_cpu.py")


# ---------------------------------------------------------------- roles
def _spin_value(s: str | None):
    if s is None or s == "default":
        return None
    try:
        return float(s)
    except ValueError:
        return s


def _init(ucxx, args) -> None:
    kw = {"progress_mode": args.mode}
    spin = _spin_value(args.spin_us)
    if spin is not None:
        kw["spin_us"] = spin
    ucxx.init(**kw)


def _stdin_event(loop) -> asyncio.Event:
    """An event set when a line (or EOF) arrives on stdin; the reading thread
    sleeps in read(), so it costs no CPU."""
    ev = asyncio.Event()

    def read():
        sys.stdin.readline()
        loop.call_soon_threadsafe(ev.set)

    threading.Thread(target=read, daemon=True).start()
    return ev


async def _exchange(ep, np, n: int, first: bool) -> None:
    buf = np.zeros(1, dtype="u1")
    for _ in range(n):
        if first:
            await ep.send(buf)
            await ep.recv(buf)
        else:
            await ep.recv(buf)
            await ep.send(buf)


async def _idle_until_stop(ep, np, pending: bool, stop: asyncio.Event) -> None:
    task = None
    if pending:
        task = asyncio.ensure_future(ep.recv(np.zeros(1, dtype="u1")))
        for _ in range(3):  # let the task post its receive
            await asyncio.sleep(0)
    print("IDLE", flush=True)
    await stop.wait()
    if task is not None:
        task.cancel()
    try:
        await asyncio.wait_for(ep.close(), 5)
    except BaseException:  # the pending receive may end the endpoint first
        pass
    if task is not None:
        await asyncio.gather(task, return_exceptions=True)


async def _server(args) -> None:
    import numpy as np
    import ucxx

    _init(ucxx, args)
    loop = asyncio.get_running_loop()
    stop = _stdin_event(loop)
    done = asyncio.Event()

    async def handler(ep):
        try:
            await _exchange(ep, np, args.messages, first=False)
            await _idle_until_stop(ep, np, args.pending in ("server", "both"), stop)
        finally:
            done.set()

    lf = ucxx.create_listener(handler)
    print(f"PORT {lf.port}", flush=True)
    await done.wait()
    lf.close()
    ucxx.stop_notifier_thread()


async def _client(args) -> None:
    import numpy as np
    import ucxx

    _init(ucxx, args)
    stop = _stdin_event(asyncio.get_running_loop())
    ep = await ucxx.create_endpoint(args.address, args.port)
    await _exchange(ep, np, args.messages, first=True)
    await _idle_until_stop(ep, np, args.pending in ("client", "both"), stop)
    ucxx.stop_notifier_thread()


# --------------------------------------------------------------- driver
def measure(package: str, mode: str, tls: str = "tcp", seconds: float = 3.0, *,
            settle: float = 0.1, messages: int = 10, pending: str = "both",
            spin_us: str | None = None, python: str | None = None,
            rapids_python: str | None = None, net_devices: str = au.NET_DEVICES,
            address: str = au.ADDRESS, env: dict | None = None,
            timeout: float = 60.0) -> dict:
    """Run one idle measurement; the CPU seconds each process used in
    ``seconds`` of idleness. AnchorError on any failure."""
    py = python or au.python_for(package, rapids=rapids_python)
    penv = au.package_env(package, tls, net_devices)
    penv.update(env or {})
    common = ["--mode", mode, "--messages", str(messages), "--pending", pending]
    if spin_us is not None:
        common += ["--spin-us", str(spin_us)]
    procs = []
    out = {"package": package, "mode": mode, "tls": tls, "seconds": seconds,
           "settle": settle, "pending": pending, "spin_us": spin_us}
    try:
        srv = au.spawn([py, SCRIPT, "--role", "server", *common], penv,
                       stdin=subprocess.PIPE)
        procs.append(srv)
        s_out, s_err = au.Lines(srv.stdout), au.Lines(srv.stderr)
        m = s_out.wait_for(r"^PORT (\d+)", timeout)
        if m is None:
            raise au.AnchorError("idle server printed no port:\n" + s_err.text()[-2000:])
        cli = au.spawn([py, SCRIPT, "--role", "client", "--port", m.group(1),
                        "--address", address, *common], penv,
                       stdin=subprocess.PIPE)
        procs.append(cli)
        c_out, c_err = au.Lines(cli.stdout), au.Lines(cli.stderr)
        for name, lines, err in (("client", c_out, c_err), ("server", s_out, s_err)):
            if lines.wait_for(r"^IDLE", timeout) is None:
                raise au.AnchorError(f"idle {name} did not reach IDLE:\n"
                                     + err.text()[-2000:])
        time.sleep(settle)
        t0 = time.monotonic()
        s0, c0 = au.cpu_clock_s(srv.pid), au.cpu_clock_s(cli.pid)
        st0, ct0 = au.stat_ticks_s(srv.pid), au.stat_ticks_s(cli.pid)
        time.sleep(seconds)
        s1, c1 = au.cpu_clock_s(srv.pid), au.cpu_clock_s(cli.pid)
        st1, ct1 = au.stat_ticks_s(srv.pid), au.stat_ticks_s(cli.pid)
        wall = time.monotonic() - t0
        if None in (s0, c0, s1, c1):
            raise au.AnchorError("an idle process exited during the measurement:\n"
                                 + s_err.text()[-1000:] + c_err.text()[-1000:])
        out.update(server_cpu_s=s1 - s0, client_cpu_s=c1 - c0, wall_s=wall,
                   server_ticks_s=(st1 - st0) if None not in (st0, st1) else None,
                   client_ticks_s=(ct1 - ct0) if None not in (ct0, ct1) else None)
        for p in (cli, srv):
            try:
                p.stdin.write("stop\n")
                p.stdin.close()
            except OSError:
                pass
        clean = True
        for p in (cli, srv):
            try:
                p.wait(15)
            except Exception:
                clean = False
        out["clean_exit"] = clean and all(p.returncode == 0 for p in procs)
        return out
    finally:
        for p in procs:
            if p.returncode is None:
                au.kill_group(p)
                try:
                    p.wait(5)
                except Exception:
                    pass


def _table(results: list[dict]) -> str:
    rows = ["| package | transport | mode | server CPU s | client CPU s | in s |",
            "|---|---|---|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            rows.append(f"| {r['package']} | {r['tls']} | {r['mode']} | failed: "
                        f"{r['error'].splitlines()[-1][:80]} | | |")
        else:
            rows.append(f"| {r['package']} | {r['tls']} | {r['mode']} | "
                        f"{r['server_cpu_s']:.3f} | {r['client_cpu_s']:.3f} | "
                        f"{r['seconds']:g} |")
    return "\n".join(rows)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--packages", default="ours,rapids", help="ours, rapids or both")
    p.add_argument("--modes", default=",".join(au.MODES))
    p.add_argument("--tls", default="tcp", help="comma list of tcp, shm")
    p.add_argument("--seconds", type=float, default=3.0, help="idle window (default 3)")
    p.add_argument("--settle", type=float, default=0.1,
                   help="seconds between IDLE and the window (default 0.1)")
    p.add_argument("--messages", type=int, default=10,
                   help="round trips before going idle (default 10)")
    p.add_argument("--pending", choices=("client", "server", "both", "none"), default="both",
                   help="which process posts the never-satisfied receive (default both)")
    p.add_argument("--spin-us", default=None,
                   help="ucxx.init(spin_us=...) for this package's processes (default: "
                   "not passed)")
    p.add_argument("--rapids-python", default=None,
                   help=f"RAPIDS interpreter (default ${au.RAPIDS_ENV} or "
                   f"{au.DEFAULT_RAPIDS_PYTHON})")
    p.add_argument("--net-devices", default=au.NET_DEVICES)
    p.add_argument("--json", action="store_true", help="print one JSON object per run")
    # roles (internal)
    p.add_argument("--role", choices=("server", "client"), help=argparse.SUPPRESS)
    p.add_argument("--mode", default="blocking", help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, help=argparse.SUPPRESS)
    p.add_argument("--address", default=au.ADDRESS, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.role:
        asyncio.run(_server(args) if args.role == "server" else _client(args))
        return 0

    results = []
    for pkg in [x for x in args.packages.split(",") if x]:
        if pkg == "rapids" and au.rapids_python(args.rapids_python) is None:
            print(f"skipped: {au.missing_rapids_message(args.rapids_python)}", flush=True)
            continue
        for tls in [x for x in args.tls.split(",") if x]:
            for mode in [x for x in args.modes.split(",") if x]:
                try:
                    r = measure(pkg, mode, tls, args.seconds, settle=args.settle,
                                messages=args.messages, pending=args.pending,
                                spin_us=args.spin_us if pkg == "ours" else None,
                                rapids_python=args.rapids_python,
                                net_devices=args.net_devices)
                except au.AnchorError as exc:
                    r = {"package": pkg, "mode": mode, "tls": tls, "error": str(exc)}
                results.append(r)
                if args.json:
                    print(json.dumps(r), flush=True)
    if not args.json:
        print(_table(results))
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
