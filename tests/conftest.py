"""Shared fixtures for the ucxx tests.

- ``check_leaks``: after a test, asserts that no asyncio task, Python thread
  or file descriptor was left behind. The global UCX context is created
  *before* the baseline is taken (its worker's fds persist), so only what
  the test itself opened counts. Tests that must start without a context use
  ``@pytest.mark.no_ctx``. It is autouse but acts only on tests marked
  ``leak_check`` (a module opts in with
  ``pytestmark = pytest.mark.leak_check``), so suites with their own
  contexts and leak checks are left alone.
- ``transport``: parametrises a test over the UCX transports of this
  machine; for a single-process test the fixture re-initialises UCX with
  ``UCX_TLS`` set accordingly; for a two-process test ``child_env`` gives
  the environment for the peer process (UCX configuration is per process).
- ``run_peer``: starts a Python child process running a script and reads
  lines from its stdout.
"""

from __future__ import annotations

import asyncio
import gc
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

import ucxx
import ucxx.core

# name -> UCX_TLS value
TRANSPORTS = {
    "tcp": "tcp",
    "shm": "posix,sysv,cma,tcp",
}

LEAK_WAIT_S = 5.0
DEFAULT_TIMEOUT = 60


def pytest_configure(config):
    config.addinivalue_line("markers", "no_ctx: start the test without a UCX context")
    config.addinivalue_line(
        "markers", "leak_check: check for leaked tasks, threads and fds after the test"
    )
    config.addinivalue_line("markers", "slow: long-running test")
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU")


if os.environ.get("UCXX_TEST_EVENT_LOOP", "asyncio") == "uvloop":

    def pytest_asyncio_loop_factories(config, item):
        """``UCXX_TEST_EVENT_LOOP=uvloop``: every asyncio test runs under
        uvloop (CI's second pass)."""
        import uvloop

        return {"uvloop": uvloop.new_event_loop}


def pytest_report_header(config):
    return f"event loop: {os.environ.get('UCXX_TEST_EVENT_LOOP', 'asyncio')}"


def pytest_collection_modifyitems(config, items):
    # Every test gets a timeout, even when run without the project's config.
    for item in items:
        if item.get_closest_marker("timeout") is None:
            item.add_marker(pytest.mark.timeout(DEFAULT_TIMEOUT))


# ------------------------------------------------------------------ helpers
def tls_options(name: str) -> dict:
    return {"TLS": TRANSPORTS[name]}


def child_env(transport: str | None = None, **extra) -> dict:
    """Environment for a peer process using ``transport``."""
    env = dict(os.environ)
    if transport is not None:
        env["UCX_TLS"] = TRANSPORTS[transport]
    env.setdefault("PYTHONUNBUFFERED", "1")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env["PYTHONPATH"] = root + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


