"""How much of a worker-to-worker transfer is transport: an upper bound on
the pair-bandwidth ratio any comm backend could reach against tcp://.

The pair bandwidth of the merge benchmark (``merge.py``) is taken from
``Worker.transfer_incoming_log``: the bytes of one ``get_data`` exchange
divided by its duration D. D includes the connection (or its reuse), the
request, the sender's serialisation, the wire transfer, the receiver's
deserialisation and the final "OK". A transport only changes the wire
part T; even a transport that takes no time at all gives at most
D / (D - T).

Part 1 runs the merge of ``merge.py`` on one tcp:// and one ucxx:// cluster,
runs interleaved, with probes installed on the workers (``client.run``):

- around ``distributed.worker.get_data_from_worker`` (r0, r1: exactly the
  interval the transfer log records);
- around the comm's ``read``: when the message's length prefix (tcp,
  ``TCP.read`` reading past its 8-byte prefix) or 128-byte header (ucxx,
  ``UCXX._recv_frames``) has arrived, when the last frame is in, and the
  ``from_frames`` (deserialisation) call;
- around the comm's ``to_frames`` (sender serialisation; on the other
  worker, same host clock).

For every transfer of ``--min-size`` or more in the timed runs it derives

    request -> serialise  r0 to the sender's to_frames (connection or its
                          reuse, request, dispatch on the sender)
    serialise             the sender's to_frames
    ready -> last frame   sender's frames ready to last frame in (T, wire)
    prefix -> last frame  prefix/header arrived to last frame in (T, strict)
    deserialise           the receiver's from_frames
    deser. -> end (OK)    the rest of the exchange

and prints their medians. For three readings of T (prefix->last; ready->last;
everything but serialisation, deserialisation and the exchange's tail "OK")
it prints the median pair bandwidth the transfers would have had with a
transport taking no time (and taking one memcpy of the frames, measured in
this process), over the one they had; D / (D - T) at the medians of D and T;
and how short T would have to be for 2x.

Part 2 (isolated) is a ping-pong between this process and a child process,
distributed.comm.connect/listen with ``deserialize=False`` and a message
``{"x": <pre-serialised numpy uint8 array of --iso-size>}`` (default: the
merge's median transfer), answered by a small ack that carries the child's
prefix/last-frame times; tcp:// and ucxx:// alternate round by round.

The load average and the CPU time other processes used during the run are
printed too (the figures mean little on a machine that is busy otherwise).

    python benchmarks/comm_bound.py --runs 10 --chunk-size 1000000
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import multiprocessing as mp
import os
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from merge import bench_once, format_bytes

MIN_RECORD = 1 << 16  # to_frames calls smaller than this are not recorded


# --------------------------------------------------------------------------
# Probes (installed in every worker, and in the isolated test's processes)
# --------------------------------------------------------------------------


def install_probe(dask_worker=None):
    """Wrap get_data_from_worker, TCP.read / UCXX.read, the comms' to_frames
    and from_frames, and the reads' prefix/header and frame reads. State is
    kept on the ``distributed.comm`` module (``_bound_probe``). Idempotent."""
    import contextvars
    from time import time

    import distributed.comm as dcomm
    import distributed.comm.tcp as dtcp
    import distributed.worker as dworker
    from distributed.utils import nbytes

    import ucxx.distributed as dux

    if getattr(dcomm, "_bound_probe", None) is not None:
        dcomm._bound_probe["recv"].clear()
        dcomm._bound_probe["send"].clear()
        return True
    state = {
        "recv": [],
        "send": [],
        "gather": contextvars.ContextVar("gather", default=None),
        "read": contextvars.ContextVar("read", default=None),
    }
    gather_cv, read_cv = state["gather"], state["read"]

    orig_gdfw = dworker.get_data_from_worker

    async def get_data_from_worker(*args, **kwargs):
        rec = {"r0": time(), "reads": [], "worker": kwargs.get("worker")}
        token = gather_cv.set(rec)
        try:
            resp = await orig_gdfw(*args, **kwargs)
        finally:
            rec["r1"] = time()
            gather_cv.reset(token)
        if isinstance(resp, dict) and resp.get("status") == "OK":
            rec["keys"] = list(resp["data"])
            state["recv"].append(rec)
        return resp

    def wrap_read(orig):
        async def read(self, deserializers=None):
            sub = {"read0": time(), "first": None, "last": None, "frames": 0}
            rec = gather_cv.get()
            if rec is not None:
                rec["reads"].append(sub)
            token = read_cv.set(sub)
            try:
                return await orig(self, deserializers)
            finally:
                read_cv.reset(token)

        return read

    orig_rbrw = dtcp.read_bytes_rw

    async def read_bytes_rw(stream, n):
        sub = read_cv.get()
        if sub is not None and sub["first"] is None:
            sub["first"] = time()  # the 8-byte length prefix is in
        buf = await orig_rbrw(stream, n)
        if sub is not None:
            sub["last"] = time()
        return buf

    orig_recv = dux._recv

    async def _recv(ep, bufs, gather):
        await orig_recv(ep, bufs, gather)
        sub = read_cv.get()
        if sub is not None:
            if not gather and len(bufs[0]) == dux.HEADER_SIZE:
                sub["first"] = time()  # the 128-byte header is in
            elif gather:
                sub["last"] = time()

    def wrap_from_frames(orig):
        async def from_frames(frames, *args, **kwargs):
            sub = read_cv.get()
            t0 = time()
            msg = await orig(frames, *args, **kwargs)
            if sub is not None:
                sub.update(
                    deser0=t0, deser1=time(), frames=sum(nbytes(f) for f in frames)
                )
            return msg

        return from_frames

    def wrap_to_frames(orig):
        async def to_frames(msg, *args, **kwargs):
            t0 = time()
            frames = await orig(msg, *args, **kwargs)
            total = sum(nbytes(f) for f in frames)
            if total >= MIN_RECORD:
                state["send"].append({"s0": t0, "s1": time(), "frames": total})
            return frames

        return to_frames

    dworker.get_data_from_worker = get_data_from_worker
    dtcp.TCP.read = wrap_read(dtcp.TCP.read)
    dtcp.read_bytes_rw = read_bytes_rw
    dtcp.from_frames = wrap_from_frames(dtcp.from_frames)
    dtcp.to_frames = wrap_to_frames(dtcp.to_frames)
    dux.UCXX.read = wrap_read(dux.UCXX.read)
    dux._recv = _recv
    dux.from_frames = wrap_from_frames(dux.from_frames)
    dux.to_frames = wrap_to_frames(dux.to_frames)
    dcomm._bound_probe = state
    return True


def collect_probe(dask_worker):
    """This worker's received transfers (joined with its transfer log by
    keys) and its large to_frames calls."""
    import distributed.comm as dcomm

    state = dcomm._bound_probe
    log = {
        tuple(sorted(map(str, e["keys"]))): e for e in dask_worker.transfer_incoming_log
    }
    recv = []
    for rec in state["recv"]:
        entry = log.get(tuple(sorted(map(str, rec["keys"]))))
        reads = [r for r in rec["reads"] if r.get("deser1") is not None]
        if entry is None or not reads:
            continue
        big = max(reads, key=lambda r: r["frames"])
        recv.append(
            {
                "r0": rec["r0"],
                "r1": rec["r1"],
                "who": rec["worker"],
                "total": entry["total"],
                "duration": entry["duration"],
                "read0": big["read0"],
                "first": big["first"],
                "last": big["last"],
                "deser0": big["deser0"],
                "deser1": big["deser1"],
                "frames": big["frames"],
            }
        )
    return {"recv": recv, "send": list(state["send"])}


# --------------------------------------------------------------------------
# Part 1: the merge
# --------------------------------------------------------------------------


def breakdown(collected, windows, min_size):
    """Per large transfer: D and its parts, in seconds."""
    sends = {w: c["send"] for w, c in collected.items()}
    rows = []
    for c in collected.values():
        for r in c["recv"]:
            if r["total"] < min_size or not any(
                w0 - 0.05 <= r["r0"] <= w1 for w0, w1 in windows
            ):
                continue
            # the sender's to_frames of this message: same frame bytes, done
            # between the request and the arrival of the last frame
            cands = [
                s
                for s in sends.get(r["who"], [])
                if s["frames"] == r["frames"] and r["r0"] <= s["s1"] <= r["last"]
            ]
            if not cands:
                continue
            s = max(cands, key=lambda s: s["s1"])
            D = r["r1"] - r["r0"]
            rows.append(
                {
                    "total": r["total"],
                    "frames": r["frames"],
                    "D": D,
                    "strict": r["last"] - r["first"],
                    "wire": r["last"] - s["s1"],
                    "ser": s["s1"] - s["s0"],
                    "deser": r["deser1"] - r["deser0"],
                    "post": r["r1"] - r["deser1"],
                    "pre": s["s0"] - r["r0"],
                    "gap": r["deser0"] - r["last"],
                }
            )
    return rows


def ms(x):
    return f"{x * 1e3:8.2f} ms"


def print_breakdown(proto, rows):
    print(
        f"{proto}: {len(rows)} transfers, median size {format_bytes(np.median([r['total'] for r in rows]))} "
        f"({format_bytes(min(r['total'] for r in rows))} - {format_bytes(max(r['total'] for r in rows))}), "
        f"median frames {format_bytes(np.median([r['frames'] for r in rows]))}"
    )
    med = {k: float(np.median([r[k] for r in rows])) for k in rows[0]}
    q = {k: np.quantile([r[k] for r in rows], [0.25, 0.75]) for k in rows[0]}
    for key, label in [
        ("D", "D (get_data exchange)"),
        ("pre", "request -> serialise"),
        ("ser", "serialise (sender)"),
        ("wire", "ready -> last frame"),
        ("strict", "prefix -> last frame"),
        ("gap", "last frame -> deser."),
        ("deser", "deserialise"),
        ("post", "deser. -> end (OK)"),
    ]:
        print(
            f"  {label:<24} median {ms(med[key])}   (25%-75%: {ms(q[key][0])} - {ms(q[key][1])})"
        )
    bw = np.median([r["total"] / r["D"] for r in rows])
    print(f"  pair bandwidth           median {format_bytes(bw)}/s")
    return med


def transport_parts(rows):
    """T per transfer for the three readings of "transport"."""
    D = np.array([r["D"] for r in rows])
    return {
        "prefix->last": np.array([r["strict"] for r in rows]),
        "ready->last": np.array([r["wire"] for r in rows]),
        "all but (de)ser.": D
        - np.array([r["ser"] + r["deser"] + r["post"] for r in rows]),
    }


def bw_ratio(rows, T, t_new):
    """Median pair bandwidth the transfers would have had had their
    transport part T taken ``t_new`` seconds, over the one they had."""
    D = np.array([r["D"] for r in rows])
    nb = np.array([r["total"] for r in rows])
    return float(np.median(nb / np.maximum(D - T + t_new, 1e-6)) / np.median(nb / D))


def bound_lines(rows, copy_s=0.0, target=2.0):
    """Per reading of T: D / (D - T + copy_s) at the medians of D and T; the
    median-bandwidth ratio for a transport taking ``copy_s`` instead of T;
    and the transport time per transfer that would give ``target`` times the
    median bandwidth (None: not even a transport taking no time would)."""
    out = {}
    D = np.array([r["D"] for r in rows])
    for name, T in transport_parts(rows).items():
        mD, mT = np.median(D), np.median(T)
        need = None
        if bw_ratio(rows, T, 0.0) >= target:
            lo, hi = 0.0, float(D.max())
            for _ in range(50):
                mid = (lo + hi) / 2
                lo, hi = (mid, hi) if bw_ratio(rows, T, mid) >= target else (lo, mid)
            need = lo
        out[name] = (mD / (mD - mT + copy_s), bw_ratio(rows, T, copy_s), need)
    return out


def copy_time(nbytes, rounds=30):
    """Median time of one memcpy of ``nbytes`` into a warm buffer (this
    process, after the clusters are gone)."""
    src = np.ones(nbytes, dtype="uint8")
    dst = np.empty_like(src)
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        np.copyto(dst, src)
        ts.append(time.perf_counter() - t0)
    return float(np.median(ts))


def cpu_sample():
    """(busy seconds of the whole machine, CPU seconds of this process and
    its waited-for children)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    busy = (sum(v) - v[3] - v[4]) / os.sysconf("SC_CLK_TCK")
    t = os.times()
    return busy, t.user + t.system + t.children_user + t.children_system


