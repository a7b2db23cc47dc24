"""The size sweep: this package beside RAPIDS ucxx and raw UCX, 1 B to 64 MiB.

    python benchmarks/anchors.py                 # the whole sweep, 3 rounds (~50 min)
    python benchmarks/anchors.py --quick         # 1 round: 1 B and 1 MiB, shared memory
    python benchmarks/anchors.py --render docs/bench_sweep.json   # re-render only

Per round, transport and size: raw ``ucx_perftest`` (``-t tag_lat`` and
``-t tag_bw``, ``-E poll -e``, with the package's UCX options of
``DEFAULT_UCX_OPTIONS``); then per reuse (``--reuse-alloc`` or not) and
mode, RAPIDS' own command ``python -m ucxx.benchmarks.send_recv -n SIZE
--backend ucxx-async --progress-mode MODE`` with RAPIDS' interpreter and
with ours, back to back, their order reversed every other round (the
runners of ``core.py``). Iterations per size keep a run near
``--target-s`` seconds. Ratios are taken per round, then their median.
CPU per round trip (user + sys of both processes, sampled over the timed
loop) where the timed loop lasts ``--cpu-min-s`` or more.

Writes ``docs/bench_sweep.json``, its section of ``docs/BENCHMARKS.md``
and ``docs/bench_sweep_<transport>.png`` (with matplotlib).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from pathlib import Path

import core

DOCS = core.DOCS
SIZES = "1,1K,64K,1M,8M,64M"
QUICK_SIZES = "1,1M"
MODES = ("blocking", "polling", "thread")
PACKAGES = ("ours", "rapids")
# The acceptance of the sweep (docs/BENCHMARKS.md, "The size sweep").
TARGET_VS_RAPIDS = 1.0
TARGET_VS_RAPIDS_1B = {"tcp": 0.5, "shm": 0.2}
TARGET_VS_RAW_FROM = 1 << 20
TARGET_POLLING_VS_RAW = 0.8
TARGET_BLOCKING_VS_POLLING = 0.9


def iterations(nbytes: int, target_s: float) -> int:
    """Round trips for a timed loop of about ``target_s`` at an assumed
    1 µs + 5 GB/s one way.  Small messages need many: a shared-memory
    round trip of 1 µs over 20000 iterations is a 20 ms loop, and for its
    first tens of milliseconds the kernel may still run both processes on
    one CPU (a wake-up pulls the woken process to the waker's CPU), which
    is 4x slower than two CPUs and not the steady state."""
    rt = 2 * (1e-6 + nbytes / 5e9)
    return max(20, min(200000, int(target_s / rt)))


def package_ucx_options() -> dict:
    from ucxx._lib_async.application_context import DEFAULT_UCX_OPTIONS

    return dict(DEFAULT_UCX_OPTIONS)


def key(tls: str, nbytes: int, reuse: bool, mode: str) -> str:
    return f"{tls}|{nbytes}|{'reuse' if reuse else 'alloc'}|{mode}"


def run(args, packages: list[str]) -> list[dict]:
    runs: list[dict] = []
    cells = len(args.tls) * len(args.sizes)
    total = args.rounds * cells * (2 * args.raw + len(args.reuse) * len(args.modes)
                                   * len(packages))
    prog = core.Progress(total)

    def record(rec: dict, fn) -> None:
        try:
            rec.update(fn())
            cpu = (f"  cpu/RT {rec['server_cpu_us'] + rec['client_cpu_us']:.1f} µs"
                   if "server_cpu_us" in rec else "")
            msg = f"{core.fmt_t(rec['median_ns']):>9}{cpu}"
        except core.BenchError as exc:
            rec["error"] = str(exc)[-2500:]
            msg = core.failed(exc)
        runs.append(rec)
        prog.step(f"round {rec['round'] + 1} {rec['tls']:>3} {core.size_label(rec['nbytes']):>7} "
                  f"{rec['what']:<24} {msg}")

    for rnd in range(args.rounds):
        for tls in args.tls:
            for nbytes in args.sizes:
                n = iterations(nbytes, args.target_s)
                if args.raw:
                    for test in core.in_order(("tag_lat", "tag_bw"), rnd):
                        rec = {"round": rnd, "tls": tls, "nbytes": nbytes, "variant": test,
                               "what": f"ucx_perftest {test}", "n_iter": n}
                        record(rec, lambda: core.run_perftest(
                            "poll", tls, nbytes, n, args.n_warmup_iter, args, args.cpu_min_s,
                            test, args.ucx))
                for reuse in args.reuse:
                    args.reuse_alloc = reuse
                    for mode in args.modes:
                        for pkg in core.in_order(packages, rnd + (mode == "polling")):
                            rec = {"round": rnd, "tls": tls, "nbytes": nbytes, "variant": pkg,
                                   "mode": mode, "reuse": reuse, "n_iter": n,
                                   "what": f"{pkg} {mode}{' reuse' if reuse else ''}"}
                            record(rec, lambda: core.run_cli(
                                pkg, args.python[pkg], mode, tls, nbytes, n,
                                args.n_warmup_iter, args, args.cpu_min_s))
    return runs


def _matching(runs, **kw) -> list[dict]:
    return [r for r in runs if all(r.get(k) == v for k, v in kw.items())]


def _times(runs, **kw) -> dict[int, float]:
    """{round: median_ns} of the runs that match ``kw`` and did not fail."""
    return {r["round"]: r["median_ns"] for r in _matching(runs, **kw) if "error" not in r}


def _per_round(a: dict, b: dict) -> dict | None:
    """The ratio a / b of the rounds both have: median, range, count."""
    return core.ratio([a[k] / b[k] for k in a if k in b])


def summarise(runs: list[dict]) -> dict:
    """Per cell (tls|size|reuse|mode): medians, per-round ratios, CPU, runs
    that failed; per tls|size: the raw figures."""
    out: dict = {"cells": {}, "raw": {}}
    for tls in dict.fromkeys(r["tls"] for r in runs):
        for nbytes in dict.fromkeys(r["nbytes"] for r in runs if r["tls"] == tls):
            base = {"tls": tls, "nbytes": nbytes}
            lat = _times(runs, variant="tag_lat", **base)
            bw = _times(runs, variant="tag_bw", **base)
            out["raw"][f"{tls}|{nbytes}"] = {"tag_lat_ns": core.median(lat.values()),
                                             "tag_bw_ns": core.median(bw.values())}
            cells = {(r["reuse"], r["mode"]) for r in _matching(runs, **base) if "mode" in r}
            ours_t = {}
            for reuse, mode in sorted(cells, key=lambda c: (not c[0], MODES.index(c[1]))):
                sel = dict(base, reuse=reuse, mode=mode)
                t = {v: _times(runs, variant=v, **sel) for v in PACKAGES}
                ours_t[reuse, mode] = t["ours"]
                c = dict(sel, vs_rapids=_per_round(t["ours"], t["rapids"]),
                         vs_raw_lat=_per_round(lat, t["ours"]),
                         vs_raw_bw=_per_round(bw, t["ours"]))
                for v in PACKAGES:
                    mine = _matching(runs, variant=v, **sel)
                    c[f"{v}_ns"] = core.median(t[v].values())
                    c[f"{v}_cpu_us"] = core.median([r["server_cpu_us"] + r["client_cpu_us"]
                                                    for r in mine if "server_cpu_us" in r])
                    c[f"{v}_failed"] = sum("error" in r for r in mine)
                out["cells"][key(tls, nbytes, reuse, mode)] = c
            for reuse in (True, False):
                if (reuse, "blocking") in ours_t and (reuse, "polling") in ours_t:
                    out["cells"][key(tls, nbytes, reuse, "blocking")]["vs_polling"] = _per_round(
                        ours_t[reuse, "polling"], ours_t[reuse, "blocking"])
    return out


def verdicts(summary: dict) -> list[str]:
    """The acceptance of the sweep, a line per target: met or missed."""
    lines, cells = [], summary["cells"].values()

    def line(text, ok):
        lines.append(f"{text}: {'met' if ok else 'missed'}")

    worse = [c for c in cells if c["vs_rapids"] and c["vs_rapids"]["median"] > TARGET_VS_RAPIDS]
    n = sum(1 for c in cells if c["vs_rapids"])
    line(f"ours / RAPIDS ≤ {TARGET_VS_RAPIDS} in every cell: {n - len(worse)} of {n}"
         + ("; above: " + ", ".join(f"{core.tls_label(c['tls'])} {core.size_label(c['nbytes'])} "
                                    f"{c['mode']}{' reuse' if c['reuse'] else ''} "
                                    f"{core.fmt_x(c['vs_rapids']['median'])}" for c in worse)
            if worse else ""), not worse and n > 0)
    for tls, target in TARGET_VS_RAPIDS_1B.items():
        one = [c for c in cells if c["tls"] == tls and c["nbytes"] == 1 and c["vs_rapids"]]
        if one:
            top = max(c["vs_rapids"]["median"] for c in one)
            line(f"{core.tls_label(tls)} 1 B: ours / RAPIDS ≤ {target} in every mode (highest "
                 f"{core.fmt_x(top)})", top <= target)
    for c in cells:
        if c["nbytes"] < TARGET_VS_RAW_FROM or not c["reuse"]:
            continue
        where = f"{core.tls_label(c['tls'])} {core.size_label(c['nbytes'])}"
        if c["mode"] == "polling" and c["vs_raw_lat"]:
            x = c["vs_raw_lat"]["median"]
            bw = c["vs_raw_bw"]["median"] if c["vs_raw_bw"] else None
            line(f"{where} polling: ours ≥ {TARGET_POLLING_VS_RAW}× raw tag_lat bandwidth: "
                 f"{core.fmt_x(x)}" + (f" (× tag_bw: {core.fmt_x(bw)})" if bw else ""),
                 x >= TARGET_POLLING_VS_RAW)
        if c["mode"] == "blocking" and c.get("vs_polling"):
            x = c["vs_polling"]["median"]
            line(f"{where} blocking ≥ {TARGET_BLOCKING_VS_POLLING}× ours polling: "
                 f"{core.fmt_x(x)}", x >= TARGET_BLOCKING_VS_POLLING)
    return lines


def _time(c: dict, v: str) -> str:
    """A cell's median, with the runs that failed (RAPIDS' CLI fails some
    64 MiB tcp runs: "Connection reset by remote peer" at its end)."""
    n = c.get(f"{v}_failed", 0)
    if c[f"{v}_ns"] is None:
        return f"failed ×{n}" if n else "–"
    return core.fmt_us(c[f"{v}_ns"]) + (f" ({n} failed)" if n else "")


def render(data: dict) -> str:
    cfg, s = data["config"], data["summary"]
    L = ["## The size sweep: against RAPIDS ucxx and raw UCX", ""]
    L.append(f"_Generated {data['date']} by `{cfg['command']}` ({data['elapsed_min']:.0f} min) "
             f"at commit {data['commit']}._")
    L.append("")
    m, p = data["machine"], data["packages"]
    rap = p.get("rapids")
    L.append(f"- {m.get('cpus', '?')} CPUs, load {data['load_start']} / {data['load_end']}; "
             f"ours: Python {p['ours'].get('python', '?')}, UCX {p['ours'].get('ucx_runtime')}"
             + (f"; RAPIDS: {rap.get('package')}, UCX {rap.get('ucx_runtime')}" if rap else
                f"; RAPIDS not run: {data.get('rapids_skipped')}") + ".")
    L.append(f"- One-way time, median over {cfg['rounds']} interleaved rounds (RAPIDS' "
             "`send_recv` reports half the round trip); ratios per round, then their median. "
             "raw lat / raw bw: `ucx_perftest -t tag_lat` / `-t tag_bw` (`-E poll -e`, the "
             "package's UCX options), one-way time and time per streamed message. "
             "ours / raw: raw time / ours (a bandwidth ratio, 1 = raw UCX's speed).")
    L.append("- CPU: user + sys of both processes per round trip (µs), where the timed loop "
             f"lasted ≥ {cfg['cpu_min_s']} s; `reuse` = `--reuse-alloc`.")
    L.append("")
    for tls in cfg["tls"]:
        L.append(f"### {core.tls_label(tls)}")
        L.append("")
        L.append("| size | buffers | mode | RAPIDS | ours | ours / RAPIDS | CPU/RT RAPIDS | "
                 "CPU/RT ours | raw lat | raw bw | ours / raw lat | ours / raw bw |")
        L.append("|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
        for c in s["cells"].values():
            if c["tls"] != tls:
                continue
            raw = s["raw"].get(f"{tls}|{c['nbytes']}", {})
            L.append(f"| {core.size_label(c['nbytes'])} | {'reuse' if c['reuse'] else 'new'} | "
                     f"{c['mode']} | {_time(c, 'rapids')} | {_time(c, 'ours')}"
                     f" | {core.fmt_range(c['vs_rapids'])} | "
                     f"{core.fmt_us(c['rapids_cpu_us'] and c['rapids_cpu_us'] * 1e3)} | "
                     f"{core.fmt_us(c['ours_cpu_us'] and c['ours_cpu_us'] * 1e3)} | "
                     f"{core.fmt_us(raw.get('tag_lat_ns'))} | {core.fmt_us(raw.get('tag_bw_ns'))}"
                     f" | {core.fmt_range(c['vs_raw_lat'])} | {core.fmt_range(c['vs_raw_bw'])} |")
        L.append("")
    L.append("### Targets")
    L.append("")
    L += [f"- {v}" for v in verdicts(s)]
    for name in data.get("plots", []):
        L += ["", f"![{name}]({name})"]
    return "\n".join(L)


def plot(data: dict, outdir: Path) -> list[str]:
    plt = core.pyplot()
    if plt is None:
        return []
    s, written = data["summary"], []
    for tls in data["config"]["tls"]:
        fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4))
        for mode, color in zip(MODES, ("tab:blue", "tab:green", "tab:purple")):
            for reuse, style in ((True, "-"), (False, "--")):
                cs = [c for c in s["cells"].values() if c["tls"] == tls and c["mode"] == mode
                      and c["reuse"] == reuse]
                xs = [c["nbytes"] for c in cs if c["vs_rapids"]]
                a1.plot(xs, [c["vs_rapids"]["median"] for c in cs if c["vs_rapids"]], style,
                        color=color, marker="o",
                        label=f"{mode}{', reuse' if reuse else ', new buffers'}")
                if reuse:
                    xs = [c["nbytes"] for c in cs if c["vs_raw_lat"]]
                    a2.plot(xs, [c["vs_raw_lat"]["median"] for c in cs if c["vs_raw_lat"]],
                            style, color=color, marker="o", label=mode)
        a1.axhline(1.0, color="gray", lw=0.8)
        a2.axhline(TARGET_POLLING_VS_RAW, color="gray", lw=0.8)
        for ax, t in ((a1, "ours / RAPIDS one-way time (lower is better)"),
                      (a2, "ours / raw UCX tag_lat bandwidth (higher is better)")):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("message size (bytes)")
            ax.set_title(t, fontsize=9)
            ax.legend(fontsize=7)
        a1.set_yscale("log")
        fig.suptitle(f"{core.tls_label(tls)}: size sweep")
        fig.tight_layout()
        name = f"bench_sweep_{tls}.png"
        fig.savefig(outdir / name, dpi=90)
        plt.close(fig)
        written.append(name)
    return written


def finish(data: dict, args) -> None:
    outdir = Path(args.output).parent
    data["plots"] = [] if args.no_plots or args.output == "-" else plot(data, outdir)
    if args.output == "-":
        print(render(data))
        return
    core.write_json(data, args.json_output)
    core.write_section(render(data), args.output, "anchors.py")
    print(f"wrote {args.output}, {args.json_output}", flush=True)


def main(argv=None, prog: str = "python benchmarks/anchors.py") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    p = argparse.ArgumentParser(prog=prog.replace("python ", "", 1),
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--quick", action="store_true", help="1 round, sizes 1,1M, shared memory")
    p.add_argument("--sizes", default=None, help=f"comma list (default {SIZES})")
    p.add_argument("--tls", default=None, help="comma list of tcp, shm (default tcp,shm)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--reuse", default="both", choices=("both", "yes", "no"),
                   help="runs with --reuse-alloc, without, or both (default)")
    p.add_argument("--rounds", type=int, default=None, help="default 3, quick 1")
    p.add_argument("--target-s", type=float, default=0.5,
                   help="timed loop per run, about (sets the iterations per size)")
    p.add_argument("--n-warmup-iter", type=int, default=10)
    p.add_argument("--cpu-min-s", type=float, default=0.3)
    p.add_argument("--no-raw", dest="raw", action="store_false")
    p.add_argument("--no-rapids", dest="rapids", action="store_false")
    p.add_argument("--rapids-python", default=None)
    p.add_argument("--ours-python", default=sys.executable)
    p.add_argument("--ours-args", default="")
    p.add_argument("--ours-env", action="append", default=[], metavar="NAME=VALUE")
    p.add_argument("--address", default=core.ADDRESS)
    p.add_argument("--net-devices", default=core.NET_DEVICES)
    p.add_argument("--timeout", type=float, default=240.0)
    p.add_argument("--output", default=str(DOCS / "BENCHMARKS.md"))
    p.add_argument("--json-output", default=str(DOCS / "bench_sweep.json"))
    p.add_argument("--no-plots", action="store_true")
    p.add_argument("--render", default=None, metavar="JSON")
    args = p.parse_args(argv)
    if args.render:
        data = json.loads(Path(args.render).read_text())
        data["summary"] = summarise(data["runs"])
        finish(data, args)
        return 0
    q = args.quick
    args.sizes = [core.parse_size(x) for x in (args.sizes or (QUICK_SIZES if q else SIZES))
                  .split(",") if x]
    args.tls = [t for t in (args.tls or ("shm" if q else "tcp,shm")).split(",") if t]
    args.modes = [m for m in args.modes.split(",") if m]
    for m in args.modes:
        if m not in MODES:
            p.error(f"unknown mode {m!r} (the sweep runs {', '.join(MODES)})")
    args.reuse = {"both": [True, False], "yes": [True], "no": [False]}[args.reuse]
    args.rounds = args.rounds or (1 if q else 3)
    args.cpus = None
    args.ours_env = dict(kv.split("=", 1) for kv in args.ours_env)
    args.ucx = package_ucx_options()

    t0 = time.monotonic()
    command = " ".join([prog] + [shlex.quote(a) for a in argv])
    data: dict = {"date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                  "machine": core.machine_info(), "commit": core.git_commit(),
                  "load_start": core.loadavg(), "packages": {},
                  "config": {"command": command, "tls": args.tls, "sizes": args.sizes,
                             "modes": args.modes, "reuse": args.reuse, "rounds": args.rounds,
                             "target_s": args.target_s, "cpu_min_s": args.cpu_min_s,
                             "ucx": args.ucx, "ours_env": args.ours_env,
                             "ours_args": args.ours_args}}
    packages = core.packages_for(args, data, "RAPIDS")
    if args.raw:
        args.perftest, args.perftest_lib = core.perftest_path(args.ours_python)
    data["runs"] = run(args, packages)
    data["summary"] = summarise(data["runs"])
    data["load_end"] = core.loadavg()
    data["elapsed_min"] = (time.monotonic() - t0) / 60
    finish(data, args)
    for v in verdicts(data["summary"]):
        print(v, flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