def free_port() -> int:
    """A TCP port nobody listens on (now)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def _fd_table() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def _is_progress_task(task) -> bool:
    coro = task.get_coro()
    names = (
        type(coro).__name__,
        getattr(coro, "__qualname__", "") or "",
        task.get_name() or "",
    )
    return any("rogress" in n for n in names)


def _progress_worker():
    ctx = ucxx.core._ctx
    if ctx is None:
        return
    try:
        ctx.worker.progress()
    except Exception:
        pass


_warmed = None


async def _warm_up_uvloop() -> None:
    """uvloop creates some fds of its own on first use of a TCP server (they
    live as long as the loop): create them before the baseline."""
    loop = asyncio.get_running_loop()
    if type(loop).__module__.split(".")[0] != "uvloop" or getattr(loop, "_ucxx_warm", False):
        return
    server = await asyncio.start_server(lambda r, w: w.close(), "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    _, w = await asyncio.open_connection("127.0.0.1", port)
    w.close()
    await w.wait_closed()
    server.close()
    await server.wait_closed()
    try:
        loop._ucxx_warm = True
    except AttributeError:
        pass


async def _warm_up(ctx) -> None:
    """Make the worker create its lazily created fds (e.g. the keepalive
    timerfd, on the first endpoint) before a test takes its baseline."""
    global _warmed
    await _warm_up_uvloop()
    if _warmed is not None and _warmed() is ctx:
        return
    import weakref

    c_ep = ctx.worker.ep_from_address(ctx.worker.address)
    c_ep.abort()
    del c_ep
    for _ in range(3):
        ctx.worker.progress()
        await asyncio.sleep(0)
    _warmed = weakref.ref(ctx)


# ------------------------------------------------------------------ fixtures
@pytest.fixture(params=list(TRANSPORTS))
def transport(request) -> str:
    """Transport name (``tcp``/``shm``, see TRANSPORTS). The global context
    is re-created with that ``UCX_TLS`` for the test, and reset after it.
    Two-process tests pass ``child_env(transport)`` to the peer."""
    ucxx.reset()
    ucxx.init(options=tls_options(request.param))
    yield request.param
    ucxx.reset()


@pytest.fixture(autouse=True)
async def check_leaks(request):
    if request.node.get_closest_marker("leak_check") is None:
        yield
        return
    loop = asyncio.get_running_loop()
    # Bring UCX to the state the test wants, *then* take the baseline.
    if "transport" in request.fixturenames:
        request.getfixturevalue("transport")  # (re)initialises the context
        ucxx.core._get_ctx().continuous_ucx_progress(loop)
        await _warm_up(ucxx.core._ctx)
    elif request.node.get_closest_marker("no_ctx") is not None:
        ucxx.reset()
    else:
        ucxx.core._get_ctx().continuous_ucx_progress(loop)
        await _warm_up(ucxx.core._ctx)
    gc.collect()
    fds_before = _fd_count()
    fd_table_before = _fd_table()
    threads_before = set(threading.enumerate())
    tasks_before = set(asyncio.all_tasks(loop))

    yield

    reset_needed = (
        "transport" in request.fixturenames
        or request.node.get_closest_marker("no_ctx") is not None
    )
    me = asyncio.current_task()

    def leftover_tasks():
        return [
            t
            for t in asyncio.all_tasks(loop)
            if t is not me and t not in tasks_before and not t.done()
            and not _is_progress_task(t)
        ]

    deadline = time.monotonic() + LEAK_WAIT_S
    while leftover_tasks() and time.monotonic() < deadline:
        await asyncio.sleep(0.01)
    tasks = leftover_tasks()

    problems = []
    if tasks:
        problems.append(f"leaked asyncio tasks: {tasks}")

    if reset_needed:
        try:
            ucxx.reset()
        except ucxx.UCXError as e:
            problems.append(f"reset() failed after the test: {e}")
            ctx = ucxx.core._ctx
            ucxx.core._ctx = None
            for o in ctx.live_objects():
                if hasattr(o, "abort"):
                    o.abort()
                else:
                    o.close()
            ctx.close()

    deadline = time.monotonic() + LEAK_WAIT_S
    while time.monotonic() < deadline:
        gc.collect()
        _progress_worker()
        if _fd_count() <= fds_before:
            break
        await asyncio.sleep(0.02)
    fds_after = _fd_count()
    if fds_after > fds_before:
        table = _fd_table()
        new = {fd: t for fd, t in table.items() if fd_table_before.get(fd) != t}
        problems.append(f"leaked fds: {fds_before} before, {fds_after} after; new: {new}")

    deadline = time.monotonic() + LEAK_WAIT_S
    while time.monotonic() < deadline:
        extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
        if not extra:
            break
        await asyncio.sleep(0.02)
    extra = [t for t in threading.enumerate() if t not in threads_before and t.is_alive()]
    if extra:
        problems.append(f"leaked threads: {extra}")

    if problems:
        pytest.fail("; ".join(problems), pytrace=False)


class Peer:
    """A child Python process; ``readline()`` reads its stdout."""

    def __init__(self, proc: subprocess.Popen):
        self.proc = proc
        self._buf = b""

    @property
    def pid(self) -> int:
        return self.proc.pid

    async def readline(self, timeout: float = 30.0) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"peer said nothing within {timeout}s; stderr: {self.stderr()}")
            fut = loop.create_future()
            loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"peer said nothing within {timeout}s; stderr: {self.stderr()}"
                ) from None
            finally:
                loop.remove_reader(fd)
            chunk = os.read(fd, 4096)
            if not chunk:
                raise EOFError(f"peer exited (rc={self.proc.wait()}); stderr: {self.stderr()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        return line.decode().strip()

    async def expect(self, prefix: str, timeout: float = 30.0) -> str:
        """Next line that is not a UCX log line (UCX logs to stdout)."""
        line = await self.readline(timeout)
        while " UCX " in line and line.startswith("["):
            line = await self.readline(timeout)
        assert line.startswith(prefix), f"expected {prefix!r} from the peer, got {line!r}"
        return line[len(prefix):].strip()

    def stderr(self) -> str:
        if self.proc.poll() is None:
            return "<running>"
        try:
            return self.proc.stderr.read().decode(errors="replace")[-4000:]
        except Exception:
            return "<unavailable>"

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()

    async def wait(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None:
            if time.monotonic() > deadline:
                raise TimeoutError("peer did not exit")
            await asyncio.sleep(0.02)
        return self.proc.returncode

    def close(self) -> None:
        self.kill()
        try:
            self.proc.wait(10)
        except subprocess.TimeoutExpired:  # pragma: no cover
            pass
        for f in (self.proc.stdout, self.proc.stderr, self.proc.stdin):
            if f is not None:
                f.close()


@pytest.fixture
def run_peer():
    """``run_peer(script, env=None) -> Peer``: run ``script`` (dedented) in
    a child Python process; every child is killed at the end of the test."""
    peers: list[Peer] = []

    def start(script: str, env: dict | None = None) -> Peer:
        proc = subprocess.Popen(
            [sys.executable, "-c", textwrap.dedent(script)],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            env=env if env is not None else child_env(),
        )
        peer = Peer(proc)
        peers.append(peer)
        return peer

    yield start
    for p in peers:
        p.close()