def run_merge(args):
    import dask
    from distributed import Client, LocalCluster

    dask.config.set(
        {
            "distributed.comm.ucxx.progress-mode": "blocking",
            "distributed.scheduler.work-stealing": False,
        }
    )
    margs = argparse.Namespace(
        chunk_size=args.chunk_size,
        base_chunks=None,
        other_chunks=None,
        frac_match=0.3,
        shuffle_join=False,
        broadcast_join=False,
        shuffle_method="tasks",
        check=True,
    )
    clients = {}
    with contextlib.ExitStack() as stack:
        for proto in args.protocols:
            cluster = stack.enter_context(
                LocalCluster(
                    # "ucxx" is this package's backend: ucxx-c:// (docs/DASK.md)
                    protocol="ucxx-c" if proto == "ucxx" else proto,
                    n_workers=2,
                    threads_per_worker=1,
                    processes=True,
                    dashboard_address=":0",
                    host="127.0.0.1",
                )
            )
            client = stack.enter_context(Client(cluster, set_as_default=False))
            client.wait_for_workers(2)
            clients[proto] = client
        for client in clients.values():
            client.run(install_probe)
        for _ in range(args.warmup_runs):
            for client in clients.values():
                bench_once(client, margs)
        windows = {p: [] for p in clients}
        for run in range(args.runs):
            for proto, client in clients.items():
                _, duration, window = bench_once(client, margs)
                windows[proto].append(window)
                print(
                    f"# run {run + 1}/{args.runs} {proto}: {duration * 1e3:.0f} ms",
                    file=sys.stderr,
                    flush=True,
                )
        rows = {}
        for proto, client in clients.items():
            rows[proto] = breakdown(
                client.run(collect_probe), windows[proto], args.min_size
            )
    return rows


