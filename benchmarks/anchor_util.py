"""Helpers shared by the benchmarks that run RAPIDS ucxx beside this package
(``anchors.py``, ``idle_cpu.py``, ``fairness.py``).

Two packages share the import name ``ucxx``: this checkout's (run with
``--ours-python``, default the running interpreter, with the checkout on
``PYTHONPATH``) and RAPIDS' ``ucxx-cu12`` in its own virtual environment
(``--rapids-python``, ``$UCXX_RAPIDS_PYTHON``, default
``/work/rapids-venv/bin/python``). Every child process runs in a scratch
directory outside the checkout and RAPIDS' without ``PYTHONPATH``, so that
``python -m ucxx...`` imports the package it is meant to; each measurement
records the ``ucxx.__file__`` it imported and fails if RAPIDS' run imported
this checkout.

Nothing here imports ``ucxx``: the role scripts that import this module run
under either package's interpreter.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import queue
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent

PACKAGES = ("ours", "rapids")
MODES = ("blocking", "polling", "thread", "thread-polling")
DEFAULT_RAPIDS_PYTHON = "/work/rapids-venv/bin/python"
RAPIDS_ENV = "UCXX_RAPIDS_PYTHON"
# Shared memory between listener-connected processes with peer error
# handling (see benchmarks/README.md, "Transports"); tcp carries the
# connection set-up.
SHM_TLS = "posix,sysv,cma,tcp"
NET_DEVICES = "lo"
ADDRESS = "127.0.0.1"


class AnchorError(RuntimeError):
    """A benchmark process failed, timed out or printed no result."""


def rapids_python(explicit: str | None = None) -> str | None:
    """The RAPIDS interpreter: ``explicit``, else ``$UCXX_RAPIDS_PYTHON``,
    else the default path; None if that is not an executable file."""
    path = explicit or os.environ.get(RAPIDS_ENV) or DEFAULT_RAPIDS_PYTHON
    return path if os.path.isfile(path) and os.access(path, os.X_OK) else None


def python_for(package: str, ours_python: str | None = None,
               rapids: str | None = None) -> str:
    if package == "ours":
        return ours_python or sys.executable
    py = rapids_python(rapids)
    if py is None:
        raise AnchorError(missing_rapids_message(rapids))
    return py


def missing_rapids_message(explicit: str | None = None) -> str:
    path = explicit or os.environ.get(RAPIDS_ENV) or DEFAULT_RAPIDS_PYTHON
    return (f"RAPIDS ucxx not found: {path} is not an executable interpreter "
            f"(create a venv with `pip install ucxx-cu12` and pass --rapids-python "
            f"or set ${RAPIDS_ENV})")


def ucx_env(tls: str) -> dict[str, str]:
    """``tcp`` -> ``UCX_TLS=tcp``; ``shm`` -> :data:`SHM_TLS` with
    ``UCX_MM_ERROR_HANDLING=y``; anything else is used as ``UCX_TLS``."""
    if tls == "shm":
        return {"UCX_TLS": SHM_TLS, "UCX_MM_ERROR_HANDLING": "y"}
    return {"UCX_TLS": tls}


def tls_label(tls: str) -> str:
    return "shared memory" if tls == "shm" else tls


def package_env(package: str, tls: str | None, net_devices: str = NET_DEVICES) -> dict:
    """The environment of a child process of ``package`` on ``tls``."""
    env = dict(os.environ)
    for k in ("UCX_TLS", "UCX_MM_ERROR_HANDLING", "PYTHONPATH", "PYTHONHOME",
              "UCXPY_PROGRESS_MODE", "UCXPY_SPIN_US"):
        env.pop(k, None)
    if package == "ours":
        old = os.environ.get("PYTHONPATH")
        env["PYTHONPATH"] = str(ROOT) + (os.pathsep + old if old else "")
    if tls:
        env.update(ucx_env(tls))
    if net_devices:
        env["UCX_NET_DEVICES"] = net_devices
    env["PYTHONUNBUFFERED"] = "1"
    return env


_scratch: str | None = None


def scratch_dir() -> str:
    """A directory outside the checkout to run the child processes in."""
    global _scratch
    if _scratch is None or not os.path.isdir(_scratch):
        _scratch = tempfile.mkdtemp(prefix="ucxx-anchors-")
        atexit.register(shutil.rmtree, _scratch, True)
    return _scratch


# ------------------------------------------------------------- processes
def spawn(cmd: list[str], env: dict, stdin=subprocess.DEVNULL) -> subprocess.Popen:
    """A child in its own session (so that a timeout can end its whole
    process group), stdout and stderr piped, in :func:`scratch_dir`."""
    return subprocess.Popen(cmd, stdin=stdin, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            cwd=scratch_dir(), start_new_session=True)


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group this module started ``proc`` in."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


class Lines:
    """Reads a pipe in a thread: every line kept, each also queued for
    :meth:`wait_for`."""

    def __init__(self, pipe):
        self.lines: list[str] = []
        self.times: list[float] = []  # time.monotonic() when each line arrived
        self._q: queue.Queue = queue.Queue()
        self._t = threading.Thread(target=self._read, args=(pipe,), daemon=True)
        self._t.start()

    def _read(self, pipe) -> None:
        for line in pipe:
            self.times.append(time.monotonic())
            self.lines.append(line)
            self._q.put(line)
        self._q.put(None)

    def wait_for(self, pattern: str, timeout: float):
        """The first match of ``pattern`` in a new line; None at EOF or
        after ``timeout`` seconds."""
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                line = self._q.get(timeout=left)
            except queue.Empty:
                return None
            if line is None:
                return None
            m = rx.search(line)
            if m:
                return m

    def time_of(self, pattern: str) -> float | None:
        """When the first line matching ``pattern`` arrived."""
        rx = re.compile(pattern)
        for t, line in zip(self.times, self.lines):
            if rx.search(line):
                return t
        return None

    def text(self, join_s: float = 2.0) -> str:
        self._t.join(join_s)
        return "".join(self.lines)


class Reaped:
    """``os.wait4`` of a child in a thread: its exit status and the
    resource usage of it and of every descendant it waited for."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self.status: int | None = None
        self.cpu_s: float | None = None
        self.user_s = self.sys_s = None
        self._t = threading.Thread(target=self._wait, daemon=True)
        self._t.start()

    def _wait(self) -> None:
        _pid, status, ru = os.wait4(self.proc.pid, 0)
        self.user_s, self.sys_s = ru.ru_utime, ru.ru_stime
        self.cpu_s = ru.ru_utime + ru.ru_stime
        self.status = os.waitstatus_to_exitcode(status)
        self.proc.returncode = self.status  # reaped here, not by Popen

    def join(self, timeout: float) -> bool:
        self._t.join(timeout)
        return not self._t.is_alive()


