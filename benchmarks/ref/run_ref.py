"""Run the reference C ping-pong (``benchmarks/ref/pingpong``).

Library use (the benchmark suite interleaves these runs with the Python
package's)::

    from run_ref import run_ref        # with benchmarks/ref on sys.path
    r = run_ref("blocking", 1, iters=10000, warmup=1000, tls="tcp")
    r["latency_ns"], r["median_latency_ns"], r["bandwidth_Bps"]

Command line::

    python benchmarks/ref/run_ref.py -m blocking,polling -n 1,64K,1M \\
        -i 10000 -w 1000 --tls tcp

Every run is one ``pingpong -f`` process pair (server forked by the client)
with the chosen UCX transports in its environment.  ``tls`` is passed as
``UCX_TLS``, except for the alias ``"shm"`` (see :func:`ucx_env`).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

__all__ = [
    "BINARY",
    "RefError",
    "SHM_TLS",
    "build",
    "parse_result",
    "parse_size",
    "run_ref",
    "ucx_env",
]

HERE = Path(__file__).resolve().parent
BINARY = HERE / "pingpong"
BUILD_SCRIPT = HERE / "build.sh"

# Shared memory between two processes that connect through a listener with
# peer error handling (UCX 1.22): tcp must be enabled for the sockaddr
# connection manager to use the loopback device, and the posix/sysv
# transports only offer peer-failure handling when UCX_MM_ERROR_HANDLING=y
# (otherwise UCX routes everything over tcp).  Small messages then go
# through sysv/posix; tcp carries the connection setup.
SHM_TLS = "posix,sysv,cma,tcp"
_MM_TOKENS = {"sm", "shm", "mm", "posix", "sysv"}

_RESULT_RE = re.compile(r"^RESULT (.*)$", re.MULTILINE)
_INT_FIELDS = {"bytes", "iters"}
_FLOAT_FIELDS = {"latency_ns", "median_latency_ns", "bandwidth_Bps"}

_build_lock = threading.Lock()
_built = False


class RefError(RuntimeError):
    """The reference program failed to build or to run."""


def ucx_env(tls: str | None, error_handling: bool = True) -> dict[str, str]:
    """UCX environment variables that select the transports ``tls``.

    ``"shm"`` expands to :data:`SHM_TLS` plus ``UCX_MM_ERROR_HANDLING=y``;
    any other string is used as ``UCX_TLS`` as given (with
    ``UCX_MM_ERROR_HANDLING=y`` added when it names a shared-memory
    transport and peer error handling is on).  ``None`` sets nothing.
    The same dictionary can be applied to the Python package's runs so that
    both sides use the same transports.
    """
    if tls is None:
        return {}
    if tls == "shm":
        tls = SHM_TLS
    env = {"UCX_TLS": tls}
    tokens = {t.strip().lstrip("^") for t in tls.split(",")}
    if error_handling and (tokens & _MM_TOKENS):
        env["UCX_MM_ERROR_HANDLING"] = "y"
    return env


def build(force: bool = False) -> Path:
    """Build the binary if it is missing or stale; return its path."""
    global _built
    with _build_lock:
        if _built and not force and BINARY.exists():
            return BINARY
        cmd = ["sh", str(BUILD_SCRIPT)]
        if force:
            cmd.append("--force")
        env = dict(os.environ)
        env.setdefault("PYTHON", sys.executable)
        proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
        if proc.returncode != 0:
            raise RefError(
                "building the reference ping-pong failed:\n"
                + proc.stdout + proc.stderr
            )
        _built = True
        return BINARY


def parse_size(text: str | int) -> int:
    """``"1"``, ``"64K"``, ``"1MiB"``, ``"64M"`` -> bytes (powers of 2)."""
    if isinstance(text, int):
        return text
    m = re.fullmatch(r"\s*(\d+)\s*([kmgKMG]?)(i?[bB])?\s*", text)
    if not m:
        raise ValueError(f"invalid size: {text!r}")
    shift = {"": 0, "k": 10, "m": 20, "g": 30}[m.group(2).lower()]
    return int(m.group(1)) << shift


def parse_result(stdout: str) -> dict:
    """Parse the ``RESULT key=value ...`` line of the program's output."""
    found = _RESULT_RE.findall(stdout)
    if len(found) != 1:
        raise RefError(f"expected one RESULT line, got: {stdout!r}")
    result: dict = {}
    for item in found[0].split():
        key, sep, value = item.partition("=")
        if not sep:
            raise RefError(f"malformed RESULT field {item!r}")
        if key in _INT_FIELDS:
            result[key] = int(value)
        elif key in _FLOAT_FIELDS:
            result[key] = float(value)
        else:
            result[key] = value
    missing = ({"mode"} | _INT_FIELDS | _FLOAT_FIELDS) - result.keys()
    if missing:
        raise RefError(f"RESULT line lacks {sorted(missing)}: {found[0]!r}")
    return result


def _cpus_arg(cpus) -> str | None:
    if cpus is None:
        return None
    if isinstance(cpus, int):
        return str(cpus)
    if isinstance(cpus, str):
        return cpus
    values = [int(c) for c in cpus]
    if len(values) not in (1, 2):
        raise ValueError("cpus: one CPU or (server CPU, client CPU)")
    return ",".join(map(str, values))


