"""Dataframe merge benchmark on a local Dask cluster: ucxx:// against tcp://.

A port of the idea of dask-cuda's ``local_cudf_merge`` benchmark to pandas
dataframes: two dataframes of ``--chunk-size`` rows per partition, one
partition per worker by default, are merged on a key column of which a
fraction (``--frac-match``) matches; the merge shuffles both sides between
the workers. The report has the same layout as dask-cuda's: wall clock and
throughput of every run, their mean and median, and per worker-pair transfer
bandwidth percentiles, plus the scheduler's own bandwidth records
(``Scheduler.bandwidth_workers`` / ``bandwidth_types``).

``--protocol ucxx,tcp`` starts one cluster per protocol and interleaves the
runs (ucxx, tcp, ucxx, tcp, ...) so that both see the same machine state, then
prints the two reports and a side-by-side summary.

    python benchmarks/merge.py --protocol ucxx,tcp --runs 5 --chunk-size 1000000

``--scheduler ucxx://host:port,tcp://host:port`` runs against clusters that
are already up (one per address, the protocol from its scheme) instead of
starting local ones; ``benchmarks/merge_hosts.py`` uses it for clusters
whose workers are on separate hosts. ``--json FILE`` writes the summary of
each protocol (throughputs, durations, pair bandwidths) to FILE.
``--breakdown`` splits every large transfer into its parts (see below).
"""

from __future__ import annotations

import argparse
import contextlib
import math
import sys
import time
from collections import defaultdict

import numpy as np

SEP_LEN = 80


# --------------------------------------------------------------------------
# Data
# --------------------------------------------------------------------------


def generate_chunk(i_chunk, local_size, num_chunks, chunk_type, frac_match):
    """One partition. "build": unique keys ``[local_size*i, local_size*(i+1))``
    and a payload; "other": keys of which ``frac_match`` hit the build side,
    spread evenly over its partitions, the rest miss."""
    import pandas as pd

    rng = np.random.default_rng(2**32 - 1 + i_chunk + (0 if chunk_type == "build" else 7919))
    if chunk_type == "build":
        start = local_size * i_chunk
        return pd.DataFrame(
            {
                "key": np.arange(start, start + local_size, dtype="int64"),
                "payload": rng.permutation(np.arange(local_size, dtype="int64")),
            }
        )
    sub = local_size // num_chunks
    sub_use = max(int(sub * frac_match), 1)
    matching = []
    for i in range(num_chunks):
        begin = local_size * i + sub * i_chunk
        matching.append(rng.permutation(np.arange(begin, begin + sub, dtype="int64"))[:sub_use])
    match = np.concatenate(matching)
    missing = local_size - match.shape[0]
    start = local_size * num_chunks + local_size * i_chunk
    keys = np.concatenate([match, np.arange(start, start + missing, dtype="int64")])
    return pd.DataFrame(
        {
            "key": rng.permutation(keys),
            "payload": rng.permutation(np.arange(local_size, dtype="int64")),
        }
    )


def get_random_ddf(chunk_size, num_chunks, frac_match, chunk_type):
    import dask.dataframe as dd

    meta = generate_chunk(0, 4, 1, chunk_type, frac_match).iloc[:0]
    return dd.from_map(
        generate_chunk,
        range(num_chunks),
        args=(chunk_size, num_chunks, chunk_type, frac_match),
        meta=meta,
        divisions=[None] * (num_chunks + 1),
        enforce_metadata=False,
    )


# --------------------------------------------------------------------------
# One run
# --------------------------------------------------------------------------


def bench_once(client, args):
    with client.as_current():
        return _bench_once(client, args)


