"""CPU instructions per round trip, counted with ``valgrind --tool=callgrind``.

Wall-clock latency on a small shared VM is noisy; the number of instructions
executed per message is not. This script counts them for a short ping-pong
and reports instructions (Ir) per round trip, so that a regression on the
per-message path shows even when timings do not.

Method: the workload is run twice under callgrind, with ``N1`` and ``N2``
measured round trips after the same warm-up; ``(Ir(N2) - Ir(N1)) / (N2 - N1)``
is the cost of one round trip with start-up, imports, connection set-up and
teardown cancelled out. The same difference, taken per function and per
shared object, shows where the instructions go.

Workloads (all over ``UCX_TLS=tcp`` on the loopback only,
``UCX_NET_DEVICES=lo``; 1-byte messages by default):

``py-*``
    an in-process loopback ping-pong on one asyncio loop: a server worker
    and a client worker (one UCX context each), connected through a
    listener on 127.0.0.1; the client task does ``await ep.send`` /
    ``await ep.recv``, the server task echoes. One process, so the counts
    cover both ends of every round trip (two sends, two receives, and the
    progress/wake-up work of both workers). Variants: ``py-blocking``
    (core API, blocking, spin 0), ``py-polling`` (core, polling, spin 0),
    ``pub-blocking`` (public API: ``ucxx.init`` / ``create_listener`` /
    ``create_endpoint``, blocking, spin 0), ``py-blocking-uvloop`` (as
    ``py-blocking``, on uvloop).
``c-blocking``
    the reference C ping-pong (``ref/pingpong -f -m blocking``); its two
    processes are both counted (callgrind follows the fork) and summed, so
    the figure is also "both ends of one round trip".

``batch-gather``, ``batch-sequential``, ``batch-asyncio``, ``batch-single``
    ``gather_bench.py``'s echo of 16 frames (1 KiB by default) per batch, in
    one process (two workers, blocking, spin 0): ``gather_send`` /
    ``gather_recv``, 16 awaited sends / receives, ``asyncio.gather`` of 16,
    or one message of the same bytes. The figure is per batch round trip.

Polling with a spin budget is not counted: a busy loop executes
instructions for as long as it waits, so its count measures time, not work.

Usage::

    python benchmarks/callgrind.py                      # all variants
    python benchmarks/callgrind.py -v py-blocking --iters 200,1200 --top 25
    python benchmarks/callgrind.py --json

Library: ``measure(variant, n1, n2)`` returns a dict (``ir_per_rt``,
``by_object``, ``top_functions``).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

VARIANTS = ("py-blocking", "py-polling", "py-blocking-1w", "pub-blocking", "c-blocking",
            "py-blocking-uvloop")
# 16 frames per batch, echoed (gather_bench.py's methods), in one process;
# the figure is per batch round trip. Default frame size 1 KiB.
BATCH_VARIANTS = ("batch-gather", "batch-sequential", "batch-asyncio", "batch-single")
DEFAULT_ITERS = (200, 700)
WARMUP = 100
NET_DEVICES = "lo"  # as pingpong_py.NET_DEVICES: the loopback only
WORKLOAD_TIMEOUT_S = 150  # a workload that runs longer is hung: traceback, exit


class CallgrindError(RuntimeError):
    pass


# -------------------------------------------------------------- the workload
async def _inproc_core(mode: str, spin_us: float, nbytes: int, iters: int) -> None:
    from ucxx import _ucxx as U

    loop = asyncio.get_running_loop()
    sctx, cctx = U.Context({}), U.Context({})
    sw = U.Worker(sctx, mode, spin_us=spin_us)
    cw = U.Worker(cctx, mode, spin_us=spin_us)
    sw.start(loop)
    cw.start(loop)
    got = loop.create_future()
    listener = sw.listen(lambda ep: got.done() or got.set_result(ep), 0, "127.0.0.1")
    cep = cw.ep_from_sockaddr("127.0.0.1", listener.port)
    cep.send_tag = cep.recv_tag = 1
    sep = await got
    sep.send_tag = sep.recv_tag = 1
    await _pingpong(cep, sep, nbytes, iters)
    await _close(cep)
    sep.abort()
    listener.close()
    cw.close()
    sw.close()
    cctx.close()
    sctx.close()


async def _inproc_core_one_worker(mode: str, spin_us: float, nbytes: int, iters: int) -> None:
    from ucxx import _ucxx as U

    loop = asyncio.get_running_loop()
    ctx = U.Context({})
    w = U.Worker(ctx, mode, spin_us=spin_us)
    w.start(loop)
    got = loop.create_future()
    listener = w.listen(lambda ep: got.done() or got.set_result(ep), 0, "127.0.0.1")
    cep = w.ep_from_sockaddr("127.0.0.1", listener.port)
    cep.send_tag = cep.recv_tag = 1
    sep = await got
    sep.send_tag = sep.recv_tag = 1
    await _pingpong(cep, sep, nbytes, iters)
    await _close(cep)
    sep.abort()
    listener.close()
    w.close()
    ctx.close()


async def _inproc_public(mode: str, spin_us: float, nbytes: int, iters: int) -> None:
    # One process holds one public context, so both ends share its worker
    # (compare with py-blocking-1w, the core API on one worker).
    import ucxx

    ucxx.init(progress_mode=mode, spin_us=spin_us)
    loop = asyncio.get_running_loop()
    got = loop.create_future()
    listener = ucxx.create_listener(lambda ep: got.done() or got.set_result(ep),
                                    port=0, host="127.0.0.1")
    cep = await ucxx.create_endpoint("127.0.0.1", listener.port)
    sep = await got
    await _pingpong(cep, sep, nbytes, iters)
    await _close(cep)
    await _close(sep)
    listener.close()
    del listener, cep, sep
    try:
        ucxx.reset()
    except Exception:
        pass


async def _close(ep, timeout: float = 30.0) -> None:
    """Graceful close, bounded: a hang here must not stall the measurement
    (it is reported on stderr; the instruction counts are unaffected)."""

    async def _aw(x):
        return await x

    try:
        await asyncio.wait_for(_aw(ep.close()), timeout)
    except asyncio.TimeoutError:
        print(f"callgrind workload: endpoint close did not complete in {timeout} s",
              file=sys.stderr, flush=True)
        ep.abort()


async def _pingpong(cep, sep, nbytes: int, iters: int) -> None:
    async def server():
        buf = bytearray(nbytes)
        send, recv = sep.send, sep.recv
        for _ in range(WARMUP + iters):
            await recv(buf)
            await send(buf)

    async def client():
        out = bytearray(b"\xa5" * nbytes)
        inb = bytearray(nbytes)
        send, recv = cep.send, cep.recv
        for _ in range(WARMUP + iters):
            await send(out)
            await recv(inb)

    st = asyncio.get_running_loop().create_task(server())
    await client()
    await st


async def _inproc_batches(method: str, nbytes: int, iters: int, frames: int = 16) -> None:
    """gather_bench's echo of ``frames`` frames per batch, in one process."""
    from gather_bench import _make_ops
    from ucxx import _ucxx as U

    loop = asyncio.get_running_loop()
    sctx, cctx = U.Context({}), U.Context({})
    sw = U.Worker(sctx, "blocking", spin_us=0.0)
    cw = U.Worker(cctx, "blocking", spin_us=0.0)
    sw.start(loop)
    cw.start(loop)
    got = loop.create_future()
    listener = sw.listen(lambda ep: got.done() or got.set_result(ep), 0, "127.0.0.1")
    cep = cw.ep_from_sockaddr("127.0.0.1", listener.port)
    cep.send_tag = cep.recv_tag = 1
    sep = await got
    sep.send_tag = sep.recv_tag = 1
    out = [bytearray(b"\xa5" * nbytes) for _ in range(frames)]
    inb = [bytearray(nbytes) for _ in range(frames)]
    echo = [bytearray(nbytes) for _ in range(frames)]
    big_out, big_in, big_echo = (bytearray(nbytes * frames) for _ in range(3))
    c_send, c_recv = _make_ops(cep, method, out, inb, big_out, big_in)
    s_send, s_recv = _make_ops(sep, method, echo, echo, big_echo, big_echo)

    async def server():
        for _ in range(WARMUP + iters):
            await s_recv()
            await s_send()

    st = loop.create_task(server())
    for _ in range(WARMUP + iters):
        await c_send()
        await c_recv()
    await st
    await _close(cep)
    sep.abort()
    listener.close()
    cw.close()
    sw.close()
    cctx.close()
    sctx.close()