# --------------------------------------------------------------------------
# Part 2: isolated ping-pong
# --------------------------------------------------------------------------


def _iso_child(conn, protocols):
    asyncio.run(_iso_serve(conn, protocols))


async def _iso_serve(conn, protocols):
    from distributed.comm import listen

    install_probe()
    import distributed.comm as dcomm

    state = dcomm._bound_probe

    async def handle(comm):
        rec = {"reads": []}
        state["gather"].set(rec)
        while True:
            rec["reads"].clear()
            msg = await comm.read()
            if msg == "stop":
                break
            sub = rec["reads"][-1]
            await comm.write(
                {"first": sub["first"], "last": sub["last"], "deser1": sub["deser1"]}
            )
        await comm.close()

    listeners = []
    for proto in protocols:
        lst = listen(f"{proto}://127.0.0.1:0", handle, deserialize=False)
        await lst.start()
        listeners.append(lst)
    conn.send([lst.contact_address for lst in listeners])
    await asyncio.get_running_loop().run_in_executor(None, conn.recv)
    for lst in listeners:
        lst.stop()


async def _iso_client(addresses, size, rounds, warmup):
    from time import time

    from distributed.comm import connect
    from distributed.protocol.serialize import Serialized, serialize

    x = np.random.default_rng(0).integers(0, 255, size, dtype="uint8")
    msg = {"x": Serialized(*serialize(x))}
    comms = {p: await connect(a, deserialize=False) for p, a in addresses.items()}
    res = {p: [] for p in comms}
    for i in range(warmup + rounds):
        for proto, comm in comms.items():
            t0 = time()
            await comm.write(msg)
            ack = await comm.read()
            t1 = time()
            if i >= warmup:
                res[proto].append(
                    {
                        "rtt": t1 - t0,
                        "oneway": ack["last"] - t0,
                        "strict": ack["last"] - ack["first"],
                    }
                )
    for comm in comms.values():
        await comm.write("stop")
        await comm.close()
    return res


