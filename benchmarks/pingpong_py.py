"""Tagged ping-pong over the ``ucxx`` package, comparable with ``ref/pingpong``.

Same transfer pattern, message flow and report as the C reference
(``benchmarks/ref/pingpong.c``): a server and a client process, connected
through a UCX listener on 127.0.0.1 with peer error handling on; the client
sends a hello (size, iteration counts), the server answers, then ``-w``
unmeasured and ``-i`` measured iterations of: client ``await send(n bytes)``,
``await recv(n bytes)``; the server receives into its buffer and sends the
same buffer back; a final FIN, then both close. The client prints exactly one
line::

    RESULT mode=blocking bytes=1 iters=10000 latency_ns=... \\
        median_latency_ns=... bandwidth_Bps=... api=core spin_us=0

with the same definitions as the reference: ``latency_ns`` is the mean half
round trip, ``median_latency_ns`` the median of the per-iteration half round
trips, ``bandwidth_Bps`` = 2 x bytes x iters / seconds. ``api`` and
``spin_us`` are appended (the reference's parser ignores unknown fields).

APIs:

``--api core``
    the extension's objects directly: ``_ucxx.Context``,
    ``_ucxx.Worker(ctx, mode, spin_us=...)``, ``worker.start(loop)``,
    ``worker.listen``, ``worker.ep_from_sockaddr``, ``ep.send/ep.recv`` on a
    fixed tag (the reference's tag values).
``--loop uvloop``
    run both sides on uvloop instead of the stdlib event loop.
``--api public``
    the public API: ``ucxx.init(progress_mode=..., spin_us=...)``,
    ``ucxx.create_listener``, ``await ucxx.create_endpoint`` (with the
    package's connection handshake), ``ep.send/ep.recv``.

Usage (the client spawns the server, like ``pingpong -f``)::

    python benchmarks/pingpong_py.py --api core --mode polling -n 1 \\
        -i 10000 -w 1000 --tls tcp --cpus 0,1 [--spin-us 50]

Library use (the suite interleaves these runs with the reference's)::

    from pingpong_py import run_py          # benchmarks/ on sys.path
    r = run_py("core", "polling", 1, iters=10000, warmup=1000, tls="tcp",
               cpus=(0, 1), spin_us=0)
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import signal
import struct
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE) not in sys.path:
    sys.path.insert(0, str(HERE))

from ref.run_ref import RefError, parse_result, parse_size, ucx_env  # noqa: E402

__all__ = ["run_py", "PyBenchError"]

# The reference's tags and hello (benchmarks/ref/pingpong.c).
TAG_DATA = 0x5050494E47000001
TAG_HELLO = 0x5050494E47000002
TAG_ACK = 0x5050494E47000003
TAG_FIN = 0x5050494E47000004
MAGIC = 0x75637878706F6E67  # "ucxxpong"
VERSION = 1
HELLO = struct.Struct("<6Q")  # magic, version, nbytes, iters, warmup, check
MAX_BYTES = 1 << 40
# Only the loopback: with UCX_TLS=tcp UCX otherwise opens lanes on every
# network interface, including short-lived ones that other programs create
# and delete (runs then change speed or fail when such an interface goes).
NET_DEVICES = "lo"
OP_TIMEOUT_S = 60.0
CONNECT_TIMEOUT_S = 10.0


class PyBenchError(RefError):
    """The Python ping-pong failed."""


# --------------------------------------------------------------------- helpers
def _pin(cpu: int | None) -> None:
    if cpu is not None and cpu >= 0:
        os.sched_setaffinity(0, {cpu})


def _die_with_parent() -> None:
    """The server ends when its client does (like the reference's
    PR_SET_PDEATHSIG)."""
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except Exception:  # pragma: no cover - not Linux
        pass


def _parse_cpus(text) -> tuple[int | None, int | None]:
    """``"0,1"`` -> (server 0, client 1); ``"0"`` -> both on 0."""
    if text is None or text == "" or text == "none":
        return None, None
    if isinstance(text, int):
        return text, text
    if not isinstance(text, str):
        vals = [int(c) for c in text]
    else:
        vals = [int(c) for c in text.split(",")]
    if len(vals) == 1:
        return vals[0], vals[0]
    if len(vals) != 2:
        raise ValueError("cpus: one CPU or SERVER_CPU,CLIENT_CPU")
    return vals[0], vals[1]


class _Core:
    """The extension's objects, no handshake: fixed tags. UCX gets the
    package's default options, as under the public API."""

    def __init__(self, mode: str, spin_us: float | None):
        from ucxx import _ucxx
        from ucxx._lib_async.application_context import effective_options

        self.U = _ucxx
        self.ctx = _ucxx.Context(effective_options())
        self.worker = _ucxx.Worker(self.ctx, mode, spin_us=spin_us)
        self.listener = None

    async def listen(self, host: str):
        loop = asyncio.get_running_loop()
        self.worker.start(loop)
        got = loop.create_future()

        def on_ep(ep):
            if not got.done():
                got.set_result(ep)

        self.listener = self.worker.listen(on_ep, 0, host)
        return self.listener.port, got

    async def connect(self, host: str, port: int):
        self.worker.start(asyncio.get_running_loop())
        return self.worker.ep_from_sockaddr(host, port)

    @staticmethod
    def setup(ep):
        ep.send_tag = ep.recv_tag = TAG_DATA
        return ep

    @staticmethod
    def ctrl_send(ep, buf, tag):
        return ep.tag_send(buf, tag)

    @staticmethod
    def ctrl_recv(ep, buf, tag):
        return ep.tag_recv(buf, tag)

    async def close(self, ep):
        try:
            await asyncio.wait_for(_awaitable(ep.close()), 5.0)
        except Exception:
            ep.abort()
        if self.listener is not None:
            self.listener.close()
        self.worker.close()
        self.ctx.close()


