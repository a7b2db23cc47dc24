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
    args = p.parse_args(argv)
    from dask.utils import parse_bytes

    args.ignore_size = parse_bytes(args.ignore_size)
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
