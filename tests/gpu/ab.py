"""RAPIDS' benchmark command for this package (A) and RAPIDS ucxx (B),
interleaved: in every round each configuration runs A then B back to back,
and the ratio A/B is taken within that pair; the summary gives every
pair's ratio and their median.

    python3 tests/gpu/ab.py --site /tmp/ucxx-gpu-site --out $OUT \\
        [--deadline EPOCH_S] [--rounds 2] [--object cupy] [--quick]

A runs ``python3 -m ucxx.benchmarks.send_recv`` from the repository root
with ``PYTHONPATH=SITE/ours:REPO``; B runs the same command from an empty
directory outside the tree with ``PYTHONPATH=SITE/rapids`` alone, so the
two ``ucxx`` packages never share ``sys.path``. Configurations: 1 B, 1 MiB,
64 MiB, 256 MiB x fresh / ``--reuse-alloc`` x blocking / thread. Rounds are
the outer loop (every configuration gets its first pair before any gets a
second) and the acceptance configurations come first in each round; no
pair starts unless the deadline leaves room for it, and what did not run
is listed as such.

Writes OUT/bench-summary.md (table, ratios, acceptance, exact commands),
OUT/bench.json (every run) and OUT/bench-raw.txt (every run's output).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (label, -n, iterations, quick iterations). -n in plain bytes: RAPIDS' CLI
# parses sizes such as "1MiB" only where dask is importable.
SIZES = [
    ("1 B", "1", 1000, 50),
    ("1 MiB", str(1 << 20), 500, 20),
    ("64 MiB", str(64 << 20), 50, 5),
    ("256 MiB", str(256 << 20), 20, 3),
]
WARMUP = 10
RUN_TIMEOUT = 45  # one CLI run; the slowest expected on the GPU machine is ~10 s

LAT_RE = re.compile(r"Latency \(median\)\s*\|\s*(\d+) ns")
# this package prints kiB, RAPIDS KiB
BW_RE = re.compile(r"Bandwidth \(median\)\s*\|\s*([\d.]+) (B|[kK]iB|MiB|GiB|TiB)/s")
UNIT = {"B": 1, "kiB": 2**10, "KiB": 2**10, "MiB": 2**20, "GiB": 2**30, "TiB": 2**40}


def configs(sizes=None, modes=None):
    """Acceptance configurations first: 1 B and >= 64 MiB in blocking mode,
    then the rest, then thread mode in the same order (``sizes``, ``modes``:
    a subset)."""
    order = [x for x in ("1 B", "64 MiB", "256 MiB", "1 MiB")
             if sizes is None or x.replace(" ", "") in sizes]
    out = []
    for mode in ("blocking", "thread"):
        if modes is not None and mode not in modes:
            continue
        for label in order:
            for reuse in (True, False):
                out.append((label, reuse, mode))
    return out


def side_env(side: str, site: str, ours_env: dict) -> tuple[dict, str]:
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("UCX_NET_DEVICES", "lo")
    env["PYTHONUNBUFFERED"] = "1"
    if side == "ours":
        env.update(ours_env)
        env["PYTHONPATH"] = os.path.join(site, "ours") + os.pathsep + REPO
        return env, REPO
    env["PYTHONPATH"] = os.path.join(site, "rapids")
    cwd = os.path.join(tempfile.gettempdir(), "ucxx-gpu-rapids-cwd")
    os.makedirs(cwd, exist_ok=True)
    return env, cwd


def cli_args(obj: str, n: str, iters: int, reuse: bool, mode: str) -> list[str]:
    a = ["-m", "ucxx.benchmarks.send_recv", "-o", obj, "-n", n,
         "--n-iter", str(iters), "--n-warmup-iter", str(WARMUP),
         "--progress-mode", mode, "-s", "127.0.0.1", "--no-detailed-report"]
    return a + (["--reuse-alloc"] if reuse else [])


def shown(python: str, args: list[str], env: dict, cwd: str) -> str:
    keep = ["PYTHONPATH"] + sorted(k for k in env if k.startswith("UCX_")
                                   or k.startswith("CUPY_"))
    pre = " ".join(f"{k}={shlex.quote(env[k])}" for k in keep if k in env)
    return f"cd {shlex.quote(cwd)} && {pre} {python} {' '.join(args)}"


def run_one(opts, side, args, raw):
    """One CLI run of ``side`` with ``args``; its output goes to ``raw``."""
    python = opts.python
    env, cwd = side_env(side, opts.site, opts.ours_env_dict)
    cmd = shown(python, args, env, cwd)
    t0 = time.monotonic()
    p = subprocess.Popen([python, *args], cwd=cwd, env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = p.communicate(timeout=opts.run_timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc = "timeout"
    wall = time.monotonic() - t0
    raw.write(f"\n===== {side}: {cmd}\n{out}\n===== rc={rc} wall={wall:.1f}s\n")
    raw.flush()
    r = {"side": side, "cmd": cmd, "rc": rc, "wall_s": round(wall, 2)}
    m, b = LAT_RE.search(out or ""), BW_RE.search(out or "")
    if rc == 0 and m and b:
        r["lat_ns"] = int(m.group(1))
        r["bw_Bps"] = float(b.group(1)) * UNIT[b.group(2)]
    else:
        r["error"] = (out or "")[-600:]
    return r


def run_twice(opts, side, args, raw):
    """run_one, once more if the run failed (RAPIDS' CLI now and then loses
    its last echo to the server's close: "Connection reset by remote peer");
    the retry is recorded."""
    r = run_one(opts, side, args, raw)
    if "error" in r:
        first = r
        r = run_one(opts, side, args, raw)
        r["retry_of"] = first
    return r


def fmt_us(ns):
    return "-" if ns is None else f"{ns / 1000:.1f}"


def fmt_bw(bps):
    return "-" if bps is None else f"{bps / 2**30:.2f}"


def fmt_ratio(x):
    return f"{x:.2f}" if x >= 0.1 else f"{x:.2g}"


def med(xs):
    return statistics.median(xs) if xs else None


def summarise(results, args, skipped, started, commands):
    lines = ["# ucxx (ours) beside RAPIDS ucxx, RAPIDS' benchmark command, "
             f"`-o {args.object}`", ""]
    lines.append(f"Rounds asked: {args.rounds}; pairs run: "
                 f"{sum(len(v) for v in results.values())}; wall "
                 f"{time.time() - started:.0f} s. Latency: the CLI's one-way "
                 "median (half the round trip), µs; bandwidth: its median, GiB/s. "
                 "Ratio: ours / RAPIDS within one pair (A then B back to back). "
                 "A failed run is run once more (the row says how many were).")
    lines.append("")
    lines.append("| size | alloc | mode | ours lat µs | RAPIDS lat µs | lat ratio per pair "
                 "| lat ratio median | ours GiB/s | RAPIDS GiB/s | BW ratio median |")
    lines.append("|---|---|---|---|---|---|---|---|---|---|")
    acc = []
    for (label, reuse, mode), pairs in results.items():
        ok = [(a, b) for a, b in pairs if "lat_ns" in a and "lat_ns" in b]
        lr = [a["lat_ns"] / b["lat_ns"] for a, b in ok]
        br = [a["bw_Bps"] / b["bw_Bps"] for a, b in ok]
        errs = [x for ab in pairs for x in ab if "error" in x]
        retried = [x for ab in pairs for x in ab if "retry_of" in x]
        row = [label, "reuse" if reuse else "fresh", mode,
               " / ".join(fmt_us(a.get("lat_ns")) for a, _ in pairs) or "-",
               " / ".join(fmt_us(b.get("lat_ns")) for _, b in pairs) or "-",
               " / ".join(fmt_ratio(x) for x in lr) or "-",
               fmt_ratio(med(lr)) if lr else "-",
               " / ".join(fmt_bw(a.get("bw_Bps")) for a, _ in pairs) or "-",
               " / ".join(fmt_bw(b.get("bw_Bps")) for _, b in pairs) or "-",
               fmt_ratio(med(br)) if br else "-"]
        if errs or retried:
            row[0] += f" ({len(errs)} failed, {len(retried)} retried)"
        lines.append("| " + " | ".join(row) + " |")
        if label == "1 B":
            cap = 1.5 if reuse else 1.0
            acc.append((f"1 B {'--reuse-alloc' if reuse else 'fresh'} {mode}: "
                        f"latency ours/RAPIDS <= {cap}", med(lr), lambda v, c=cap: v <= c))
        elif label in ("64 MiB", "256 MiB"):
            acc.append((f"{label} {'reuse' if reuse else 'fresh'} {mode}: "
                        "bandwidth ours/RAPIDS >= 0.95", med(br), lambda v: v >= 0.95))
    lines += ["", "## Acceptance (median of the pairs' ratios)", ""]
    for text, v, test in acc:
        state = "NOT RUN" if v is None else ("PASS" if test(v) else "FAIL")
        lines.append(f"- {state}: {text}" + ("" if v is None else f" (median {fmt_ratio(v)})"))
    if skipped:
        lines += ["", "## Not run (deadline)", ""]
        lines += [f"- round {r}: {label} {'reuse' if reuse else 'fresh'} {mode}"
                  for r, (label, reuse, mode) in skipped]
    lines += ["", "## Commands", "",
              "Each configuration, ours then RAPIDS (environment as passed; the "
              "rest of the environment is the machine's):", ""]
    for key, (ca, cb) in commands.items():
        label, reuse, mode = key
        lines += [f"- {label} {'reuse' if reuse else 'fresh'} {mode}:",
                  f"  - `{ca}`", f"  - `{cb}`"]
    return "\n".join(lines) + "\n"


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--site", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--python", default=sys.executable)
    ap.add_argument("--object", default="cupy")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--deadline", type=float, default=None,
                    help="epoch seconds after which no pair starts")
    ap.add_argument("--quick", action="store_true", help="short runs (a dry run)")
    ap.add_argument("--ours-env", action="append", default=[], metavar="NAME=VALUE",
                    help="environment for this package's runs only")
    ap.add_argument("--run-timeout", type=float, default=RUN_TIMEOUT)
    ap.add_argument("--sizes", help="a subset, e.g. 1B,64MiB (default: all four)")
    ap.add_argument("--modes", help="a subset, e.g. blocking (default: blocking,thread)")
    args = ap.parse_args()
    args.ours_env_dict = dict(kv.split("=", 1) for kv in args.ours_env)
    started = time.time()
    deadline = args.deadline or started + 3600
    its = {label: (q if args.quick else n) for label, _, n, q in SIZES}
    nflag = {label: n for label, n, _, _ in SIZES}
    chosen = configs(args.sizes and args.sizes.split(","), args.modes and args.modes.split(","))
    results = {c: [] for c in chosen}
    commands, skipped, data = {}, [], []
    pair_s = []  # measured pair durations; 25 s assumed before the first
    with open(os.path.join(args.out, "bench-raw.txt"), "a") as raw:
        for rnd in range(1, args.rounds + 1):
            for c in chosen:
                label, reuse, mode = c
                if time.time() + 1.3 * max(pair_s, default=25.0) > deadline:
                    skipped.append((rnd, c))
                    continue
                a = cli_args(args.object, nflag[label], its[label], reuse, mode)
                t0 = time.monotonic()
                ra = run_twice(args, "ours", a, raw)
                rb = run_twice(args, "rapids", a, raw)
                pair_s.append(time.monotonic() - t0)
                results[c].append((ra, rb))
                commands.setdefault(c, (ra["cmd"], rb["cmd"]))
                data.append({"round": rnd, "size": label, "reuse": reuse, "mode": mode,
                             "ours": ra, "rapids": rb})
                print(f"round {rnd} {label:>7} {'reuse' if reuse else 'fresh'} {mode:8}"
                      f" ours {fmt_us(ra.get('lat_ns')):>8} µs {fmt_bw(ra.get('bw_Bps')):>7} GiB/s"
                      f" | RAPIDS {fmt_us(rb.get('lat_ns')):>8} µs {fmt_bw(rb.get('bw_Bps')):>7} GiB/s"
                      f"  ({time.monotonic() - t0:.1f} s)", flush=True)
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"object": args.object, "rounds": args.rounds, "quick": args.quick,
                   "runs": data, "skipped": [[r, list(c)] for r, c in skipped]}, f, indent=1)
    text = summarise(results, args, skipped, started, commands)
    with open(os.path.join(args.out, "bench-summary.md"), "w") as f:
        f.write(text)
    print(text)
    failed = any("error" in x for d in data for x in (d["ours"], d["rapids"]))
    return 1 if failed or not data else 0


if __name__ == "__main__":
    sys.exit(main())