def _workload(variant: str, nbytes: int, iters: int) -> None:
    if variant == "py-blocking-uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            runner.run(_inproc_core("blocking", 0.0, nbytes, iters))
        return
    if variant.startswith("batch-"):
        asyncio.run(_inproc_batches(variant[len("batch-"):], nbytes, iters))
        return
    if variant == "py-blocking":
        asyncio.run(_inproc_core("blocking", 0.0, nbytes, iters))
    elif variant == "py-polling":
        asyncio.run(_inproc_core("polling", 0.0, nbytes, iters))
    elif variant == "py-blocking-1w":
        asyncio.run(_inproc_core_one_worker("blocking", 0.0, nbytes, iters))
    elif variant == "pub-blocking":
        asyncio.run(_inproc_public("blocking", 0.0, nbytes, iters))
    else:
        raise ValueError(f"unknown workload {variant!r}")


def _count_calls(variant: str, nbytes: int, iters: int) -> dict[str, int]:
    """Run the workload with a profile hook that counts Python-level and
    C-level calls by name (no valgrind)."""
    counts: dict[str, int] = defaultdict(int)

    def hook(frame, event, arg):
        if event == "call":
            co = frame.f_code
            counts[f"{co.co_name} ({os.path.basename(co.co_filename)}:{co.co_firstlineno})"] += 1
        elif event == "c_call":
            mod = getattr(arg, "__module__", None) or type(getattr(arg, "__self__", None)).__name__
            counts[f"{getattr(arg, '__qualname__', repr(arg))} [{mod}]"] += 1

    import threading
    threading.setprofile(hook)
    sys.setprofile(hook)
    try:
        _workload(variant, nbytes, iters)
    finally:
        sys.setprofile(None)
        threading.setprofile(None)
    return dict(counts)


