"""Sending a batch of frames: ``gather_send`` against awaiting each send.

A client and a server process (the client spawns the server), connected
over UCX (``UCX_TLS=tcp`` unless ``--tls`` says otherwise). Each iteration
the client sends ``--frames`` frames (16 by default) of one size and the
server echoes them back, both sides using the same method:

``gather``      ``await ep.gather_send(frames)`` / ``await ep.gather_recv(bufs)``:
                all posts in one C call, one awaitable.
``sequential``  ``for f in frames: await ep.send(f)`` / the same with
                ``await ep.recv(buf)``.
``asyncio``     ``await asyncio.gather(*(ep.send(f) for f in frames))`` / the
                same with ``ep.recv``.
``single``      for scale: one message carrying the bytes of all the frames
                (``await ep.send(big)`` / ``await ep.recv(big)``).

All three methods run in one session, interleaved: every round measures
each method (rotating the order) for ``--iters`` iterations at every frame
size, and records the client's CPU time (user and system, ``getrusage``). The time of one batch is half its round trip (one way); each
measurement keeps the median and the mean over its iterations; the report
gives the median over rounds of those, and the speed-ups are the medians of
the per-round ratios (sequential / gather, asyncio / gather), from the
per-measurement medians (and, in the JSON, from the means as well).

    python benchmarks/gather_bench.py --sizes 1K,64K --rounds 7 --iters 300 \\
        --cpus 0,1 [--mode blocking] [--spin-us 0] [--json]

Targets (1 KiB frames): gather at least 3x faster than sequential awaits
and at least 2x faster than asyncio.gather.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import resource
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from pingpong_py import (  # noqa: E402
    CONNECT_TIMEOUT_S,
    NET_DEVICES,
    PyBenchError,
    _die_with_parent,
    _parse_cpus,
    _pin,
    _read_port,
    server_cmd,
    server_process,
    wait_server,
)
from ref.run_ref import parse_size, ucx_env  # noqa: E402

METHODS = ("gather", "sequential", "asyncio", "single")
TAG = 0x47415448  # "GATH"


def _schedule(rounds: int, sizes: list[int]):
    """(round, size, method) in run order; identical on both sides."""
    out = []
    for r in range(rounds):
        for s in sizes:
            k = r % len(METHODS)
            order = METHODS[k:] + METHODS[:k]
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

    loop = asyncio.get_running_loop()
    ctx = U.Context({})
    w = U.Worker(ctx, args.mode, spin_us=args.spin_us)
    w.start(loop)
    listener = None
    if role == "server":
        got = loop.create_future()
        listener = w.listen(lambda ep: got.done() or got.set_result(ep), 0, "127.0.0.1")
        print(f"PORT {listener.port}", flush=True)
        ep = await asyncio.wait_for(got, CONNECT_TIMEOUT_S)
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
    for _r, s, m in _schedule(args.rounds, sizes):
        bufs, big = bufs_by_size[s], big_by_size[s]
        # echo: receive into bufs, send the same bufs back
        do_send, do_recv = _make_ops(ep, m, bufs, bufs, big, big)
        for _ in range(args.warmup + args.iters):
            await do_recv()
            await do_send()
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
    clock = time.perf_counter_ns
    # times[size][method] = list (per round) of mean one-way ns per batch
    times: dict = {s: {m: [] for m in METHODS} for s in sizes}
    means: dict = {s: {m: [] for m in METHODS} for s in sizes}
    cpu: dict = {s: {m: [] for m in METHODS} for s in sizes}
    for r, s, m in _schedule(args.rounds, sizes):
        frames, bufs = frames_by_size[s], bufs_by_size[s]
        do_send, do_recv = _make_ops(ep, m, frames, bufs, big_out[s], big_in[s])
        for _ in range(args.warmup):
            await do_send()
            await do_recv()
        samples = [0] * args.iters
        ru0 = resource.getrusage(resource.RUSAGE_SELF)
        t0 = t_prev = clock()
        for i in range(args.iters):
            await do_send()
            await do_recv()
            t_now = clock()
            samples[i] = t_now - t_prev
            t_prev = t_now
        dt = t_prev - t0
        ru1 = resource.getrusage(resource.RUSAGE_SELF)
        cpu[s][m].append(((ru1.ru_utime - ru0.ru_utime) * 1e9 / args.iters,
                          (ru1.ru_stime - ru0.ru_stime) * 1e9 / args.iters))
        if args.check and (any(b != f for b, f in zip(bufs, frames)) if m != "single"
                           else big_in[s] != big_out[s]):
            raise PyBenchError(f"{m} {s}: echoed frames differ")
        med = statistics.median(samples) / 2.0
        mean = dt / args.iters / 2.0
        times[s][m].append(med)
        means[s][m].append(mean)
        if args.verbose:
            print(f"round {r + 1}/{args.rounds} {s:>6} B x{args.frames} {m:10} "
                  f"median {med / 1e3:9.1f} us, mean {mean / 1e3:9.1f} us per batch "
                  f"(one way)", file=sys.stderr, flush=True)
    await ep.send(bytearray(1))
    await _teardown(ctx, w, listener, ep)
    return _summarise(args, times, means, cpu)


def _summarise(args, times, means, cpu) -> dict:
    out = {
        "frames": args.frames,
        "rounds": args.rounds,
        "iters": args.iters,
        "mode": args.mode,
        "spin_us": args.spin_us,
        "tls": args.tls,
        "cpus": args.cpus,
        "net_devices": os.environ.get("UCX_NET_DEVICES"),
        "sizes": {},
    }
    for s, per in times.items():
        g = per["gather"]
        entry = {}
        for m in METHODS:
            entry[m] = {
                # median over rounds of the per-round median batch time
                "batch_ns_median": statistics.median(per[m]),
                # median over rounds of the per-round mean batch time
                "batch_ns_mean": statistics.median(means[s][m]),
                "batch_ns_rounds": per[m],
                # client process CPU time per batch round trip (getrusage)
                "cpu_user_ns": statistics.median(c[0] for c in cpu[s][m]),
                "cpu_sys_ns": statistics.median(c[1] for c in cpu[s][m]),
            }
        gm = means[s]["gather"]
        entry["speedup_vs_sequential_mean"] = statistics.median(
            [a / b for a, b in zip(means[s]["sequential"], gm)])
        entry["speedup_vs_asyncio_mean"] = statistics.median(
            [a / b for a, b in zip(means[s]["asyncio"], gm)])
        entry["speedup_vs_sequential"] = statistics.median(
            [a / b for a, b in zip(per["sequential"], g)])
        entry["speedup_vs_asyncio"] = statistics.median(
            [a / b for a, b in zip(per["asyncio"], g)])
        entry["speedup_vs_sequential_range"] = [
            min(a / b for a, b in zip(per["sequential"], g)),
            max(a / b for a, b in zip(per["sequential"], g))]
        entry["speedup_vs_asyncio_range"] = [
            min(a / b for a, b in zip(per["asyncio"], g)),
            max(a / b for a, b in zip(per["asyncio"], g))]
        out["sizes"][str(s)] = entry
    return out


def format_table(res: dict) -> str:
    lines = [
        f"{res['frames']} frames per batch, {res['rounds']} rounds x {res['iters']} batches, "
        f"mode={res['mode']} spin_us={res['spin_us']} UCX_TLS={res['tls']} cpus={res['cpus']}",
        "one-way time of one batch, median (mean in brackets), us",
        f"{'frame':>7} {'gather':>16} {'sequential':>16} {'asyncio.gather':>16} "
        f"{'one message':>16} {'seq/gather':>11} {'asyncio/gather':>15}",
    ]
    for s, e in res["sizes"].items():
        cells = [f"{e[m]['batch_ns_median'] / 1e3:.1f} ({e[m]['batch_ns_mean'] / 1e3:.1f})"
                 for m in METHODS]
        lines.append(
            f"{_size_label(int(s)):>7} {cells[0]:>16} {cells[1]:>16} {cells[2]:>16} "
            f"{cells[3]:>16} "
            f"{e['speedup_vs_sequential']:>10.2f}x {e['speedup_vs_asyncio']:>14.2f}x")
    lines.append("client CPU per batch round trip, user + system (getrusage), us")
    for s, e in res["sizes"].items():
        lines.append(f"{_size_label(int(s)):>7} " + " ".join(
            f"{m}: {e[m]['cpu_user_ns'] / 1e3:.0f} + {e[m]['cpu_sys_ns'] / 1e3:.0f}"
            for m in METHODS))
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
    p.add_argument("-m", "--mode", choices=("blocking", "polling"), default="blocking")
    p.add_argument("--spin-us", type=float, default=0.0)
    p.add_argument("--tls", default="tcp", help="UCX_TLS or 'shm' (default tcp)")
    p.add_argument("--cpus", default=None, help="pin: CPU or SERVER_CPU,CLIENT_CPU")
    p.add_argument("--net-devices", default=NET_DEVICES,
                   help="UCX_NET_DEVICES (default lo; '' leaves the environment alone)")
    p.add_argument("-c", "--check", action="store_true", help="verify echoed frames")
    p.add_argument("-v", "--verbose", action="store_true", help="a line per measurement")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--role", choices=("client", "server"), default="client",
                   help=argparse.SUPPRESS)
    p.add_argument("--port", type=int, default=0, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.sizes = [parse_size(s) for s in args.sizes.split(",") if s.strip()]
    os.environ.update(ucx_env(args.tls))
    if args.net_devices:
        os.environ["UCX_NET_DEVICES"] = args.net_devices
    server_cpu, client_cpu = _parse_cpus(args.cpus)

    if args.role == "server":
        _die_with_parent()
        _pin(server_cpu)
        return asyncio.run(_server(args))

    cmd = server_cmd(__file__, [a for a in (argv if argv is not None else sys.argv[1:])
                                if a != "--json"])
    with server_process(cmd) as server:
        _pin(client_cpu)
        port = _read_port(server)
        res = asyncio.run(_client(args, port))
        if args.json:
            print(json.dumps(res), flush=True)
        else:
            print(format_table(res), flush=True)
        wait_server(server)
        return 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except (PyBenchError, ValueError) as exc:
        print(f"gather_bench: {exc}", file=sys.stderr)
        sys.exit(1)