class _Public:
    """ucxx.init / create_listener / create_endpoint (handshake tags)."""

    def __init__(self, mode: str, spin_us: float | None):
        import ucxx

        self.ucxx = ucxx
        ucxx.init(progress_mode=mode, spin_us=spin_us)
        self.listener = None

    async def listen(self, host: str):
        loop = asyncio.get_running_loop()
        got = loop.create_future()

        def on_ep(ep):
            if not got.done():
                got.set_result(ep)

        self.listener = self.ucxx.create_listener(on_ep, port=0, host=host)
        return self.listener.port, got

    async def connect(self, host: str, port: int):
        return await self.ucxx.create_endpoint(host, port)

    @staticmethod
    def setup(ep):
        return ep

    @staticmethod
    def ctrl_send(ep, buf, tag):
        return ep.send(buf, tag=tag & 0xFF)

    @staticmethod
    def ctrl_recv(ep, buf, tag):
        return ep.recv(buf, tag=tag & 0xFF)

    async def close(self, ep):
        try:
            await asyncio.wait_for(_awaitable(ep.close()), 5.0)
        except Exception:
            ep.abort()
        if self.listener is not None:
            self.listener.close()
        self.listener = None
        try:
            self.ucxx.reset()
        except Exception:
            pass


async def _awaitable(aw):
    return await aw


def _api(name: str, mode: str, spin_us: float | None):
    if name == "core":
        return _Core(mode, spin_us)
    if name == "public":
        return _Public(mode, spin_us)
    raise ValueError(f"unknown api {name!r}")


async def _timed(aw, what: str):
    try:
        return await asyncio.wait_for(_awaitable(aw), OP_TIMEOUT_S)
    except asyncio.TimeoutError:
        raise PyBenchError(f"{what}: no completion within {OP_TIMEOUT_S} s") from None


# ---------------------------------------------------------------------- server
async def _server(args) -> int:
    api = _api(args.api, args.mode, args.spin_us)
    port, got = await api.listen(args.host)
    print(f"PORT {port}", flush=True)
    ep = api.setup(await asyncio.wait_for(got, CONNECT_TIMEOUT_S))

    hello = bytearray(HELLO.size)
    n = await _timed(api.ctrl_recv(ep, hello, TAG_HELLO), "receive hello")
    magic, version, nbytes, iters, warmup, _check = HELLO.unpack(hello)
    if (n is not None and n != HELLO.size) or magic != MAGIC or version != VERSION \
            or nbytes > MAX_BYTES:
        raise PyBenchError("bad hello from the client")
    buf = bytearray(nbytes)
    await _timed(api.ctrl_send(ep, hello, TAG_ACK), "send ack")

    send, recv = ep.send, ep.recv
    for _ in range(warmup + iters):
        await recv(buf)
        await send(buf)

    fin = bytearray(HELLO.size)
    await _timed(api.ctrl_recv(ep, fin, TAG_FIN), "receive fin")
    await api.close(ep)
    return 0