def cpu_clock_s(pid: int) -> float | None:
    """CPU time (user + system, all threads) of process ``pid`` in seconds,
    from its process CPU-time clock (nanosecond resolution); None if it is
    gone."""
    clk = ((~pid) << 3) | 2  # the kernel's MAKE_PROCESS_CPUCLOCK(pid, CPUCLOCK_SCHED)
    try:
        return time.clock_gettime(clk)
    except OSError:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
        except (OSError, IndexError, ValueError):
            return None


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (``/proc/<pid>/task/*/children``)."""
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.append(p)
        try:
            tasks = os.listdir(f"/proc/{p}/task")
        except OSError:
            continue
        for t in tasks:
            try:
                with open(f"/proc/{p}/task/{t}/children") as f:
                    todo.extend(int(x) for x in f.read().split())
            except (OSError, ValueError):
                pass
    return out


class CpuSampler:
    """Samples, every ``interval`` seconds in a thread, the CPU time of each
    root process together with its descendants (the process set is
    re-read every ``rescan`` samples). ``rate(i, t0, t1)``: CPU-seconds
    per second of root ``i`` between the samples nearest to t0 and t1."""

    def __init__(self, interval: float = 0.02, rescan: int = 5):
        self.interval, self.rescan = interval, rescan
        self.roots: list[int] = []
        self.samples: list[tuple[float, list[float | None]]] = []
        self._trees: list[list[int]] = []
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._t = threading.Thread(target=self._run, daemon=True)
        self._t.start()

    def add(self, pid: int) -> int:
        with self._lock:
            self.roots.append(pid)
            self._trees.append([pid])
            return len(self.roots) - 1

    def _run(self) -> None:
        n = 0
        while not self._stop.wait(self.interval):
            with self._lock:
                if n % self.rescan == 0:
                    self._trees = [descendants(r) for r in self.roots]
                vals: list = []
                for tree in self._trees:
                    cs = [cpu_clock_s(p) for p in tree]
                    vals.append(None if None in cs else (sum(cs), tuple(tree)))
                self.samples.append((time.monotonic(), vals))
            n += 1

    def stop(self) -> None:
        self._stop.set()
        self._t.join(2)

    def rate(self, i: int, t0: float, t1: float) -> tuple[float, float] | None:
        """(CPU-s per s of root i, seconds covered) between the sample
        nearest to t0 and the one nearest to t1 over the same process set;
        None without two such samples."""
        pts = [(t, v[i]) for t, v in self.samples if i < len(v) and v[i] is not None]
        if len(pts) < 2:
            return None
        a = min(pts, key=lambda p: abs(p[0] - t0))
        same = [p for p in pts if p[1][1] == a[1][1]]
        b = min(same, key=lambda p: abs(p[0] - t1))
        if b[0] - a[0] <= 0:
            return None
        return (b[1][0] - a[1][0]) / (b[0] - a[0]), b[0] - a[0]

    def series(self, i: int) -> list[tuple[float, float]]:
        return [(t, v[i][0]) for t, v in self.samples if i < len(v) and v[i] is not None]


def stat_ticks_s(pid: int) -> float | None:
    """utime + stime of ``pid`` from ``/proc/<pid>/stat`` (clock ticks)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return None


# ------------------------------------------------------------ versions
_INFO = r"""
import json, sys, importlib.metadata as md
import ucxx
def ver(*names):
    for n in names:
        try:
            return n + " " + md.version(n)
        except md.PackageNotFoundError:
            pass
    return None
print(json.dumps({
    "ucxx_file": ucxx.__file__,
    "package": ver("ucxx-cu12", "ucxx-cu13", "ucxx"),
    "libucx_wheel": ver("libucx-cu12", "libucx-cu13", "libucx"),
    "ucx_runtime": ".".join(map(str, ucxx.get_ucx_version())),
    "python": sys.version.split()[0],
}))
"""


def package_info(package: str, python: str) -> dict:
    """Which ``ucxx`` the interpreter imports, its UCX and wheel versions.
    AnchorError if RAPIDS' interpreter imports this checkout's package."""
    r = subprocess.run([python, "-c", _INFO], capture_output=True, text=True,
                       env=package_env(package, None), cwd=scratch_dir(), timeout=120)
    if r.returncode != 0:
        raise AnchorError(f"{python}: cannot import ucxx:\n{r.stderr.strip()[-1500:]}")
    info = json.loads(r.stdout.strip().splitlines()[-1])
    info["python_path"] = python
    inside = os.path.realpath(info["ucxx_file"]).startswith(str(ROOT) + os.sep)
    if package == "rapids" and inside:
        raise AnchorError(f"{python} imports this checkout's ucxx ({info['ucxx_file']})")
    return info


def git_commit() -> str:
    try:
        rev = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"],
                             capture_output=True, text=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(ROOT), "status", "--porcelain",
                                "--untracked-files=no", "csrc", "ucxx"],
                               capture_output=True, text=True).stdout.strip()
        return rev + (" (csrc/ or ucxx/ modified)" if dirty else "")
    except OSError:
        return "?"


def percentile(sorted_xs: list[float], q: float) -> float:
    """The q-th percentile (0..100) of sorted values, nearest rank."""
    if not sorted_xs:
        return float("nan")
    rank = math.ceil(q / 100 * len(sorted_xs))
    return sorted_xs[max(0, min(len(sorted_xs), rank) - 1)]
