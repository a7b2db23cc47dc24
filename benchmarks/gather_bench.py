"""Sending a batch of frames: ``gather_send`` against awaiting each send.

A client and a server process (the client spawns the server), connected
over UCX (``UCX_TLS=tcp`` unless ``--tls`` says otherwise). Each iteration
the client sends ``--frames`` frames (16 by default) of one size with one
method, and the server receives them with the same method; then

``--pattern ack``   the server answers with a 1-byte ack: time = the
                    batch one way plus the ack (a round trip);
``--pattern echo``  the server sends the batch back with the same method:
                    time = half the round trip (the ping-pong's pattern).

Methods:

``gather``      ``await ep.gather_send(frames)`` / ``await ep.gather_recv(bufs)``:
                one operation (IOV runs, see docs/ENGINE.md "Gathers").
``sequential``  ``for f in frames: await ep.send(f)`` / the same with
                ``await ep.recv(buf)``.
``asyncio``     ``await asyncio.gather(*(ep.send(f) for f in frames))`` / the
                same with ``ep.recv``: every frame posted at once, one
                message each.
``single``      for scale: one message carrying the bytes of all the frames
                (``await ep.send(big)`` / ``await ep.recv(big)``).

All methods run in one session, interleaved: every round measures each
method (rotating the order) for ``--iters`` iterations at every frame
size, and records the client's CPU time (user and system, ``getrusage``).
Each measurement keeps the median and the mean batch time over its
iterations; the report gives the median over rounds of those, the
bandwidth (batch bytes / median time), and the speed-ups as the medians of
the per-round ratios (sequential / gather, asyncio / gather). ``--mode``
takes a list (``blocking,polling``): one server per mode, one after the
other. ``--perftest`` adds raw UCX figures for the same batch, run after
each round in blocking mode (while our processes sleep), after the
session in polling mode (whose processes would take its CPUs):
``ucx_perftest -t tag_bw`` with one contiguous message of the batch's
total and with one IOV message of the frames (``-D iov``), polling, and
the contiguous one sleeping (``-E sleep``), same transports, at UCX's
defaults, and the contiguous one polling with this package's UCX defaults
(``contig-pkg``: the options ``ucxx.init`` passes, ``UCX_TCP_TX_SEG_SIZE``
among them, which both processes here use too); gather / perftest is the
median of the per-round ratios.

    python benchmarks/gather_bench.py --pattern ack --sizes 1K --rounds 7 \
        --iters 300 --mode blocking,polling --cpus 0,1 [--spin-us 0] [--json]
    python benchmarks/gather_bench.py --pattern ack --sizes 4M --rounds 5 \
        --iters 20 --methods gather,sequential,asyncio,single --perftest

Targets (docs/BENCHMARKS.md, "Gathers"): 16 x 1 KiB with ack, gather at
least 3x faster than sequential awaits and than asyncio.gather; 16 x 4 MiB,
gather bandwidth at least 0.95x the one-message-per-frame methods and 0.9x
ucx_perftest's for the same total.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import core
from core import BenchError, parse_size

METHODS = ("gather", "sequential", "asyncio", "single")
# ucx_perftest runs per round: name -> (data layout, wait mode, this
# package's UCX defaults too).
PERFTEST_KINDS = {"contig": ("contig", "poll", False), "iov": ("iov", "poll", False),
                  "contig-sleep": ("contig", "sleep", False),
                  "contig-pkg": ("contig", "poll", True)}
TAG = 0x47415448  # "GATH"


def _schedule(rounds: int, sizes: list[int], methods=METHODS):
    """(round, size, method) in run order; identical on both sides."""
    methods = tuple(methods)
    out = []
    for r in range(rounds):
        for s in sizes:
            k = r % len(methods)
            order = methods[k:] + methods[:k]
            for m in order:
                out.append((r, s, m))
    return out


def _make_ops(ep, method: str, frames: list, bufs: list, big_out, big_in):
    send, recv = ep.send, ep.recv

    if method == "single":

        async def do_send():
            await send(big_out)

        async def do_recv():
            await recv(big_in)

        return do_send, do_recv

    if method == "gather":
        gsend, grecv = ep.gather_send, ep.gather_recv

        async def do_send():
            await gsend(frames)

        async def do_recv():
            await grecv(bufs)
    elif method == "sequential":

        async def do_send():
            for f in frames:
                await send(f)

        async def do_recv():
            for b in bufs:
                await recv(b)
    elif method == "asyncio":
        agather = asyncio.gather

        async def do_send():
            await agather(*[send(f) for f in frames])

        async def do_recv():
            await agather(*[recv(b) for b in bufs])
    else:
        raise ValueError(method)
    return do_send, do_recv


async def _setup(args, role: str, port: int | None):
    from ucxx import _ucxx as U

    from ucxx._lib_async.application_context import effective_options

    loop = asyncio.get_running_loop()
    ctx = U.Context(effective_options())
    w = U.Worker(ctx, args.mode, spin_us=args.spin_us)
    w.start(loop)
    listener = None
    if role == "server":
        got = loop.create_future()
        listener = w.listen(lambda ep: got.done() or got.set_result(ep), 0, "127.0.0.1")
        print(f"PORT {listener.port}", flush=True)
        ep = await asyncio.wait_for(got, core.CONNECT_TIMEOUT_S)
    else:
        ep = w.ep_from_sockaddr("127.0.0.1", port)
    ep.send_tag = ep.recv_tag = TAG
    return ctx, w, listener, ep


async def _teardown(ctx, w, listener, ep):
    try:
        await asyncio.wait_for(_aw(ep.close()), 5.0)
    except Exception:
        ep.abort()
    if listener is not None:
        listener.close()
    w.close()
    ctx.close()


async def _aw(x):
    return await x


async def _server(args) -> int:
    ctx, w, listener, ep = await _setup(args, "server", None)
    sizes = args.sizes
    bufs_by_size = {s: [bytearray(s) for _ in range(args.frames)] for s in sizes}
    big_by_size = {s: bytearray(s * args.frames) for s in sizes}
    ack = bytearray(1)
    echo = args.pattern == "echo"
    for _r, s, m in _schedule(args.rounds, sizes, args.methods):
        bufs, big = bufs_by_size[s], big_by_size[s]
        # receive into bufs; echo the same bufs back, or ack
        do_send, do_recv = _make_ops(ep, m, bufs, bufs, big, big)
        for _ in range(args.warmup + args.iters):
            await do_recv()
            if echo:
                await do_send()
            else:
                await ep.send(ack)
    fin = bytearray(1)
    await ep.recv(fin)
    await _teardown(ctx, w, listener, ep)
    return 0


async def _client(args, port: int) -> dict:
    ctx, w, listener, ep = await _setup(args, "client", port)
    sizes = args.sizes
    frames_by_size = {s: [bytearray(bytes([i % 251]) * s) for i in range(args.frames)]
                      for s in sizes}
    bufs_by_size = {s: [bytearray(s) for _ in range(args.frames)] for s in sizes}
    big_out = {s: bytearray(b"".join(frames_by_size[s])) for s in sizes}
    big_in = {s: bytearray(s * args.frames) for s in sizes}
    ack = bytearray(1)
    echo = args.pattern == "echo"
    # Echo: one way is half the round trip; ack: the batch plus the ack.
    scale = 2.0 if echo else 1.0
    clock = time.perf_counter_ns
    methods = args.methods
    # times[size][method] = list (per round) of the median batch time, ns
    times: dict = {s: {m: [] for m in methods} for s in sizes}
    means: dict = {s: {m: [] for m in methods} for s in sizes}
    cpu: dict = {s: {m: [] for m in methods} for s in sizes}
    recv_ack = ep.recv
    schedule = _schedule(args.rounds, sizes, methods)
    perf = {s: {k: [] for k in PERFTEST_KINDS} for s in sizes} if args.perftest else None
    for k, (r, s, m) in enumerate(schedule):
        frames, bufs = frames_by_size[s], bufs_by_size[s]
        do_send, do_recv = _make_ops(ep, m, frames, bufs, big_out[s], big_in[s])
        if echo:
            finish = do_recv
        else:
            async def finish():
                await recv_ack(ack)
        for _ in range(args.warmup):
            await do_send()
            await finish()
        samples = [0] * args.iters
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = t_prev = clock()
        for i in range(args.iters):
            await do_send()
            await finish()
            t_now = clock()
            samples[i] = t_now - t_prev
            t_prev = t_now
        dt = t_prev - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu[s][m].append(((ru1.ru_utime - ru0.ru_utime) * 1e9 / args.iters,
                          (ru1.ru_stime - ru0.ru_stime) * 1e9 / args.iters))
        if args.check and echo and (any(b != f for b, f in zip(bufs, frames))
                                    if m != "single" else big_in[s] != big_out[s]):
            raise BenchError(f"{m} {s}: echoed frames differ")
        med = statistics.median(samples) / scale
        mean = dt / args.iters / scale
        times[s][m].append(med)
        means[s][m].append(mean)
        if args.verbose:
            print(f"round {r + 1}/{args.rounds} {s:>6} B x{args.frames} {m:10} "
                  f"median {med / 1e3:9.1f} us, mean {mean / 1e3:9.1f} us per batch",
                  file=sys.stderr, flush=True)
        if (perf is not None and args.mode == "blocking"
                and (k + 1 == len(schedule) or schedule[k + 1][0] != r)):
            # A B A B: raw UCX between our rounds, while both our processes
            # sleep until the next batch (polling ones would take its CPUs).
            perftest_round(args, perf)
    await ep.send(bytearray(1))
    await _teardown(ctx, w, listener, ep)
    res = _summarise(args, times, means, cpu)
    res["_times"] = times
    if perf is not None:
        res["_perftest"] = perf
    return res


def _ratio(per: dict, means: dict, a: str, b: str = "gather"):
    """Median and range of the per-round ratios a / b (medians; means)."""
    if a not in per or b not in per:
        return None
    rs = [x / y for x, y in zip(per[a], per[b])]
    rm = [x / y for x, y in zip(means[a], means[b])]
    return statistics.median(rs), [min(rs), max(rs)], statistics.median(rm)


def _summarise(args, times, means, cpu) -> dict:
    out = {
        "frames": args.frames,
        "rounds": args.rounds,
        "iters": args.iters,
        "mode": args.mode,
        "spin_us": args.spin_us,
        "pattern": args.pattern,
        "methods": list(args.methods),
        "tls": args.tls,
        "cpus": args.cpus,
        "net_devices": os.environ.get("UCX_NET_DEVICES"),
        "sizes": {},
    }
    for s, per in times.items():
        entry = {}
        for m in per:
            med = statistics.median(per[m])
            entry[m] = {
                # median over rounds of the per-round median batch time
                "batch_ns_median": med,
                # median over rounds of the per-round mean batch time
                "batch_ns_mean": statistics.median(means[s][m]),
                "batch_ns_rounds": per[m],
                # bytes of one batch (one way) / median batch time
                "bandwidth_Bps": s * args.frames / (med / 1e9),
                # client process CPU time per batch round trip (getrusage)
                "cpu_user_ns": statistics.median(c[0] for c in cpu[s][m]),
                "cpu_sys_ns": statistics.median(c[1] for c in cpu[s][m]),
            }
        for other in ("sequential", "asyncio", "single"):
            got = _ratio(per, means[s], other)
            if got is None:
                continue
            entry[f"speedup_vs_{other}"] = got[0]
            entry[f"speedup_vs_{other}_range"] = got[1]
            entry[f"speedup_vs_{other}_mean"] = got[2]
        out["sizes"][str(s)] = entry
    return out


# ------------------------------------------------------------------ ucx_perftest
def perftest_binary() -> tuple[Path, dict]:
    import libucx

    root = Path(libucx.__file__).resolve().parent
    env = dict(os.environ)
    env["LD_LIBRARY_PATH"] = str(root / "lib") + (
        ":" + env["LD_LIBRARY_PATH"] if env.get("LD_LIBRARY_PATH") else "")
    return root / "bin" / "ucx_perftest", env


def run_perftest(size_arg: str, layout: str, iters: int, warmup: int, cpus,
                 port: int = 13377, wait: str = "poll", pkg_defaults: bool = False) -> float:
    """Bandwidth (bytes/s, one way) of ``ucx_perftest -t tag_bw`` between
    two processes on the loopback; ``size_arg`` is perftest's ``-s``;
    ``pkg_defaults``: with this package's UCX defaults (``UCX_<NAME>``
    for those the environment does not set)."""
    binary, env = perftest_binary()
    if pkg_defaults:
        from ucxx._lib_async.application_context import effective_options

        env.update({f"UCX_{k}": v for k, v in effective_options().items()})
    server_cpu, client_cpu = core.parse_cpus(cpus)
    common = ["-t", "tag_bw", "-s", size_arg, "-n", str(iters), "-w", str(warmup),
              "-D", f"{layout},{layout}", "-E", wait, "-p", str(port), "-f"]
    scmd = [str(binary), *common] + (["-c", str(server_cpu)] if server_cpu is not None else [])
    ccmd = [str(binary), "127.0.0.1", *common] + (
        ["-c", str(client_cpu)] if client_cpu is not None else [])
    server = subprocess.Popen(scmd, env=env, stdout=subprocess.DEVNULL,
                              stderr=subprocess.DEVNULL, preexec_fn=core.die_with_parent)
    try:
        deadline = time.monotonic() + 30
        while True:
            proc = subprocess.run(ccmd, env=env, capture_output=True, text=True, timeout=300)
            if proc.returncode == 0 or time.monotonic() > deadline:
                break
            time.sleep(0.2)
    finally:
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
    if proc.returncode != 0:
        raise BenchError(f"ucx_perftest failed: {proc.stderr.strip()[-300:]}")
    # -f prints one row: iterations, latency typical / average / overall,
    # bandwidth average / overall (MB/s, 2**20 bytes), message rate average
    # / overall.
    rows = [ln.split() for ln in proc.stdout.splitlines()
            if len(ln.split()) == 8 and ln.split()[0].isdigit()]
    if not rows:
        raise BenchError(f"ucx_perftest: no result row in {proc.stdout[-300:]!r}")
    return float(rows[-1][5]) * 1024 * 1024


def perftest_round(args, perf: dict) -> None:
    """One ``ucx_perftest`` run per size and layout, appended to ``perf``."""
    warmup = max(2, args.perftest_iters // 10)
    for s, runs in perf.items():
        for kind, (layout, wait, pkg) in PERFTEST_KINDS.items():
            size = f"{s}:{args.frames}" if layout == "iov" else str(s * args.frames)
            runs[kind].append(run_perftest(size, layout, args.perftest_iters, warmup,
                                           args.cpus, wait=wait, pkg_defaults=pkg))


def _summarise_perftest(args, perf: dict, times: dict) -> dict:
    """Median bandwidths, and gather / perftest as the median of the
    per-round ratios (round i of gather against the perftest run after it)."""
    out = {}
    for s, runs in perf.items():
        entry = {k: {"bandwidth_Bps": statistics.median(v), "rounds": v}
                 for k, v in runs.items()}
        gather_bw = [s * args.frames / (t / 1e9) for t in times[s].get("gather", [])]
        for k, v in runs.items():
            rs = [g / p for g, p in zip(gather_bw, v)]
            if rs:
                entry[k]["gather_ratio"] = statistics.median(rs)
                entry[k]["gather_ratio_range"] = [min(rs), max(rs)]
        out[str(s)] = entry
    return out


# ------------------------------------------------------------------ report
def format_table(res: dict) -> str:
    methods = [m for m in METHODS if m in res.get("methods", METHODS)]
    labels = {"gather": "gather", "sequential": "sequential",
              "asyncio": "asyncio.gather", "single": "one message"}
    what = ("batch + 1 B ack (round trip)" if res.get("pattern") == "ack"
            else "batch one way (half the echo round trip)")
    lines = [
        f"{res['frames']} frames per batch, {res['rounds']} rounds x {res['iters']} batches, "
        f"mode={res['mode']} spin_us={res['spin_us']} UCX_TLS={res['tls']} cpus={res['cpus']}",
        f"time of one {what}, median (mean in brackets), us; bandwidth of the batch",
        f"{'frame':>7} " + " ".join(f"{labels[m]:>24}" for m in methods)
        + "  speed-up of gather vs: " + ", ".join(labels[m] for m in methods if m != "gather"),
    ]
    for s, e in res["sizes"].items():
        cells = [f"{e[m]['batch_ns_median'] / 1e3:.1f} ({e[m]['batch_ns_mean'] / 1e3:.1f}) "
                 f"{e[m]['bandwidth_Bps'] / 1e6:.0f}MB/s" for m in methods]
        ups = [f"{e['speedup_vs_' + m]:.2f}x" for m in methods
               if m != "gather" and "speedup_vs_" + m in e]
        lines.append(f"{_size_label(int(s)):>7} " + " ".join(f"{c:>24}" for c in cells)
                     + "  " + ", ".join(ups))
    lines.append("client CPU per batch, user + system (getrusage), us")
    for s, e in res["sizes"].items():
        lines.append(f"{_size_label(int(s)):>7} " + " ".join(
            f"{m}: {e[m]['cpu_user_ns'] / 1e3:.0f} + {e[m]['cpu_sys_ns'] / 1e3:.0f}"
            for m in methods))
    perf = res.get("perftest")
    if perf:
        lines.append("ucx_perftest -t tag_bw, same transports: one message of the batch "
                     "(contig), one IOV message of the frames (iov), polling; contig "
                     "sleeping (-E sleep); contig with this package's UCX defaults "
                     "(contig-pkg); gather / perftest per round, median [range]:")
        for s, p in perf.items():
            lines.append(f"{_size_label(int(s)):>7} " + "; ".join(
                f"{k} {p[k]['bandwidth_Bps'] / 1e6:.0f} MB/s, gather / {k} "
                f"{p[k]['gather_ratio']:.2f}x [{p[k]['gather_ratio_range'][0]:.2f}-"
                f"{p[k]['gather_ratio_range'][1]:.2f}]" for k in PERFTEST_KINDS if k in p))
    return "\n".join(lines)


def _size_label(n: int) -> str:
    for unit, shift in (("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift and n % (1 << shift) == 0:
            return f"{n >> shift} {unit}"
    return f"{n} B"


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description="gather_send vs awaited sends vs asyncio.gather")
    p.add_argument("--frames", type=int, default=16)
    p.add_argument("--sizes", default="1K,64K", help="frame sizes (K/M suffixes)")
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("-i", "--iters", type=int, default=300, help="batches per method per round")
    p.add_argument("-w", "--warmup", type=int, default=30)
    p.add_argument("-m", "--mode", default="blocking",
                   help="blocking, polling, or a list: blocking,polling")
    p.add_argument("--spin-us", type=float, default=None,
                   help="await spin budget (default: the mode's default)")
    p.add_argument("--pattern", choices=("echo", "ack"), default="echo",
                   help="the server echoes the batch, or answers a 1-byte ack")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument("--tls", default="tcp", help="UCX_TLS or 'shm' (default tcp)")
    p.add_argument("--cpus", default=None, help="pin: CPU or SERVER_CPU,CLIENT_CPU")
    p.add_argument("--net-devices", default=core.NET_DEVICES,
                   help="UCX_NET_DEVICES (default lo; '' leaves the environment alone)")
    p.add_argument("--perftest", action="store_true",
                   help="also run ucx_perftest -t tag_bw for the batch total (contig and iov)")
    p.add_argument("--perftest-iters", type=int, default=50)
    p.add_argument("-c", "--check", action="store_true", help="verify echoed frames")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object (a list "
                   "for several modes)")
    p.add_argument("--role", choices=("client", "server"), default="client",
                   help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if m not in METHODS:
            raise ValueError(f"unknown method {m!r} (one of {', '.join(METHODS)})")
    if "gather" not in args.methods:
        args.methods.insert(0, "gather")
    modes = [m for m in args.mode.split(",") if m]
    for m in modes:
        if m not in ("blocking", "polling"):
            raise ValueError(f"unknown mode {m!r}")
    server_cpu, client_cpu = core.pair_setup(args)
    if args.role == "server":
        return asyncio.run(_server(args))

    raw = [a for a in (argv if argv is not None else sys.argv[1:]) if a != "--json"]
    results = []
    for mode in modes:
        args.mode = mode
        cmd = core.server_cmd(__file__, raw + ["--mode", mode])
        with core.server_process(cmd) as server:
            core.pin(client_cpu)
            port = core.read_port(server)
            res = asyncio.run(_client(args, port))
            core.wait_server(server)
        os.sched_setaffinity(0, range(os.cpu_count() or 1))
        times = res.pop("_times")
        if args.perftest:
            perf = res.pop("_perftest")
            while len(next(iter(perf.values()))["contig"]) < args.rounds:
                perftest_round(args, perf)  # after a polling session: round i pairs with i
            res["perftest"] = _summarise_perftest(args, perf, times)
        results.append(res)
    if args.json:
        print(json.dumps(results[0] if len(results) == 1 else results), flush=True)
    else:
        print("\n\n".join(format_table(r) for r in results), flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except (BenchError, ValueError) as exc:
        print(f"gather_bench: {exc}", file=sys.stderr)
        sys.exit(1)