# ---------------------------------------------------------------------- client
async def _client(args, port: int) -> dict:
    api = _api(args.api, args.mode, args.spin_us)
    nbytes, iters, warmup = args.nbytes, args.iters, args.warmup
    deadline = time.monotonic() + CONNECT_TIMEOUT_S
    ep = api.setup(await api.connect(args.host, port))

    hello = bytearray(HELLO.pack(MAGIC, VERSION, nbytes, iters, warmup, int(args.check)))
    ack = bytearray(HELLO.size)
    await _timed(api.ctrl_send(ep, hello, TAG_HELLO), "send hello")
    await _timed(api.ctrl_recv(ep, ack, TAG_ACK), "receive ack")
    if bytes(ack) != bytes(hello):
        raise PyBenchError("bad ack from the server")
    del deadline

    out = bytearray(b"\xa5" * nbytes)
    inb = bytearray(nbytes)
    samples = [0] * iters
    send, recv = ep.send, ep.recv
    clock = time.perf_counter_ns
    check = args.check and nbytes > 0

    for i in range(warmup):
        await send(out)
        await recv(inb)
    t_start = t_prev = clock()
    if not check:
        for i in range(iters):
            await send(out)
            await recv(inb)
            t_now = clock()
            samples[i] = t_now - t_prev
            t_prev = t_now
    else:
        for i in range(iters):
            out[0] = i & 0xFF
            out[-1] = (i >> 8) & 0xFF
            await send(out)
            got = await recv(inb)
            t_now = clock()
            samples[i] = t_now - t_prev
            t_prev = t_now
            if (got is not None and got != nbytes) or inb != out:
                raise PyBenchError(f"iteration {i}: echoed payload differs")
    elapsed = t_prev - t_start

    await _timed(api.ctrl_send(ep, bytearray(0), TAG_FIN), "send fin")
    await api.close(ep)

    samples.sort()
    mid = iters // 2
    median = samples[mid] / 2.0 if iters % 2 else (samples[mid - 1] + samples[mid]) / 4.0
    return {
        "mode": args.mode,
        "bytes": nbytes,
        "iters": iters,
        "latency_ns": elapsed / iters / 2.0,
        "median_latency_ns": median,
        "bandwidth_Bps": 2.0 * nbytes * iters / (elapsed / 1e9) if elapsed else 0.0,
    }


def _format(r: dict, api: str, spin_us, loop: str = "asyncio") -> str:
    spin = "default" if spin_us is None else f"{spin_us:g}"
    return (
        f"RESULT mode={r['mode']} bytes={r['bytes']} iters={r['iters']} "
        f"latency_ns={r['latency_ns']:.1f} median_latency_ns={r['median_latency_ns']:.1f} "
        f"bandwidth_Bps={r['bandwidth_Bps']:.1f} api={api} spin_us={spin}"
        + ("" if loop == "asyncio" else f" loop={loop}")
    )


def _run(coro, loop_name: str):
    """asyncio.run on the stdlib loop or on uvloop's."""
    if loop_name == "uvloop":
        import uvloop

        with asyncio.Runner(loop_factory=uvloop.new_event_loop) as runner:
            return runner.run(coro)
    return asyncio.run(coro)


def server_cmd(script, role_args: list, spin_us=None, server_cpu=None) -> list:
    """The command line of a benchmark's server process."""
    cmd = [sys.executable, str(Path(script).resolve()), "--role", "server", *role_args]
    if spin_us is not None:
        cmd += ["--spin-us", repr(spin_us)]
    if server_cpu is not None:
        cmd += ["--cpus", str(server_cpu)]
    return cmd


@contextlib.contextmanager
def server_process(cmd: list):
    """Run a benchmark's server (it dies with its parent); stop it on the
    way out if it is still running."""
    server = subprocess.Popen(cmd, stdout=subprocess.PIPE, stdin=subprocess.DEVNULL,
                              text=True, preexec_fn=_die_with_parent)
    try:
        yield server
    finally:
        if server.poll() is None:
            server.terminate()
            try:
                server.wait(timeout=5)
            except subprocess.TimeoutExpired:
                server.kill()
                server.wait()


def wait_server(server) -> None:
    """The server must exit, with status 0, once the client is done."""
    try:
        status = server.wait(timeout=10)
    except subprocess.TimeoutExpired:
        raise PyBenchError("the server did not exit") from None
    if status != 0:
        raise PyBenchError(f"the server exited with status {status}")


def _read_port(proc) -> int:
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + CONNECT_TIMEOUT_S * 3
    while time.monotonic() < deadline:
        if sel.select(timeout=0.5):
            line = proc.stdout.readline()
            if not line:
                break
            if line.startswith("PORT "):
                return int(line.split()[1])
        if proc.poll() is not None:
            break
    raise PyBenchError(f"the server did not report its port (exit status {proc.poll()})")