def python_calls(variant: str, n1: int = DEFAULT_ITERS[0], n2: int = DEFAULT_ITERS[1],
                 nbytes: int = 1, top: int = 25) -> list[tuple[str, float]]:
    """Python-visible calls per round trip (from a profile hook, by
    difference of two runs): which Python functions and C methods the loop
    goes through for one message. Returns [(name, calls per round trip)]."""
    if variant.startswith("c-"):
        return []
    from ref.run_ref import ucx_env

    env = dict(os.environ)
    env.update(ucx_env("tcp"))
    env["UCX_NET_DEVICES"] = NET_DEVICES
    res = []
    for n in (n1, n2):
        cmd = [sys.executable, str(Path(__file__).resolve()), "--workload", variant,
               "--count-calls", "-n", str(nbytes), "-i", str(n)]
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
        if proc.returncode != 0:
            raise CallgrindError(f"{' '.join(cmd)} failed:\n{proc.stderr[-2000:]}")
        res.append(json.loads(proc.stdout.strip().splitlines()[-1]))
    d = n2 - n1
    diff = {k: (res[1].get(k, 0) - res[0].get(k, 0)) / d for k in set(res[0]) | set(res[1])}
    out = [(k, v) for k, v in diff.items() if v >= 0.05]
    out.sort(key=lambda kv: -kv[1])
    return out[:top]


# ----------------------------------------------------------------- the driver
def _valgrind() -> str:
    vg = shutil.which("valgrind")
    if vg is None:
        raise CallgrindError("valgrind is not installed")
    return vg