def _bench_once(client, args):
    from distributed import wait

    n_workers = len(client.scheduler_info()["workers"])
    base_chunks = args.base_chunks or n_workers
    other_chunks = args.other_chunks or n_workers
    base = client.persist(get_random_ddf(args.chunk_size, base_chunks, args.frac_match, "build"))
    other = client.persist(get_random_ddf(args.chunk_size, other_chunks, args.frac_match, "other"))
    wait([base, other])
    row_bytes = 2 * 8  # two int64 columns on each side
    data_processed = (base_chunks + other_chunks) * args.chunk_size * row_bytes

    broadcast = False if args.shuffle_join else (True if args.broadcast_join else None)
    joined = base.merge(
        other, on=["key"], how="inner", broadcast=broadcast, shuffle_method=args.shuffle_method
    )
    t_wall0 = time.time()
    t1 = time.perf_counter()
    result = client.persist(joined)
    wait(result)
    duration = time.perf_counter() - t1
    t_wall1 = time.time()
    if args.check:
        nrows = client.compute(result.shape[0]).result()
        expected = int(max(int(args.chunk_size // base_chunks * args.frac_match), 1)) * base_chunks * other_chunks
        if base_chunks == other_chunks and nrows != expected:
            raise AssertionError(f"merge produced {nrows} rows, expected {expected}")
    del result, base, other
    return data_processed, duration, (t_wall0, t_wall1)


def transfer_log(dask_worker):
    return [
        {k: e[k] for k in ("start", "stop", "total", "bandwidth", "who")}
        for e in dask_worker.transfer_incoming_log
    ]


def scheduler_bandwidth(dask_scheduler):
    return {
        "workers": {f"{a} -> {b}": bw for (a, b), bw in dask_scheduler.bandwidth_workers.items()},
        "types": dict(dask_scheduler.bandwidth_types),
        "total": dask_scheduler.bandwidth,
    }


# --------------------------------------------------------------------------
# Report (dask-cuda local_cudf_merge layout)
# --------------------------------------------------------------------------


def format_bytes(n):
    from dask.utils import format_bytes as fb

    return fb(int(n))


def format_time(t):
    from dask.utils import format_time as ft

    return ft(t)


def print_separator(separator="-", length=SEP_LEN):
    print(separator * length)


def print_key_value(key, value, key_length=25):
    print(f"{key: <{key_length}} | {value}")


def hmean(a):
    a = np.asarray(a, dtype=float)
    return 1 / np.mean(1 / a) if len(a) else 0.0


def hstd(a):
    a = np.asarray(a, dtype=float)
    if not len(a):
        return 0.0
    rmean = np.mean(1 / a)
    rvar = np.var(1 / a)
    return math.sqrt(rvar / (len(a) * rmean**4))


def pair_bandwidths(logs, windows, ignore_size, address_to_index):
    """{(source index, destination index): (q25, q50, q75, total bytes)} of
    the transfers that started inside one of the timed windows."""
    data = defaultdict(list)
    total = defaultdict(int)
    for dest, entries in logs.items():
        for e in entries:
            if e["total"] < ignore_size:
                continue
            if not any(w0 - 0.05 <= e["start"] <= w1 for w0, w1 in windows):
                continue
            key = (address_to_index.get(e["who"], -1), address_to_index[dest])
            data[key].append(e["bandwidth"])
            total[key] += e["total"]
    out = {}
    for key, values in sorted(data.items()):
        q25, q50, q75 = np.quantile(values, [0.25, 0.5, 0.75])
        out[key] = (q25, q50, q75, total[key], hmean(values), len(values))
    return out


def print_report(args, protocol, results, pairs, sched_bw, address_to_index, transports):
    broadcast = False if args.shuffle_join else (True if args.broadcast_join else "default")
    if args.markdown:
        print("```")
    print("Merge benchmark")
    print_separator("-")
    print_key_value("Backend", "dask")
    print_key_value("Merge type", "cpu (pandas)")
    print_key_value("Shuffle method", args.shuffle_method)
    print_key_value("Rows-per-chunk", args.chunk_size)
    print_key_value("Base-chunks", args.base_chunks or args.n_workers)
    print_key_value("Other-chunks", args.other_chunks or args.n_workers)
    print_key_value("Broadcast", broadcast)
    print_key_value("Protocol", protocol)
    if protocol == "ucxx":
        print_key_value("UCX transports (ctx)", transports or "(UCX default)")
        print_key_value("Progress mode", args.progress_mode)
        print_key_value("Error handling", args.error_handling)
    print_key_value("Frac-match", args.frac_match)
    print_key_value("Worker thread(s)", args.threads_per_worker)
    print_key_value("Data processed", format_bytes(results[0][0]))
    print_key_value("Number of workers", len(address_to_index))
    print_separator("=")
    print_key_value("Wall clock", "Throughput")
    print_separator("-")
    durations = np.array([r[1] for r in results])
    throughputs = np.array([r[0] for r in results]) / durations
    for d, t in zip(durations, throughputs):
        print_key_value(format_time(d), f"{format_bytes(t)}/s")
    print_separator("=")
    print_key_value("Throughput", f"{format_bytes(hmean(throughputs))}/s +/- {format_bytes(hstd(throughputs))}/s")
    print_key_value("Throughput (mean)", f"{format_bytes(throughputs.mean())}/s")
    print_key_value("Throughput (median)", f"{format_bytes(np.median(throughputs))}/s")
    bws = [p[4] for p in pairs.values()]
    if bws:
        print_key_value("Bandwidth", f"{format_bytes(hmean(bws))}/s +/- {format_bytes(hstd(bws))}/s")
    print_key_value("Wall clock", f"{format_time(durations.mean())} +/- {format_time(durations.std())}")
    print_separator("=")
    if args.markdown:
        print("```\n<details>\n<summary>Worker-Worker Transfer Rates</summary>\n\n```")
    print_key_value("(w1,w2)", "25% 50% 75% (total nbytes, transfers)")
    print_separator("-")
    for (src, dst), (q25, q50, q75, total, _, count) in pairs.items():
        print_key_value(
            f"({src},{dst})",
            f"{format_bytes(q25)}/s {format_bytes(q50)}/s {format_bytes(q75)}/s "
            f"({format_bytes(total)}, {count})",
        )
    if not pairs:
        print(f"(no transfer of {format_bytes(args.ignore_size)} or more was recorded)")
    print_separator("=")
    print_key_value("Scheduler bandwidth", "(Scheduler.bandwidth_workers, EWMA)")
    print_separator("-")
    for name, bw in sorted(sched_bw["workers"].items()):
        a, b = name.split(" -> ")
        print_key_value(f"({address_to_index.get(a, a)},{address_to_index.get(b, b)})", f"{format_bytes(bw)}/s")
    for typ, bw in sorted(sched_bw["types"].items()):
        print_key_value(f"type {typ}", f"{format_bytes(bw)}/s")
    print_key_value("estimate", f"{format_bytes(sched_bw['total'])}/s")
    print_separator("=")
    print_key_value("Worker index", "Worker address")
    print_separator("-")
    for address, index in sorted(address_to_index.items(), key=lambda kv: kv[1]):
        print_key_value(index, address)
    print_separator("=")
    if args.markdown:
        print("```\n</details>\n")


def print_comparison(args, summaries):
    if args.markdown:
        print("```")
    print("Merge benchmark: side by side")
    print_separator("-")
    protos = list(summaries)
    print_key_value("", " | ".join(f"{p:>22}" for p in protos))
    print_separator("-")
    rows = [
        ("Throughput (hmean)", lambda s: f"{format_bytes(hmean(s['tp']))}/s"),
        ("Throughput (mean)", lambda s: f"{format_bytes(np.mean(s['tp']))}/s"),
        ("Throughput (median)", lambda s: f"{format_bytes(np.median(s['tp']))}/s"),
        ("Wall clock (median)", lambda s: format_time(float(np.median(s['dur'])))),
        ("Wall clock (min)", lambda s: format_time(float(np.min(s['dur'])))),
        ("Bandwidth p50 (pairs)", lambda s: f"{format_bytes(np.median(s['p50']))}/s" if s["p50"] else "-"),
    ]
    for name, fn in rows:
        print_key_value(name, " | ".join(f"{fn(summaries[p]):>22}" for p in protos))
    if len(protos) == 2:
        a, b = protos
        ratio = np.median(summaries[a]["tp"]) / np.median(summaries[b]["tp"])
        print_separator("-")
        print_key_value(f"{a} / {b}", f"{ratio:.2f}x median throughput")
    print_separator("=")
    if args.markdown:
        print("```")


# --------------------------------------------------------------------------
# --breakdown: how much of a worker-to-worker transfer is transport
# --------------------------------------------------------------------------
# The pair bandwidth comes from Worker.transfer_incoming_log: bytes of one
# get_data exchange over its duration D (connection or its reuse, request,
# the sender's serialisation, the wire, the receiver's deserialisation, the
# final "OK"). A transport changes only the wire part T: even one taking no
# time gives at most D / (D - T). Probes on the workers (client.run) time
# get_data_from_worker, the comm's read (length prefix / header arrived,
# last frame in, from_frames) and to_frames; for every transfer of
# --min-size or more the parts' medians are printed, with the pair
# bandwidth a transport taking no time (or one memcpy) would give, for three
# readings of T.


MIN_RECORD = 1 << 16  # to_frames calls smaller than this are not recorded


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




def report_breakdown(args, rows):
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




# --------------------------------------------------------------------------
# Main
# --------------------------------------------------------------------------


def parse_args(argv=None):
    p = argparse.ArgumentParser(description="Distributed merge (dask/pandas) benchmark, ucxx vs tcp")
    p.add_argument("-p", "--protocol", default="ucxx", help="ucxx, tcp (or another registered comm backend, e.g. distributed-ucxx's ucx), or a comma list run interleaved (ucxx,tcp)")
    p.add_argument("-c", "--chunk-size", default=1_000_000, type=int, metavar="n", help="rows per chunk (default 1_000_000)")
    p.add_argument("--runs", default=3, type=int, help="number of timed runs per protocol (default 3)")
    p.add_argument("--warmup-runs", default=1, type=int, help="untimed runs per protocol first (default 1)")
    p.add_argument("--n-workers", default=2, type=int, help="workers (processes) per cluster (default 2)")
    p.add_argument("--threads-per-worker", default=1, type=int)
    p.add_argument("--base-chunks", default=None, type=int, help="base partitions (default n_workers)")
    p.add_argument("--other-chunks", default=None, type=int, help="other partitions (default n_workers)")
    p.add_argument("--frac-match", default=0.3, type=float, help="fraction of rows that match (default 0.3)")
    p.add_argument("--shuffle-method", default="tasks", choices=["tasks", "p2p"], help="dask shuffle for the merge (default tasks)")
    p.add_argument("--broadcast-join", action="store_true", help="use a broadcast join when possible")
    p.add_argument("--shuffle-join", action="store_true", help="force a shuffle join (over --broadcast-join)")
    p.add_argument("--ignore-size", default="1 MiB", help="ignore transfers smaller than this in the bandwidth table (default 1 MiB)")
    p.add_argument("--progress-mode", default="blocking", choices=["blocking", "polling", "thread", "thread-polling"], help="ucxx progress mode (default blocking)")
    p.add_argument("--ucx-tls", default=None, help="UCX transports for ucxx (UCX_TLS), default: UCX's choice")
    p.add_argument(
        "--no-error-handling",
        dest="error_handling",
        action="store_false",
        help="ucxx endpoints without peer-failure handling (lets UCX use shared memory and CMA between local processes)",
    )
    p.add_argument("--no-check", dest="check", action="store_false", help="skip the row-count check")
    p.add_argument("--markdown", action="store_true", help="wrap the report in markdown code blocks")
    p.add_argument(
        "--scheduler",
        default=None,
        help="comma list of scheduler addresses of running clusters (ucxx://..., tcp://...): "
        "use them instead of local clusters; --n-workers workers are waited for",
    )
    p.add_argument("--json", default=None, metavar="FILE", help="write the per-protocol summaries to FILE")
    p.add_argument("--breakdown", action="store_true", help="probe the workers and split every "
                   "large transfer into serialisation, transport and deserialisation (local clusters)")
    p.add_argument("--min-size", default="1 MiB", help="smallest transfer in the breakdown (default 1 MiB)")
    args = p.parse_args(argv)
    from dask.utils import parse_bytes

    args.ignore_size = parse_bytes(args.ignore_size)
    args.min_size = parse_bytes(args.min_size)
    args.protocols = [x.strip() for x in args.protocol.split(",") if x.strip()]
    args.addresses = {}
    if args.scheduler:
        for addr in (x.strip() for x in args.scheduler.split(",") if x.strip()):
            proto, sep, _ = addr.partition("://")
            if not sep:
                p.error(f"scheduler address {addr!r} has no scheme")
            args.addresses[proto] = addr
        args.protocols = list(args.addresses)
    from distributed.comm.registry import backends, get_backend

    for proto in args.protocols:
        try:
            get_backend(proto)
        except ValueError:
            p.error(f"unknown protocol {proto!r} (known: {', '.join(sorted(backends))}; "
                    "ucx is distributed-ucxx's, where it is installed)")
    return args


def main(argv=None):
    args = parse_args(argv)
    import dask
    from distributed import Client, LocalCluster

    config = {
        "distributed.comm.ucxx.progress-mode": args.progress_mode,
        "distributed.scheduler.work-stealing": False,
    }
    if args.ucx_tls:
        config["distributed.comm.ucxx.tls"] = args.ucx_tls
    if not args.error_handling:
        config["distributed.comm.ucxx.error-handling"] = False
    dask.config.set(config)

    clusters = {}
    with contextlib.ExitStack() as stack:
        for proto in args.protocols:
            if proto in args.addresses:
                client = stack.enter_context(
                    Client(args.addresses[proto], set_as_default=False, timeout="60s")
                )
                client.wait_for_workers(args.n_workers, timeout=120)
                clusters[proto] = client
                continue
            cluster = stack.enter_context(
                LocalCluster(
                    # "ucxx" is this package's backend: ucxx-c:// (docs/DASK.md)
                    protocol="ucxx-c" if proto == "ucxx" else proto,
                    n_workers=args.n_workers,
                    threads_per_worker=args.threads_per_worker,
                    processes=True,
                    dashboard_address=":0",
                    host="127.0.0.1",
                )
            )
            client = stack.enter_context(Client(cluster, set_as_default=False))
            client.wait_for_workers(args.n_workers)
            clusters[proto] = client
        transports = {}
        if "ucxx" in clusters:
            try:
                transports["ucxx"] = ",".join(
                    sorted(next(iter(clusters["ucxx"].run(_worker_transports).values())))
                )
            except Exception:
                transports["ucxx"] = None

        if args.breakdown:
            for client in clusters.values():
                client.run(install_probe)
        for _ in range(args.warmup_runs):
            for proto, client in clusters.items():
                bench_once(client, args)
        results = {p: [] for p in clusters}
        windows = {p: [] for p in clusters}
        for run in range(args.runs):
            for proto, client in clusters.items():
                data, duration, window = bench_once(client, args)
                results[proto].append((data, duration))
                windows[proto].append(window)
                print(
                    f"# run {run + 1}/{args.runs} {proto}: {format_time(duration)} "
                    f"{format_bytes(data / duration)}/s",
                    file=sys.stderr,
                    flush=True,
                )

        summaries = {}
        for proto, client in clusters.items():
            workers = sorted(client.scheduler_info()["workers"])
            address_to_index = {a: i for i, a in enumerate(workers)}
            logs = client.run(transfer_log)
            pairs = pair_bandwidths(logs, windows[proto], args.ignore_size, address_to_index)
            sched_bw = client.run_on_scheduler(scheduler_bandwidth)
            print_report(args, proto, results[proto], pairs, sched_bw, address_to_index, transports.get(proto))
            print()
            durations = [r[1] for r in results[proto]]
            summaries[proto] = {
                "tp": [r[0] / r[1] for r in results[proto]],
                "dur": durations,
                "p50": [v[1] for v in pairs.values()],
            }
        if len(summaries) > 1:
            print_comparison(args, summaries)
        if args.breakdown:
            report_breakdown(args, {p: breakdown(c.run(collect_probe), windows[p], args.min_size)
                                    for p, c in clusters.items()})
        if args.json:
            import json

            with open(args.json, "w") as f:
                json.dump(summaries, f)
        for client in clusters.values():
            client.close()
    return 0


def _worker_transports():
    import ucxx

    try:
        return sorted(ucxx.get_active_transports())
    except Exception:
        return []


if __name__ == "__main__":
    sys.exit(main())