def _main(argv=None) -> int:
    p = argparse.ArgumentParser(description="Tagged ping-pong over the ucxx package "
                                "(comparable with benchmarks/ref/pingpong).")
    p.add_argument("--api", choices=("core", "public"), default="core")
    p.add_argument("-m", "--mode", choices=("blocking", "polling", "thread", "thread-polling"),
                   default="blocking",
                   help="progress mode (thread modes: a C progress thread, no spin)")
    p.add_argument("--spin-us", type=float, default=None,
                   help="spin budget in microseconds (default: the mode's default)")
    p.add_argument("-n", "--nbytes", default="1", help="message size (K/M suffixes)")
    p.add_argument("-i", "--iters", type=int, default=10000)
    p.add_argument("-w", "--warmup", type=int, default=1000)
    p.add_argument("--tls", default=None,
                   help="UCX_TLS, or 'shm' (see ref/run_ref.py); default: the environment")
    p.add_argument("--cpus", default=None, help="pin: CPU or SERVER_CPU,CLIENT_CPU")
    p.add_argument("--net-devices", default=NET_DEVICES,
                   help="UCX_NET_DEVICES (default lo; '' leaves the environment alone)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--loop", choices=("asyncio", "uvloop"), default="asyncio",
                   help="event loop implementation (default: the stdlib's)")
    p.add_argument("-c", "--check", action="store_true", help="verify the echoed payload")
    p.add_argument("--role", choices=("client", "server"), default="client",
                   help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    args.nbytes = parse_size(args.nbytes)
    if args.iters < 1:
        p.error("--iters must be >= 1")

    os.environ.update(ucx_env(args.tls))
    if args.net_devices:
        os.environ["UCX_NET_DEVICES"] = args.net_devices
    server_cpu, client_cpu = _parse_cpus(args.cpus)

    if args.role == "server":
        _die_with_parent()
        _pin(server_cpu)
        return _run(_server(args), args.loop)

    cmd = server_cmd(__file__, ["--api", args.api, "--mode", args.mode, "--host", args.host,
                                "--loop", args.loop, "--net-devices", ""],  # env set here
                     args.spin_us, server_cpu)
    with server_process(cmd) as server:
        _pin(client_cpu)
        port = _read_port(server)
        result = _run(_client(args, port), args.loop)
        print(_format(result, args.api, args.spin_us, args.loop), flush=True)
        wait_server(server)
        return 0


def run_py(
    api: str,
    mode: str,
    nbytes: int | str,
    iters: int,
    warmup: int,
    tls: str | None,
    *,
    spin_us: float | None = None,
    cpus=None,
    env: dict[str, str] | None = None,
    check: bool = False,
    loop: str = "asyncio",
    net_devices: str = NET_DEVICES,
    timeout: float | None = 600.0,
) -> dict:
    """One measurement in fresh processes; returns the parsed RESULT line
    (keys as :func:`ref.run_ref.run_ref`, plus api, spin_us, ucx_tls, cpus)."""
    cmd = [sys.executable, str(Path(__file__).resolve()), "--api", api, "--mode", mode,
           "-n", str(parse_size(nbytes)), "-i", str(int(iters)), "-w", str(int(warmup))]
    if spin_us is not None:
        cmd += ["--spin-us", repr(float(spin_us))]
    if cpus is not None:
        s, c = _parse_cpus(cpus if isinstance(cpus, (str, int)) else list(cpus))
        if s is not None:
            cmd += ["--cpus", f"{s},{c}"]
    if check:
        cmd.append("--check")
    if loop != "asyncio":
        cmd += ["--loop", loop]
    cmd += ["--net-devices", net_devices]
    run_env = dict(os.environ)
    run_env.update(ucx_env(tls))
    if env:
        run_env.update(env)
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, env=run_env)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except BaseException:
        proc.terminate()  # the server dies with the client
        try:
            proc.communicate(timeout=5)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        if sys.exc_info()[0] is subprocess.TimeoutExpired:
            raise PyBenchError(f"{' '.join(cmd)} timed out after {timeout} s") from None
        raise
    if proc.returncode != 0:
        raise PyBenchError(
            f"{' '.join(cmd)} exited with {proc.returncode} "
            f"(UCX_TLS={run_env.get('UCX_TLS')}):\n{stderr.strip()[-3000:]}"
        )
    r = parse_result(stdout)
    r["ucx_tls"] = run_env.get("UCX_TLS")
    r["cpus"] = None if cpus is None else str(cpus)
    return r


if __name__ == "__main__":
    try:
        sys.exit(_main())
    except (RefError, ValueError) as exc:
        print(f"pingpong_py: {exc}", file=sys.stderr)
        sys.exit(1)