def run_ref(
    mode: str,
    nbytes: int | str,
    iters: int,
    warmup: int,
    tls: str | None,
    port: int | None = None,
    *,
    cpus=None,
    env: dict[str, str] | None = None,
    error_handling: bool = True,
    check: bool = False,
    timeout: float | None = 600.0,
) -> dict:
    """One reference measurement; returns the parsed RESULT line.

    mode     "blocking" (sleep on the worker fd) or "polling" (busy loop)
    nbytes   message size in bytes (int, or a string like "64K")
    iters    measured round trips; warmup: unmeasured ones before
    tls      UCX transports, see :func:`ucx_env` ("tcp", "shm", ...)
    port     listener port (default: an ephemeral one)
    cpus     pin: an int (server and client on that CPU) or
             (server_cpu, client_cpu); None leaves placement to the OS
    env      extra environment variables (applied last)
    error_handling  peer error handling on the endpoints (as the package)
    check    verify the echoed payload every iteration (slower)

    Returned keys: mode, bytes, iters, latency_ns (mean half round trip),
    median_latency_ns, bandwidth_Bps (2 * bytes * iters / seconds), plus
    ucx_tls and cpus describing the run.
    """
    if mode not in ("blocking", "polling"):
        raise ValueError(f"mode must be 'blocking' or 'polling', not {mode!r}")
    nbytes = parse_size(nbytes)
    binary = build()

    cmd = [str(binary), "-f", "-m", mode, "-n", str(nbytes),
           "-i", str(int(iters)), "-w", str(int(warmup))]
    if port is not None:
        cmd += ["-p", str(int(port))]
    cpus_arg = _cpus_arg(cpus)
    if cpus_arg is not None:
        cmd += ["-a", cpus_arg]
    if not error_handling:
        cmd.append("-E")
    if check:
        cmd.append("-c")

    run_env = dict(os.environ)
    run_env.update(ucx_env(tls, error_handling))
    if env:
        run_env.update(env)

    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=run_env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        # SIGTERM makes the client kill and reap its forked server; the
        # server would also die with its parent (PR_SET_PDEATHSIG).
        proc.terminate()
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        if sys.exc_info()[0] is subprocess.TimeoutExpired:
            raise RefError(f"{' '.join(cmd)} timed out after {timeout} s")
        raise
    if proc.returncode != 0:
        raise RefError(
            f"{' '.join(cmd)} exited with {proc.returncode}"
            f" (UCX_TLS={run_env.get('UCX_TLS')}):\n{stderr.strip()}"
        )

    result = parse_result(stdout)
    result["ucx_tls"] = run_env.get("UCX_TLS")
    result["cpus"] = cpus_arg
    return result


def _main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        description="Run the reference C UCX tagged ping-pong.")
    parser.add_argument("-m", "--mode", default="blocking",
                        help="blocking, polling, or a comma list")
    parser.add_argument("-n", "--nbytes", default="1",
                        help="message size(s), comma list, K/M suffixes")
    parser.add_argument("-i", "--iters", type=int, default=10000)
    parser.add_argument("-w", "--warmup", type=int, default=1000)
    parser.add_argument("--tls", default="tcp",
                        help="UCX_TLS value, or 'shm' (default tcp)")
    parser.add_argument("-p", "--port", type=int, default=None)
    parser.add_argument("--cpus", default=None,
                        help="pin: CPU or SERVER_CPU,CLIENT_CPU")
    parser.add_argument("-r", "--repeat", type=int, default=1,
                        help="runs per configuration")
    parser.add_argument("--no-error-handling", action="store_true")
    parser.add_argument("-c", "--check", action="store_true",
                        help="verify payloads")
    parser.add_argument("--json", action="store_true",
                        help="one JSON object per run")
    parser.add_argument("--build", action="store_true",
                        help="only build, print the binary path")
    args = parser.parse_args(argv)

    if args.build:
        print(build(force=True))
        return 0

    modes = [m.strip() for m in args.mode.split(",") if m.strip()]
    sizes = [parse_size(s) for s in args.nbytes.split(",") if s.strip()]
    if not args.json:
        print(f"{'mode':9} {'bytes':>10} {'iters':>7} {'lat_ns':>12} "
              f"{'median_ns':>12} {'MB/s':>10}  UCX_TLS")
    for nbytes in sizes:
        for mode in modes:
            for _ in range(args.repeat):
                r = run_ref(mode, nbytes, args.iters, args.warmup, args.tls,
                            args.port, cpus=args.cpus,
                            error_handling=not args.no_error_handling,
                            check=args.check)
                if args.json:
                    print(json.dumps(r), flush=True)
                else:
                    print(f"{r['mode']:9} {r['bytes']:>10} {r['iters']:>7} "
                          f"{r['latency_ns']:>12.1f} "
                          f"{r['median_latency_ns']:>12.1f} "
                          f"{r['bandwidth_Bps'] / 1e6:>10.1f}  "
                          f"{r['ucx_tls']}", flush=True)
    return 0


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except (RefError, ValueError) as exc:
        print(f"run_ref: {exc}", file=sys.stderr)
        sys.exit(1)