def _run_once(variant: str, nbytes: int, iters: int, outdir: Path, tag: str) -> list[Path]:
    from ref.run_ref import build, ucx_env

    env = dict(os.environ)
    env.update(ucx_env("tcp"))
    env.pop("UCX_MM_ERROR_HANDLING", None)
    env["UCX_NET_DEVICES"] = NET_DEVICES
    pattern = outdir / f"cg.{tag}.%p.out"
    vg = [_valgrind(), "--tool=callgrind", f"--callgrind-out-file={pattern}",
          "--dump-instr=no", "--compress-strings=no", "--compress-pos=no"]
    if variant == "c-blocking":
        cmd = vg + [str(build()), "-f", "-m", "blocking", "-n", str(nbytes),
                    "-i", str(iters), "-w", str(WARMUP), "-T", "300"]
    else:
        cmd = vg + [sys.executable, str(Path(__file__).resolve()), "--workload", variant,
                    "-n", str(nbytes), "-i", str(iters)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env,
                          timeout=WORKLOAD_TIMEOUT_S + 120)
    if proc.returncode != 0:
        err = "\n".join(ln for ln in (proc.stdout + proc.stderr).splitlines()
                        if not ln.startswith("=="))
        raise CallgrindError(f"{' '.join(cmd)} failed ({proc.returncode}):\n" + err[-3000:])
    files = sorted(outdir.glob(f"cg.{tag}.[0-9]*.out"))
    if not files:
        raise CallgrindError("callgrind wrote no output")
    return files


_TOTALS_RE = re.compile(r"^(?:totals|summary):\s+(\d+)", re.MULTILINE)


def _total_ir(path: Path) -> int:
    m = _TOTALS_RE.search(path.read_text(errors="replace"))
    if not m:
        raise CallgrindError(f"no totals in {path}")
    return int(m.group(1))


def _functions(path: Path) -> tuple[dict, dict]:
    """Parse a callgrind output file (``--compress-strings=no``): exclusive
    Ir per (object, function) and the number of calls to each (object,
    function)."""
    cost: dict[tuple[str, str], int] = defaultdict(int)
    calls: dict[tuple[str, str], int] = defaultdict(int)
    ob = fn = cob = cfn = ""
    skip_next = False
    with open(path, errors="replace") as fh:
        for line in fh:
            c0 = line[:1]
            if c0.isdigit() or c0 in "+-*":
                if skip_next:  # the inclusive cost of a call: not ours
                    skip_next = False
                    continue
                parts = line.split()
                if len(parts) >= 2:
                    cost[(ob, fn)] += int(parts[1])
                continue
            if line.startswith("fn="):
                fn = _fn_name(line[3:].strip())
                cob = ""
            elif line.startswith("ob="):
                ob = line[3:].strip()
            elif line.startswith("cob="):
                cob = line[4:].strip()
            elif line.startswith("cfn="):
                cfn = _fn_name(line[4:].strip())
            elif line.startswith("calls="):
                calls[(cob or ob, cfn)] += int(line[6:].split()[0])
                cob = ""
                skip_next = True
    return (
        {(_short_object(o), f): v for (o, f), v in cost.items()},
        {(_short_object(o), f): v for (o, f), v in calls.items()},
    )


def _fn_name(name: str) -> str:
    # "func'2": a recursion level of func (--separate-recs); merge them.
    return re.sub(r"'\d+$", "", name)


def _short_object(obj: str) -> str:
    name = os.path.basename(obj)
    name = re.sub(r"\.(cpython-[^.]*|abi3)\.so$", ".so", name)
    name = re.sub(r"\.so[.\d]*$", ".so", name)
    return name


# Calls worth counting per round trip (how often the loop goes round).
_INTERESTING_CALLS = {
    "ucp_worker_progress", "ucp_worker_arm", "epoll_wait", "poll", "read", "write",
    "sendmsg", "recvmsg", "writev", "readv", "ucp_tag_send_nbx", "ucp_tag_recv_nbx",
    "_PyEval_EvalFrameDefault", "PyObject_Malloc", "malloc", "free",
}