def run_isolated(args):
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_iso_child, args=(child, args.protocols), daemon=True)
    proc.start()
    try:
        addresses = dict(zip(args.protocols, parent.recv()))
        res = asyncio.run(
            _iso_client(addresses, args.iso_size, args.iso_rounds, args.iso_warmup)
        )
    finally:
        parent.send("stop")
        proc.join(10)
        if proc.is_alive():
            proc.kill()
    return res


# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None):
    from dask.utils import parse_bytes

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument(
        "--protocols",
        default="tcp,ucxx",
        help="comma list, interleaved (default tcp,ucxx)",
    )
    p.add_argument(
        "-c",
        "--chunk-size",
        default=1_000_000,
        type=int,
        help="merge rows per chunk (default 1_000_000)",
    )
    p.add_argument(
        "--runs",
        default=10,
        type=int,
        help="timed merge runs per protocol (default 10)",
    )
    p.add_argument("--warmup-runs", default=1, type=int)
    p.add_argument(
        "--min-size", default="1 MiB", help="smallest transfer counted (default 1 MiB)"
    )
    p.add_argument(
        "--iso-size",
        default=None,
        help="isolated ping-pong message size (default: the merge's median transfer, else 13 MiB)",
    )
    p.add_argument(
        "--iso-rounds",
        default=30,
        type=int,
        help="isolated rounds per protocol (default 30)",
    )
    p.add_argument("--iso-warmup", default=3, type=int)
    p.add_argument("--skip-merge", action="store_true")
    p.add_argument("--skip-isolated", action="store_true")
    args = p.parse_args(argv)
    args.protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    args.min_size = parse_bytes(args.min_size)
    args.iso_size = parse_bytes(args.iso_size) if args.iso_size else None
    return args


