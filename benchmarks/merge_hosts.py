"""The merge benchmark (benchmarks/merge.py) with its workers on separate
hosts: ucxx:// against tcp://, without and with link delay.

Hosts are network namespaces (tests/_netns.py): ``a`` runs the schedulers
and the client (``merge.py --scheduler ...``), ``b`` and ``c`` run the
workers (``--workers-per-host`` each, one thread, ``--interface eth0``;
``UCX_NET_DEVICES=eth0`` for ucxx), every host linked to a router
namespace. One cluster per protocol stays up for the whole run; for each
``--delays-us`` value every link gets that delay per direction (tc netem,
or the NFQUEUE delayer where the kernel has no netem), the round-trip time
between the worker hosts is measured, and merge.py runs both protocols
interleaved. Every worker-pair transfer between ``b`` and ``c`` crosses two
links and the router. Needs root and ``ip netns``.

    flock /work/bench.lock python benchmarks/merge_hosts.py --delays-us 0,50,500 --runs 5 --rounds 2

Prints merge.py's reports per delay, then one table: median throughput and
median worker-pair bandwidth per protocol, the median of the per-run
throughput ratios of interleaved runs, the ratio of the pair bandwidths,
the measured RTT and the bytes that went through the worker hosts' links.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, os.path.join(ROOT, "tests"))

import _dask_hosts  # noqa: E402
import _netns  # noqa: E402


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protocols", default="ucxx,tcp", help="comma list (default ucxx,tcp)")
    p.add_argument("--delays-us", default="0,50,500",
                   help="link delays per direction to run, microseconds (default 0,50,500)")
    p.add_argument("--workers-per-host", default=1, type=int,
                   help="workers on each of hosts b and c (default 1: every transfer crosses links)")
    p.add_argument("--runs", default=5, type=int, help="timed runs per protocol and delay (default 5)")
    p.add_argument("--warmup-runs", default=1, type=int)
    p.add_argument("--chunk-size", default=1_000_000, type=int, help="rows per partition (default 1_000_000)")
    p.add_argument("--rounds", default=1, type=int,
                   help="sweeps over the delays, every other one in reverse order, so that "
                   "a machine whose load drifts does not favour one delay (default 1)")
    p.add_argument("--merge-args", default="", help="more merge.py arguments, one string")
    return p.parse_args(argv)


def main(argv=None) -> int:
    args = parse_args(argv)
    why = _netns.unavailable()
    if why:
        print(f"cannot make namespace hosts here: {why}", file=sys.stderr)
        return 2
    protocols = [x.strip() for x in args.protocols.split(",") if x.strip()]
    delays = [float(x) for x in args.delays_us.split(",") if x.strip()]
    rows = []
    with _netns.Network(("a", "b", "c")) as net, tempfile.TemporaryDirectory() as tmp:
        for d in delays:
            why = d and net.shaping_unavailable(delay_us=d)
            if why:
                print(f"cannot add a {d:g} us delay: {why}", file=sys.stderr)
                return 2
        clusters = []
        try:
            for i, proto in enumerate(protocols):
                cl = _dask_hosts.Cluster(net, proto, port=8786 + i,
                                         directory=os.path.join(tmp, proto))
                os.makedirs(cl.dir)
                clusters.append(cl)
                cl.start_scheduler()
                for host in ("b", "c"):
                    for k in range(args.workers_per_host):
                        cl.start_worker(host, f"{proto}-{host}{k + 1}")
            n_workers = 2 * args.workers_per_host
            env = _dask_hosts.base_env({"UCX_NET_DEVICES": net["a"].ifname})
            order = []
            for r in range(args.rounds):
                order += delays if r % 2 == 0 else delays[::-1]
            for d in order:
                how = "no delay"
                for h in net.hosts:
                    net.unshape(h)
                    if d:
                        how = net.shape(h, delay_us=d)
                rtt = net.rtt("b", "c")
                before = {h: net.counters(h) for h in ("b", "c")}
                out = os.path.join(tmp, f"merge-{len(rows)}.json")
                cmd = [sys.executable, os.path.join(HERE, "merge.py"),
                       "--scheduler", ",".join(cl.address for cl in clusters),
                       "--n-workers", str(n_workers), "--runs", str(args.runs),
                       "--warmup-runs", str(args.warmup_runs), "--chunk-size", str(args.chunk_size),
                       "--json", out, *args.merge_args.split()]
                print(f"\n######## delay {d:g} us per direction on every link ({how}); "
                      f"RTT b <-> c: p50 {rtt['p50']:.0f} us (p10 {rtt['p10']:.0f}, "
                      f"p90 {rtt['p90']:.0f})", flush=True)
                r = subprocess.run(["ip", "netns", "exec", net["a"].ns, *cmd], env=env,
                                   capture_output=True, text=True, timeout=3600)
                sys.stdout.write(r.stdout)
                if r.returncode != 0:
                    sys.stderr.write(r.stderr[-5000:])
                    for cl in clusters:
                        sys.stderr.write(cl.logs(2000))
                    return 1
                after = {h: net.counters(h) for h in ("b", "c")}
                moved = sum(after[h][k] - before[h][k] for h in ("b", "c")
                            for k in ("from_host", "to_host"))
                with open(out) as f:
                    summaries = json.load(f)
                rows.append((d, rtt, moved, summaries))
        finally:
            for cl in clusters:
                cl.cleanup()
            for h in net.hosts:
                net.unshape(h)
    print_table(protocols, rows)
    return 0


def _median(xs):
    xs = sorted(xs)
    n = len(xs)
    if not n:
        return float("nan")
    return xs[n // 2] if n % 2 else (xs[n // 2 - 1] + xs[n // 2]) / 2


def print_table(protocols, rows) -> None:
    """One line per delay, over every round: median throughput and median
    pair bandwidth per protocol; the throughput ratio is the median of the
    ratios of interleaved runs (run i of one protocol against run i of the
    other)."""
    mib = 1 << 20
    by_delay: dict = {}
    for d, rtt, moved, summaries in rows:
        agg = by_delay.setdefault(d, {"rtt": [], "moved": 0, "tp": {}, "p50": {}, "ratio": []})
        agg["rtt"].append(rtt["p50"])
        agg["moved"] += moved
        for p in protocols:
            agg["tp"].setdefault(p, []).extend(summaries[p]["tp"])
            agg["p50"].setdefault(p, []).extend(summaries[p]["p50"])
        if len(protocols) == 2:
            a, b = protocols
            agg["ratio"] += [x / y for x, y in zip(summaries[a]["tp"], summaries[b]["tp"])]
    print("\nMerge across hosts (workers on b and c; medians over every timed run)")
    head = ["delay/dir", "RTT b<->c"]
    for p in protocols:
        head += [f"{p} MiB/s", f"{p} pair MiB/s"]
    if len(protocols) == 2:
        head += [f"{protocols[0]}/{protocols[1]} tput (paired)", "pair bw", "runs"]
    head.append("link bytes")
    print("| " + " | ".join(head) + " |")
    print("|" + "---|" * len(head))
    for d, agg in by_delay.items():
        cells = [f"{d:g} us", f"{_median(agg['rtt']):.0f} us"]
        tp = {p: _median(agg["tp"][p]) / mib for p in protocols}
        bw = {p: _median(agg["p50"][p]) / mib for p in protocols}
        for p in protocols:
            cells += [f"{tp[p]:.1f}", f"{bw[p]:.0f}"]
        if len(protocols) == 2:
            a, b = protocols
            cells += [f"{_median(agg['ratio']):.2f}x", f"{bw[a] / bw[b]:.2f}x",
                      str(len(agg["ratio"]))]
        cells.append(f"{agg['moved'] / mib:.0f} MiB")
        print("| " + " | ".join(cells) + " |")


if __name__ == "__main__":
    sys.exit(main())