def _group(obj: str) -> str:
    if obj.startswith("libpython") or obj.startswith("python"):
        return "CPython interpreter (libpython)"
    if obj == "_ucxx.so":
        return "ucxx extension (_ucxx.so)"
    if obj.startswith(("libucp", "libuct", "libucs", "libucm", "libucx")):
        return "UCX (libucp/libuct/libucs)"
    if obj.startswith("libc.") or obj.startswith("libc-") or obj == "libc.so":
        return "libc"
    if obj.startswith("ld-linux"):
        return "dynamic loader"
    if obj.startswith("pingpong"):
        return "reference program"
    return "other"


def _best_run(variant: str, nbytes: int, n: int, tmp: Path, repeats: int,
              errors: list) -> tuple[list[Path], int]:
    """Run ``repeats`` times; keep the run with the fewest instructions.
    One-off work (UCX re-reading /proc/self/maps, a full GC) only ever adds
    instructions, so the minimum is the cleanest; a failed run (a stall
    under valgrind) is skipped if another one succeeds."""
    best: tuple[list[Path], int] | None = None
    for k in range(repeats):
        try:
            files = _run_once(variant, nbytes, n, tmp, f"{variant}.{n}.{k}")
        except (CallgrindError, subprocess.TimeoutExpired) as exc:
            errors.append(str(exc).strip().splitlines()[-1][:300] if str(exc).strip()
                          else repr(exc))
            continue
        ir = sum(_total_ir(f) for f in files)
        if best is None or ir < best[1]:
            best = (files, ir)
    if best is None:
        raise CallgrindError(f"{variant}: all {repeats} runs of {n} iterations failed: "
                             + " | ".join(errors[-repeats:]))
    return best


def measure(variant: str, n1: int = DEFAULT_ITERS[0], n2: int = DEFAULT_ITERS[1],
            nbytes: int = 1, top: int = 15, keep: str | None = None,
            repeats: int = 1) -> dict:
    """Ir per round trip of ``variant`` (see the module docstring).
    ``repeats`` > 1 runs each iteration count that many times and uses the
    run with the fewest instructions."""
    if n2 <= n1:
        raise ValueError("n2 must be larger than n1")
    tmp = Path(keep) if keep else Path(tempfile.mkdtemp(prefix="ucxx-cg-"))
    tmp.mkdir(parents=True, exist_ok=True)
    errors: list[str] = []
    try:
        f1, ir1 = _best_run(variant, nbytes, n1, tmp, repeats, errors)
        f2, ir2 = _best_run(variant, nbytes, n2, tmp, repeats, errors)
        d = n2 - n1
        fn1: dict = defaultdict(int)
        fn2: dict = defaultdict(int)
        cl1: dict = defaultdict(int)
        cl2: dict = defaultdict(int)
        for files, fn, cl in ((f1, fn1, cl1), (f2, fn2, cl2)):
            for f in files:
                cost, calls = _functions(f)
                for k, v in cost.items():
                    fn[k] += v
                for k, v in calls.items():
                    cl[k] += v
        diff = {k: (fn2.get(k, 0) - fn1.get(k, 0)) / d for k in set(fn1) | set(fn2)}
        cdiff = {k: (cl2.get(k, 0) - cl1.get(k, 0)) / d for k in set(cl1) | set(cl2)}
        by_obj: dict[str, float] = defaultdict(float)
        for (obj, _fn), v in diff.items():
            by_obj[_group(obj)] += v
        tops = sorted(diff.items(), key=lambda kv: -kv[1])[:top]
        return {
            "variant": variant,
            "bytes": nbytes,
            "iters": [n1, n2],
            "repeats": repeats,
            "failed_runs": errors,
            "ir_total": [ir1, ir2],
            "ir_per_rt": (ir2 - ir1) / d,
            "by_object": dict(sorted(by_obj.items(), key=lambda kv: -kv[1])),
            "top_functions": [
                {"object": k[0], "function": k[1], "ir_per_rt": v,
                 "calls_per_rt": cdiff.get(k, 0.0)} for k, v in tops
            ],
            "calls_per_rt": {
                f"{k[1]} [{k[0]}]": v for k, v in sorted(cdiff.items(), key=lambda kv: -kv[1])
                if k[1] in _INTERESTING_CALLS and v > 0.01
            },
        }
    finally:
        if not keep:
            shutil.rmtree(tmp, ignore_errors=True)