def report_merge(args, rows):
    """Print the breakdown and the bounds; return the median frame bytes."""
    print(
        f"\nMerge, --chunk-size {args.chunk_size}, {args.runs} timed runs, "
        f"transfers >= {format_bytes(args.min_size)} (medians, seconds of the host clock)"
    )
    print("-" * 80)
    nbytes = int(
        np.median([x["frames"] for r in rows.values() for x in r] or [13 << 20])
    )
    copy_s = copy_time(nbytes)
    meds = {}
    for proto, r in rows.items():
        if not r:
            print(f"{proto}: no transfer recorded")
            continue
        meds[proto] = print_breakdown(proto, r)
        print(
            f"  if the transport took 0 / one memcpy ({ms(copy_s).strip()} for {format_bytes(nbytes)}) "
            f"instead of T, the median pair bandwidth would be (D/(D-T) at the medians in brackets):"
        )
        zero, one = bound_lines(r), bound_lines(r, copy_s)
        for name in zero:
            need = zero[name][2]
            if need is None:
                need = "not reachable"
            else:
                need = (
                    f"{need * 1e3:.2f} ms ({format_bytes(nbytes / max(need, 1e-9))}/s)"
                )
            print(
                f"    T = {name:<17} {zero[name][1]:4.2f}x / {one[name][1]:4.2f}x "
                f"({zero[name][0]:4.2f}x / {one[name][0]:4.2f}x); 2x needs T <= {need}"
            )
    if "tcp" in meds and "ucxx" in meds:
        t, u = meds["tcp"], meds["ucxx"]
        print("-" * 80)
        print(
            f"ucxx/tcp: D {u['D'] / t['D']:.2f}x, prefix->last {u['strict'] / t['strict']:.2f}x, "
            f"ready->last {u['wire'] / t['wire']:.2f}x"
        )
    return nbytes


def report_isolated(args, res):
    print(
        f"\nIsolated ping-pong, {format_bytes(args.iso_size)} pre-serialised + small ack, "
        f"{args.iso_rounds} rounds per protocol, interleaved (medians)"
    )
    print("-" * 80)
    for proto, r in res.items():
        m = {k: float(np.median([x[k] for x in r])) for k in r[0]}
        print(
            f"  {proto:<5} round trip {ms(m['rtt'])}   write -> last frame in {ms(m['oneway'])}   "
            f"prefix -> last frame {ms(m['strict'])}   ({format_bytes(args.iso_size / m['oneway'])}/s)"
        )


def main(argv=None):
    args = parse_args(argv)
    wall0, (busy0, own0) = time.time(), cpu_sample()
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    nbytes = None
    if not args.skip_merge:
        nbytes = report_merge(args, run_merge(args))
    if not args.skip_isolated:
        args.iso_size = args.iso_size or nbytes or 13 << 20
        report_isolated(args, run_isolated(args))
    busy1, own1 = cpu_sample()
    wall = time.time() - wall0
    other = max(0.0, (busy1 - busy0) - (own1 - own0))
    print(f"load average after: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    print(
        f"CPU over {wall:.0f} s: machine busy {busy1 - busy0:.0f} s, this benchmark {own1 - own0:.0f} s, "
        f"other processes about {other:.0f} s ({other / wall:.2f} cores)"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