def format_report(results: list[dict], top: int = 12) -> str:
    lines = []
    for r in results:
        lines.append(f"{r['variant']}: {r['ir_per_rt']:,.0f} Ir per round trip "
                     f"(iters {r['iters'][0]} -> {r['iters'][1]})")
        for grp, v in r["by_object"].items():
            if abs(v) >= 0.5:
                lines.append(f"    {v:>10,.0f}  {grp}")
        for f in r["top_functions"][:top]:
            lines.append(f"      {f['ir_per_rt']:>8,.0f}  {f['function']}  [{f['object']}]"
                         f"  ({f['calls_per_rt']:.2f} calls)")
        if r.get("calls_per_rt"):
            lines.append("    calls per round trip: " + ", ".join(
                f"{k} {v:.2f}" for k, v in r["calls_per_rt"].items()))
        if r.get("python_calls_per_rt"):
            lines.append("    Python-visible calls per round trip:")
            for name, v in r["python_calls_per_rt"][:top]:
                lines.append(f"      {v:>6.2f}  {name}")
    return "\n".join(lines)


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("-v", "--variants", default=",".join(VARIANTS),
                   help=f"comma list of {', '.join(VARIANTS)}")
    p.add_argument("--iters", default=f"{DEFAULT_ITERS[0]},{DEFAULT_ITERS[1]}",
                   help="N1,N2 measured round trips of the two runs")
    p.add_argument("-n", "--nbytes", type=int, default=None,
                   help="message (frame) size: default 1, batch-* 1024")
    p.add_argument("--top", type=int, default=12, help="functions listed per variant")
    p.add_argument("--keep", default=None, help="keep the callgrind files in this folder")
    p.add_argument("-r", "--repeats", type=int, default=2,
                   help="runs per iteration count; the one with the fewest instructions "
                   "is used (default 2)")
    p.add_argument("--json", action="store_true")
    p.add_argument("--python-calls", action="store_true",
                   help="also count Python-visible calls per round trip (profile hook)")
    p.add_argument("--workload", default=None, help=argparse.SUPPRESS)
    p.add_argument("--count-calls", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("-i", "--iterations", type=int, default=1000, help=argparse.SUPPRESS)
    args = p.parse_args(argv)

    if args.workload:
        if args.nbytes is None:
            args.nbytes = 1024 if args.workload.startswith("batch-") else 1
        # A hang (lost wake-up) must end with a traceback, not stall the suite.
        import faulthandler

        faulthandler.dump_traceback_later(WORKLOAD_TIMEOUT_S, exit=True)
        if args.count_calls:
            print(json.dumps(_count_calls(args.workload, args.nbytes, args.iterations)))
        else:
            _workload(args.workload, args.nbytes, args.iterations)
        return 0

    n1, n2 = (int(x) for x in args.iters.split(","))
    results = []
    for v in [x.strip() for x in args.variants.split(",") if x.strip()]:
        if v not in VARIANTS + BATCH_VARIANTS:
            p.error(f"unknown variant {v!r}")
        nb = args.nbytes if args.nbytes is not None else (1024 if v.startswith("batch-") else 1)
        r = measure(v, n1, n2, nb, top=max(args.top, 15), keep=args.keep,
                    repeats=args.repeats)
        if args.python_calls:
            r["python_calls_per_rt"] = python_calls(v, n1, n2, nb)
        results.append(r)
        if args.json:
            print(json.dumps(r), flush=True)
        else:
            print(format_report([r], args.top), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(_main())
