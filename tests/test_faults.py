"""Injected faults: peers killed mid-traffic, network links that fail.

Two families (figures in docs/RELIABILITY.md, "Faults injected"):

- **Peer killed** (SIGKILL) at a random point of 100 echo transfers of
  random sizes, over tcp and over shared memory with error handling
  (``UCX_TLS=posix,sysv,cma,tcp`` + ``UCX_MM_ERROR_HANDLING=y``, endpoints
  by worker address so that shared memory carries the data). Every pending
  await on the dead peer's endpoint fails with a typed ``UCXError`` within
  ``KILL_BOUND_S``; a second peer is served without a hitch throughout and
  afterwards; the dead endpoint's close callback runs once. The second peer
  talks shared memory too: a shared-memory sender killed in the middle of
  writing into this worker's receive FIFO leaves a slot that blocks the
  FIFO for every other sender until the worker skips it (csrc/shm.c; a test
  stops a sender there with gdb). ``test_shm_peer_killed_uniformly``: 100
  kills at uniform random moments of transfers of 1 B to 64 MiB over shared
  memory between listener endpoints, whose peers are watched by pidfd
  (``ucxx/_lib_async/liveness.py``): every pending operation fails with a
  typed error within 1 s and a second shared-memory peer is served after
  each. ``test_shm_peer_killed_during_large_send``: a rendezvous in flight
  to a killed peer, which UCX alone never reports, fails within 1 s from
  both kinds of endpoint.
- **Network faults** between a client and a peer process, each on a host
  of a ``_netns.Network`` (tests/_netns.py: ``client eth0 --veth-- router
  --veth-- eth0 peer``, network namespaces created and removed by the
  ``netns`` fixture, skipped where ``ip netns`` does not work; nothing is
  added to the root namespace). Faults: the link taken down (on the
  router, or this side's veth), every packet dropped on the router (``tc
  netem loss 100%``, or a ``pfifo limit 0`` qdisc where netem is not built
  into the kernel), the peer frozen with SIGSTOP. Dropping on the router
  matters: a drop in a sender's *own* egress qdisc is "local congestion"
  to Linux TCP and does not count towards keepalive or user timeouts. With
  ``NET_TUNING`` (the package's defaults with a 4 s user timeout) a silent
  peer is detected within ``NET_BOUND_S``, by the client and by the peer
  (the side that accepted the connection, which UCX leaves without the
  kernel's TCP keepalive: ``test_link_down_detected_by_accepting_side``);
  after the link returns new endpoints work. A frozen peer is alive to the
  transport: nothing fails, and the traffic resumes after SIGCONT, unless
  more is sent to it than the sockets buffer: then the user timeout closes
  the connection (``test_frozen_peer_with_backlog``).

Every loop is bounded, every child process is killed and every namespace,
link and qdisc is removed even when a test fails.
"""

from __future__ import annotations

import asyncio
import hashlib
import math
import os
import random
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import pytest

import ucxx
import ucxx.core

import _netns

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)

# DECISIONS.md: a dead peer must fail pending awaits within 10 s.
KILL_BOUND_S = 10.0
# With NET_TUNING a silent peer is detected after the user timeout (UCX's
# keepalive message, sent every second, stays unacknowledged: measured
# 4.0-6.8 s); the bound leaves slack for a loaded machine. NET_TUNING is the
# package's default (DEFAULT_UCX_OPTIONS) except for a 4 s user timeout
# instead of 30 s; set explicitly, and checked against the defaults.
NET_BOUND_S = 10.0
NET_TUNING = {
    "TCP_KEEPIDLE": "inf",
    "TCP_USER_TIMEOUT": "4s",
    "KEEPALIVE_INTERVAL": "1s",
}
# Transport name -> UCX options of both processes.
FAULT_TRANSPORTS = {
    "tcp": {"TLS": "tcp"},
    "shm": {"TLS": "posix,sysv,cma,tcp", "MM_ERROR_HANDLING": "y"},
}
N_TRANSFERS = 100
MAX_SIZE = 4 << 20
MAX_SIZE_BY_TRANSPORT = {"tcp": MAX_SIZE, "shm": MAX_SIZE}


# ------------------------------------------------------------------ peer
# An echo peer using the public API. Environment: UXF_MODE (sockaddr or
# address), UXF_HOST, UXF_PARENT (the parent's worker address in hex, address
# mode), UXF_BASE (tag base). Prints "PORT n" (sockaddr) or "ADDR hex"
# (address), then echoes send_obj messages until killed.
PEER = r"""
import asyncio, os, ucxx

MODE, HOST = os.environ["UXF_MODE"], os.environ["UXF_HOST"]
PARENT, BASE = os.environ["UXF_PARENT"], int(os.environ["UXF_BASE"])

async def echo(ep, kw_in, kw_out):
    while True:
        obj = await ep.recv_obj(**kw_in)
        await ep.send_obj(obj, **kw_out)

async def main():
    eps = []
    if MODE == "sockaddr":
        async def handler(ep):
            eps.append(ep)
            try:
                await echo(ep, {}, {})
            except ucxx.UCXError as e:
                print("EPERR", type(e).__name__, flush=True)
        lst = ucxx.create_listener(handler, host=HOST)
        print("PORT", lst.port, flush=True)
    else:
        ep = await ucxx.create_endpoint_from_worker_address(bytes.fromhex(PARENT))
        eps.append(ep)
        print("ADDR", ucxx.get_worker_address().hex(), flush=True)
        asyncio.ensure_future(echo(ep, {"tag": BASE + 1, "force_tag": True},
                                   {"tag": BASE + 2, "force_tag": True}))
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def _env(opts: dict, **extra) -> dict:
    env = dict(os.environ)
    for k in list(env):
        if k.startswith("UCX_"):
            del env[k]
    for k, v in opts.items():
        env[f"UCX_{k}"] = str(v)
    env["PYTHONUNBUFFERED"] = "1"
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    env.update({k: str(v) for k, v in extra.items()})
    return env


class Remote:
    """This side of one echo peer: its process and an Endpoint to it."""

    def __init__(self, peer, ep, base: int | None):
        self.peer = peer
        self.ep = ep
        if base is None:
            self.kw_out = self.kw_in = {}
        else:
            self.kw_out = {"tag": base + 1, "force_tag": True}
            self.kw_in = {"tag": base + 2, "force_tag": True}

    async def roundtrip(self, data, errors: list | None = None) -> None:
        """Echo ``data`` through the peer. The receive is posted before the
        send and both are awaited to the end: when a fault strikes, each
        must fail on its own (a hang shows as the caller's timeout). Their
        exceptions are appended to ``errors``; the first is raised."""
        r = asyncio.ensure_future(self.ep.recv_obj(**self.kw_in))
        s = asyncio.ensure_future(self.ep.send_obj(data, **self.kw_out))
        self.inflight = {"send": s, "recv": r}
        res = await asyncio.gather(s, r, return_exceptions=True)
        excs = [x for x in res if isinstance(x, BaseException)]
        if errors is not None:
            errors.extend(excs)
        if excs:
            raise excs[0]
        got = res[1]
        assert len(got) == len(data)
        assert hashlib.blake2b(got).digest() == hashlib.blake2b(data).digest()


async def start_remote(run_peer, mode: str, opts: dict, base: int,
                       host="127.0.0.1", netns: str | None = None,
                       extra_env: dict | None = None) -> Remote:
    parent = ucxx.get_worker_address().hex() if mode == "address" else "-"
    env = _env(opts, UXF_MODE=mode, UXF_HOST=host, UXF_PARENT=parent, UXF_BASE=base,
               **(extra_env or {}))
    if netns is None:
        peer = run_peer(PEER, env=env)
    else:
        peer = _run_in_netns(netns, env)
    if mode == "sockaddr":
        port = int(await peer.expect("PORT"))
        ep = await ucxx.create_endpoint(host, port)
        return Remote(peer, ep, None)
    addr = bytes.fromhex(await peer.expect("ADDR"))
    ep = await ucxx.create_endpoint_from_worker_address(addr)
    return Remote(peer, ep, base)


def _run_in_netns(netns, env):
    """The PEER script in a child process inside network namespace netns
    (``ip netns exec`` execs it: the child's pid is the interpreter's).
    Killed by the _kill_extra_peers fixture."""
    from conftest import Peer

    proc = subprocess.Popen(
        ["ip", "netns", "exec", netns, sys.executable, "-c", textwrap.dedent(PEER)],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env,
    )
    peer = Peer(proc)
    _EXTRA_PEERS.append(peer)
    return peer


_EXTRA_PEERS: list = []


@pytest.fixture(autouse=True)
def _kill_extra_peers():
    yield
    while _EXTRA_PEERS:
        p = _EXTRA_PEERS.pop()
        try:
            os.kill(p.pid, signal.SIGCONT)
        except ProcessLookupError:
            pass
        p.close()


def sizes_for(rng: random.Random, n: int, max_size: int = MAX_SIZE) -> list[int]:
    """n sizes, log-uniform over 1 B .. max_size, a few empty messages."""
    out = []
    top = max_size.bit_length() - 1
    for _ in range(n):
        if rng.random() < 0.05:
            out.append(0)
        else:
            out.append(min(max_size, int(2 ** rng.uniform(0, top))))
    return out


def _payload(rng: random.Random, n: int):
    return np.frombuffer(rng.randbytes(min(n, 4096)) * (n // 4096 + 1), np.uint8)[:n].copy()


@pytest.fixture
def fault_transport(request):
    name = request.param
    ucxx.reset()
    ucxx.init(options=FAULT_TRANSPORTS[name])
    yield name
    ctx = ucxx.core._ctx
    if ctx is not None:
        for o in ctx.live_objects():
            o.abort() if hasattr(o, "abort") else o.close()
    ucxx.reset()


# ------------------------------------------------------------- peer killed
KILL_SEEDS = [1, 2, 3, 4]
KILL_TIMES: dict[str, list[float]] = {}


@pytest.mark.timeout(180)
@pytest.mark.parametrize("fault_transport", list(FAULT_TRANSPORTS), indirect=True)
@pytest.mark.parametrize("seed", KILL_SEEDS)
async def test_peer_killed_at_random_point(run_peer, fault_transport, seed):
    opts = FAULT_TRANSPORTS[fault_transport]
    mode = "sockaddr" if fault_transport == "tcp" else "address"
    rng = random.Random(seed)
    victim = await start_remote(run_peer, mode, opts, base=0x1000)
    survivor = await start_remote(run_peer, mode, opts, base=0x2000)
    closed = []
    victim.ep.set_close_callback(lambda: closed.append(time.monotonic()))

    max_size = MAX_SIZE_BY_TRANSPORT[fault_transport]
    sizes = sizes_for(rng, N_TRANSFERS, max_size)
    kill_at = rng.randrange(N_TRANSFERS)
    kill_delay = rng.choice([0.0, rng.uniform(0, 0.002), rng.uniform(0, 0.02)])
    loop = asyncio.get_running_loop()
    t_kill = []

    def kill():
        os.kill(victim.peer.pid, signal.SIGKILL)
        t_kill.append(time.monotonic())
        # Reap it at once: over shared memory UCX checks the peer by pid and
        # start time, and a zombie still has both (an unreaped child is
        # "alive" to UCX; a real peer is reaped by its own parent).
        victim.peer.proc.wait(5)

    # A receive that nothing will ever match: pending from start to end.
    standing = asyncio.ensure_future(victim.ep.recv(bytearray(8), tag=0xDEAD))

    pending_errors: list = []
    progress = {"transfer": -1}

    async def victim_traffic():
        # If the kill lands after a transfer completed, the next one fails;
        # if it lands after the last, small transfers go on until one fails.
        for i, n in enumerate(sizes):
            progress["transfer"] = i
            if i == kill_at:
                loop.call_later(kill_delay, kill)
            await victim.roundtrip(_payload(rng, n), pending_errors)
        for i in range(N_TRANSFERS, 100_000):
            progress["transfer"] = i
            await victim.roundtrip(_payload(rng, 1000), pending_errors)
            if t_kill and time.monotonic() - t_kill[0] > KILL_BOUND_S:
                break
            await asyncio.sleep(0.001)
        raise AssertionError("transfers still succeed after the kill")

    survivor_done = []

    async def survivor_traffic():
        # Runs alongside the victim's traffic and 20 round trips past the kill.
        srng = random.Random(seed + 1000)
        after_kill = 0
        while after_kill < 20:
            await survivor.roundtrip(_payload(srng, min(max_size, int(2 ** srng.uniform(0, 20)))))
            survivor_done.append(1)
            if t_kill:
                after_kill += 1

    vt = asyncio.ensure_future(victim_traffic())
    st = asyncio.ensure_future(survivor_traffic())
    try:
        err = None
        try:
            await asyncio.wait_for(asyncio.shield(vt), 60)
        except ucxx.UCXError as e:
            err = e
        except asyncio.TimeoutError:
            def state(t):
                if not t.done():
                    return "PENDING"
                return repr(t.exception()) if t.exception() else "done"

            inflight = {k: state(t) for k, t in victim.inflight.items()}
            i = progress["transfer"]
            raise AssertionError(
                f"victim traffic hung at transfer {i} "
                f"(size {sizes[i] if i < len(sizes) else 1000}; send_obj/recv_obj: "
                f"{inflight}); kill at {kill_at} "
                f"+{kill_delay * 1e3:.1f} ms, killed: {bool(t_kill)} "
                f"({time.monotonic() - t_kill[0] if t_kill else 0:.1f} s ago), "
                f"endpoint {victim.ep!r}, close callbacks {len(closed)}, "
                f"standing receive done: {standing.done()}") from None
        t_err = time.monotonic()
        assert t_kill, f"transfers failed before the kill: {err!r}"
        assert err is not None
        for e in pending_errors:
            assert isinstance(e, ucxx.UCXError), f"{e!r}"
            assert type(e) is not ucxx.UCXError, f"untyped error {e!r}"
        dt = t_err - t_kill[0]
        assert dt < KILL_BOUND_S, f"error {dt:.2f} s after the kill"
        # The standing receive fails too, within the same bound.
        with pytest.raises(ucxx.UCXError) as ei:
            await asyncio.wait_for(standing, KILL_BOUND_S - dt + 0.5)
        assert type(ei.value) is not ucxx.UCXError
        dt_all = time.monotonic() - t_kill[0]
        # New operations on the dead endpoint fail at once.
        t0 = time.monotonic()
        with pytest.raises(ucxx.UCXError):
            await asyncio.wait_for(victim.ep.send(b"late"), KILL_BOUND_S)
        with pytest.raises(ucxx.UCXError):
            await asyncio.wait_for(victim.ep.recv(bytearray(4), tag=7), KILL_BOUND_S)
        assert time.monotonic() - t0 < 1.0
        # Close callback: once.
        deadline = time.monotonic() + KILL_BOUND_S
        while not closed and time.monotonic() < deadline:
            await asyncio.sleep(0.01)
        assert len(closed) == 1
        # The survivor kept being served and still is.
        await asyncio.wait_for(st, 60)
        assert len(survivor_done) >= 20
        await survivor.roundtrip(b"still here")
        KILL_TIMES.setdefault(fault_transport, []).append(dt_all)
        print(f"\n[{fault_transport} seed {seed}] kill at transfer {kill_at} "
              f"(+{kill_delay * 1e3:.1f} ms): first error after {dt * 1e3:.0f} ms "
              f"({type(err).__name__}), all pending failed after {dt_all * 1e3:.0f} ms")
    finally:
        for t in (vt, st, standing):
            t.cancel()
        await asyncio.gather(vt, st, standing, return_exceptions=True)
        victim.ep.abort()
        await survivor.ep.close()
    assert len(closed) == 1  # not called again by close


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["sockaddr", "address"])
@pytest.mark.parametrize("nbytes", [
    800_000,    # eager within a host (DEFAULT_UCX_OPTIONS' RNDV_THRESH)
    9_000_000,  # rendezvous: UCX 1.22 never reports the dead peer itself
])
@pytest.mark.parametrize("fault_transport", ["shm"], indirect=True)
async def test_shm_peer_killed_during_large_send(run_peer, fault_transport, mode, nbytes):
    """Kill the echo peer right after posting a large send_obj that it
    waits for (and the receive of its echo) over shared memory: both must
    fail within 1 s. UCX alone reports a rendezvous peer never; the
    package watches the peer's pidfd (named by the handshake, or for an
    endpoint from a worker address by the FIFO UCX attached)."""
    opts = FAULT_TRANSPORTS[fault_transport]
    bound = 1.0
    for attempt in range(2):
        victim = await start_remote(run_peer, mode, opts, base=0x3000 + 16 * attempt)
        await victim.roundtrip(b"warm-up")
        recv = asyncio.ensure_future(victim.ep.recv_obj(**victim.kw_in))
        send = asyncio.ensure_future(victim.ep.send_obj(np.ones(nbytes, np.uint8),
                                                        **victim.kw_out))
        await asyncio.sleep(0)
        t0 = time.monotonic()
        os.kill(victim.peer.pid, signal.SIGKILL)
        victim.peer.proc.wait(5)
        try:
            done, pending = await asyncio.wait([recv, send], timeout=bound)
            assert not pending, (
                f"attempt {attempt}: {len(pending)} operation(s) still pending "
                f"{time.monotonic() - t0:.1f} s after the kill; {victim.ep!r}")
            # Each may have completed before the kill (an 800 KB echo takes
            # well under a millisecond); what had not fails typed.
            for t in (recv, send):
                assert t.exception() is None or (
                    isinstance(t.exception(), ucxx.UCXError)
                    and type(t.exception()) is not ucxx.UCXError), repr(t.exception())
            if nbytes > 8 << 20:  # a rendezvous takes milliseconds: the kill hits it
                assert isinstance(recv.exception(), ucxx.UCXError), repr(recv.exception())
        finally:
            for t in (recv, send):
                t.cancel()
            await asyncio.gather(recv, send, return_exceptions=True)
            victim.ep.abort()


# test_shm_peer_killed_uniformly: sizes taken in turn, kills in all, and the
# bound on every pending operation's end after a kill. The seed is drawn per
# run (printed; UCXX_KILL_SEED repeats one).
UNIFORM_SIZES = [1, 64 << 10, 1 << 20, 8 << 20, 64 << 20]
UNIFORM_KILLS = 100
UNIFORM_BOUND_S = 1.0


@pytest.mark.slow
@pytest.mark.timeout(900)
@pytest.mark.parametrize("fault_transport", ["shm"], indirect=True)
async def test_shm_peer_killed_uniformly(run_peer, fault_transport):
    """100 echo peers over shared memory (listener endpoints), each SIGKILLed
    at a moment drawn uniformly over one round trip of 1 B .. 64 MiB (our
    send, then its echo: sends and receives are both hit). Every operation
    pending at the kill ends (completes, or fails with a typed UCXError)
    within UNIFORM_BOUND_S; then a second shared-memory peer of the same
    worker completes a 64 KiB round trip."""
    opts = FAULT_TRANSPORTS[fault_transport]
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-4)
    seed = int(os.environ.get("UCXX_KILL_SEED", random.randrange(1 << 32)))
    rng = random.Random(seed)
    survivor = await start_remote(run_peer, "sockaddr", opts, base=0)
    probe = np.arange(8192, dtype=np.uint64).view(np.uint8)
    await survivor.roundtrip(probe)
    bufs = {n: np.full(n, 7, np.uint8) for n in UNIFORM_SIZES}
    following = asyncio.ensure_future(start_remote(run_peer, "sockaddr", opts, base=0))
    ends: list[float] = []
    recoveries: list[float] = []
    hit = 0  # kills with an operation pending
    problems: list[str] = []
    try:
        for k in range(UNIFORM_KILLS):
            size = UNIFORM_SIZES[k % len(UNIFORM_SIZES)]
            victim = await following
            following = (asyncio.ensure_future(start_remote(run_peer, "sockaddr", opts, base=0))
                         if k + 1 < UNIFORM_KILLS else None)
            rt = []
            for _ in range(2):  # the second is the steady state's
                t0 = time.monotonic()
                await victim.roundtrip(bufs[size])
                rt.append(time.monotonic() - t0)
            delay = rng.uniform(0, min(rt))
            # The kill comes from a thread, so that the loop goes on
            # progressing the transfer meanwhile (the GIL is handed over
            # every 100 us: see the switch interval below).
            t_kill: list[float] = []

            def kill(pid=victim.peer.pid, due=time.monotonic() + delay):
                time.sleep(max(0.0, due - time.monotonic()))
                os.kill(pid, signal.SIGKILL)
                t_kill.append(time.monotonic())

            killer = threading.Thread(target=kill)
            ops = [asyncio.ensure_future(victim.ep.recv_obj()),
                   asyncio.ensure_future(victim.ep.send_obj(bufs[size]))]
            ended: dict = {}
            for op in ops:
                op.add_done_callback(lambda f: ended.setdefault(f, time.monotonic()))
            killer.start()
            _done, pending = await asyncio.wait(ops, timeout=delay + UNIFORM_BOUND_S + 5)
            killer.join()
            hit += any(ended.get(op, math.inf) > t_kill[0] for op in ops)
            for op in ops:
                if op in pending:
                    problems.append(f"kill {k} ({size} B, +{delay * 1e3:.2f} ms): "
                                    "an operation still pending "
                                    f"{time.monotonic() - t_kill[0]:.1f} s after the kill")
                    op.cancel()
                    continue
                exc = op.exception()
                if exc is not None and (not isinstance(exc, ucxx.UCXError)
                                        or type(exc) is ucxx.UCXError):
                    problems.append(f"kill {k} ({size} B): untyped error {exc!r}")
                if ended[op] > t_kill[0]:
                    ends.append(ended[op] - t_kill[0])
            await asyncio.gather(*ops, return_exceptions=True)
            victim.peer.proc.wait(5)
            victim.ep.abort()
            t0 = time.monotonic()
            try:
                await asyncio.wait_for(survivor.roundtrip(probe), KILL_BOUND_S)
            except (asyncio.TimeoutError, ucxx.UCXError) as e:
                problems.append(f"kill {k} ({size} B): the survivor failed: {e!r}")
                break
            recoveries.append(time.monotonic() - t0)
    finally:
        sys.setswitchinterval(switch)
        if following is not None:
            following.cancel()
            await asyncio.gather(following, return_exceptions=True)
    ends.sort()
    recoveries.sort()

    def q(xs, p):
        return xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3 if xs else float("nan")

    print(f"\n[uniform kills, seed {seed}] {UNIFORM_KILLS} kills, {hit} with an operation "
          "pending; they "
          f"ended after p50 {q(ends, 0.5):.1f} / p99 {q(ends, 0.99):.1f} / max "
          f"{q(ends, 1.0):.1f} ms ({len(ends)} ends); survivor round trip after each "
          f"p50 {q(recoveries, 0.5):.1f} / max {q(recoveries, 1.0):.1f} ms; FIFO slots "
          f"skipped: {ucxx.core._get_ctx().worker.shm_slots_skipped}")
    assert not problems, "\n".join(problems)
    assert ends and ends[-1] <= UNIFORM_BOUND_S, f"seed {seed}: slowest end {ends[-1]:.3f} s"


@pytest.mark.slow
@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault_transport", ["shm"], indirect=True)
async def test_shm_peer_killed_mid_fifo_write_other_senders_served(run_peer, fault_transport):
    """Stop the victim with gdb inside its eager send to us, after UCX's
    shared-memory transport reserved the FIFO slot (``uct_mm_ep_am_bcopy``
    calls the pack callback ``ucp_eager_single_pack`` between reserving the
    slot and setting its owner flag), kill it there; a second shared-memory
    peer must still be served: the worker skips the dead sender's slot."""
    gdb = shutil.which("gdb")
    if gdb is None:
        pytest.skip("needs gdb")
    opts = FAULT_TRANSPORTS[fault_transport]
    victim = await start_remote(run_peer, "address", opts, base=0x5000)
    survivor = await start_remote(run_peer, "address", opts, base=0x6000)
    small = np.arange(1000, dtype=np.uint16).view(np.uint8)  # eager, bcopy
    await victim.roundtrip(small)
    await survivor.roundtrip(small)
    skipped = ucxx.core._get_ctx().worker.shm_slots_skipped
    dbg = subprocess.Popen(
        [gdb, "-p", str(victim.peer.pid), "-batch", "-nx",
         "-ex", "break ucp_eager_single_pack", "-ex", "continue", "-ex", "bt 4",
         "-ex", "kill"],
        stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    loop = asyncio.get_running_loop()
    lines: list[str] = []
    armed = asyncio.Event()

    def read_gdb():
        for line in dbg.stdout:
            lines.append(line)
            if line.startswith("Breakpoint 1 at"):
                loop.call_soon_threadsafe(armed.set)
    reader = loop.run_in_executor(None, read_gdb)
    echo = None
    try:
        armed_wait = asyncio.ensure_future(armed.wait())
        await asyncio.wait([armed_wait, reader], timeout=60,
                           return_when=asyncio.FIRST_COMPLETED)
        armed_wait.cancel()
        if not armed.is_set():
            pytest.skip("gdb could not set the breakpoint in the victim:\n" + "".join(lines))
        await asyncio.sleep(0.2)  # past gdb's "continue"
        echo = asyncio.ensure_future(victim.roundtrip(small))
        await asyncio.wait_for(reader, 30)
        out = "".join(lines)
        victim.peer.proc.wait(5)
        if "uct_mm_ep_am_bcopy" not in out:
            pytest.skip(f"gdb did not stop the victim in the shm FIFO write:\n{out}")
        for _ in range(5):
            await asyncio.wait_for(survivor.roundtrip(small), KILL_BOUND_S)
        assert ucxx.core._get_ctx().worker.shm_slots_skipped > skipped
    finally:
        if dbg.poll() is None:
            dbg.kill()
        dbg.wait(5)
        await asyncio.gather(reader, return_exceptions=True)
        if echo is not None:
            echo.cancel()
            await asyncio.gather(echo, return_exceptions=True)
        victim.ep.abort()
        survivor.ep.abort()


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault_transport", ["shm"], indirect=True)
async def test_shm_send_to_killed_peer_raises_typed_error(run_peer, fault_transport):
    # A send to a shared-memory peer that died (before the keepalive noticed)
    # can fail at once with UCS_ERR_SHMEM_SEGMENT (attaching the dead peer's
    # removed segment); csrc/status.c maps it to UCXConnectionResetError.
    victim = await start_remote(run_peer, "address", FAULT_TRANSPORTS["shm"], base=0x4000)
    await victim.roundtrip(b"warm-up")
    os.kill(victim.peer.pid, signal.SIGKILL)
    victim.peer.proc.wait(5)
    try:
        with pytest.raises(ucxx.UCXError) as ei:
            await asyncio.wait_for(victim.ep.send(bytes(1000), tag=0x4001, force_tag=True),
                                   KILL_BOUND_S)
        assert isinstance(ei.value, (ucxx.UCXConnectionResetError,
                                     ucxx.UCXEndpointTimeoutError)), repr(ei.value)
    finally:
        victim.ep.abort()


LISTEN_ON_PORT = r"""
import asyncio, os, ucxx
async def main():
    async def echo(ep):
        while True:
            await ep.send_obj(await ep.recv_obj())
    try:
        lst = ucxx.create_listener(echo, port=int(os.environ["UXF_PORT"]), host="127.0.0.1")
    except ucxx.UCXError as e:
        print("FAILED", type(e).__name__, flush=True)
        return
    print("LISTENING", lst.port, flush=True)
    await asyncio.sleep(3600)
asyncio.run(main())
"""


@pytest.mark.timeout(120)
@pytest.mark.parametrize("reuseaddr", ["default", "n"])
@pytest.mark.parametrize("fault_transport", ["tcp"], indirect=True)
async def test_listener_restarted_on_its_port_after_kill(run_peer, fault_transport, reuseaddr):
    """A server killed with connections open leaves them in TIME_WAIT (or
    FIN_WAIT2) on its port. With the package's default (SO_REUSEADDR,
    ``TCP_CM_REUSEADDR=y``) a new server listens on the same port at once;
    with UCX's own ``n`` it fails with UCXBusyError until they expire."""
    from conftest import free_port

    port = free_port()
    extra = {} if reuseaddr == "default" else {"UCX_TCP_CM_REUSEADDR": reuseaddr}
    env = _env(FAULT_TRANSPORTS["tcp"], UXF_PORT=port, **extra)
    first = run_peer(LISTEN_ON_PORT, env=env)
    assert await first.expect("LISTENING") == str(port)
    ep = await ucxx.create_endpoint("127.0.0.1", port)
    await ep.send_obj(b"ping")
    assert bytes(await ep.recv_obj()) == b"ping"
    os.kill(first.pid, signal.SIGKILL)
    first.proc.wait(5)
    with pytest.raises(ucxx.UCXError):
        await asyncio.wait_for(ep.recv_obj(), KILL_BOUND_S)
    ep.abort()
    if shutil.which("ss"):
        lingering = subprocess.run(["ss", "-tanH", f"sport = :{port}"], capture_output=True,
                                   text=True).stdout
        assert "TIME-WAIT" in lingering or "FIN-WAIT" in lingering, lingering
    second = run_peer(LISTEN_ON_PORT, env=env)
    line = await second.expect("")
    if reuseaddr == "default":
        assert line == f"LISTENING {port}", line
        ep2 = await ucxx.create_endpoint("127.0.0.1", port)
        await ep2.send_obj(b"again")
        assert bytes(await ep2.recv_obj()) == b"again"
        await ep2.close()
    else:
        assert line == "FAILED UCXBusyError", line


@pytest.mark.timeout(120)
@pytest.mark.parametrize("fault_transport", ["tcp"], indirect=True)
async def test_listener_keeps_serving_after_client_killed(run_peer, fault_transport):
    """This process is the server: a client killed mid-transfer fails the
    server's pending operations; the listener accepts new clients."""
    accepted: asyncio.Queue = asyncio.Queue()
    lst = ucxx.create_listener(accepted.put_nowait, host="127.0.0.1")
    client = r"""
import asyncio, os, ucxx
async def main():
    ep = await ucxx.create_endpoint("127.0.0.1", int(os.environ["UXF_PORT"]))
    print("CONNECTED", flush=True)
    while True:
        obj = await ep.recv_obj()
        await ep.send_obj(obj)
asyncio.run(main())
"""
    env = _env(FAULT_TRANSPORTS["tcp"], UXF_PORT=lst.port)
    try:
        for round_ in range(3):
            peer = run_peer(client, env=env)
            await peer.expect("CONNECTED")
            sep = await asyncio.wait_for(accepted.get(), 30)
            data = np.arange(1 << 20, dtype=np.uint8)
            await sep.send_obj(data)
            assert bytes(await sep.recv_obj()) == data.tobytes()
            if round_ == 2:
                await sep.close()
                break
            pending = asyncio.ensure_future(sep.recv_obj())
            await asyncio.sleep(0.05)
            t0 = time.monotonic()
            os.kill(peer.pid, signal.SIGKILL)
            peer.proc.wait(5)
            with pytest.raises(ucxx.UCXError) as ei:
                await asyncio.wait_for(pending, KILL_BOUND_S)
            assert type(ei.value) is not ucxx.UCXError
            assert time.monotonic() - t0 < KILL_BOUND_S
            sep.abort()
    finally:
        lst.close()


# ------------------------------------------------- peer frozen with a backlog
BACKLOG_SENDS = 10_000  # x 4 KiB eager sends: far more than the sockets buffer


@pytest.mark.timeout(120)
@pytest.mark.parametrize("user_timeout", ["4s", "default", "auto"])
async def test_frozen_peer_with_backlog(run_peer, user_timeout):
    """A peer that reads nothing (frozen with SIGSTOP; a receiver whose event
    loop is blocked does the same) while more is sent to it than the sockets
    buffer: its kernel keeps acknowledging, with a zero receive window.
    Linux applies TCP_USER_TIMEOUT to a window that stays closed: with a
    4 s user timeout the connection is closed and the sends fail with a
    typed UCXError; with the package's default (30 s) and with
    TCP_USER_TIMEOUT=auto an 8 s stall is harmless and every send completes
    after SIGCONT (docs/DECISIONS.md)."""
    opts = dict(FAULT_TRANSPORTS["tcp"])
    if user_timeout != "default":
        opts["TCP_USER_TIMEOUT"] = user_timeout
    ucxx.reset()
    ucxx.init(options=opts)
    try:
        remote = await start_remote(run_peer, "sockaddr", opts, base=0)
        closed = []
        remote.ep.set_close_callback(lambda: closed.append(time.monotonic()))
        await remote.roundtrip(np.arange(1 << 16, dtype=np.uint8))
        os.kill(remote.peer.pid, signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            sends = [asyncio.ensure_future(remote.ep.send(bytes(4096), tag=0x5000 + i))
                     for i in range(BACKLOG_SENDS)]
            await asyncio.sleep(1.0)
            stuck = [s for s in sends if not s.done()]
            assert stuck, "every send completed: the backlog did not fill the buffers"
            if user_timeout == "4s":
                done, _ = await asyncio.wait(stuck, timeout=NET_BOUND_S)
                dt = time.monotonic() - t0
                assert len(done) == len(stuck), (
                    f"{len(stuck) - len(done)} sends still pending {NET_BOUND_S} s after the "
                    f"peer froze")
                errors = {type(s.exception()) for s in stuck}
                assert all(issubclass(e, ucxx.UCXError) and e is not ucxx.UCXError
                           for e in errors), errors
                assert len(closed) == 1 and not remote.ep.alive
                print(f"\nfrozen peer with a backlog, 4 s user timeout: {len(stuck)} sends "
                      f"failed after {dt:.2f} s ({sorted(e.__name__ for e in errors)})")
            else:
                await asyncio.sleep(8.0)  # twice the 4 s user timeout
                assert not any(s.done() for s in stuck) and closed == [] and remote.ep.alive
        finally:
            os.kill(remote.peer.pid, signal.SIGCONT)
        if user_timeout != "4s":
            await asyncio.wait_for(asyncio.gather(*sends), 30)
            await remote.roundtrip(np.arange(1 << 16, dtype=np.uint8))
            assert closed == [] and remote.ep.alive
        remote.ep.abort()
    finally:
        ctx = ucxx.core._ctx
        if ctx is not None:
            for o in ctx.live_objects():
                o.abort() if hasattr(o, "abort") else o.close()
        ucxx.reset()


# ------------------------------------------------------------ network faults
# The client and the peer are hosts of a _netns.Network ("client", "peer"):
# client eth0 --veth-- router --veth-- eth0 peer.


def _link(net, where: str, state: str) -> None:
    """Take down (or up) the router's link to the peer ("router") or the
    client's own link ("local")."""
    if where == "router":
        net.link("peer", state, side="router")
    else:
        net.link("client", state, side="host")


@pytest.fixture
def netns():
    why = _netns.unavailable()
    if why:
        pytest.skip(why)
    with _netns.Network(("client", "peer")) as net:
        yield net
    assert not net.leftovers()


# UCX reads the routing table once per process (ucs_netlink route cache,
# keyed by interface index) and never again: links and routes created after
# a process's first UCX connection are invisible to it ("no route to ...",
# UCXUnreachableError). So the client side of every network test is a fresh
# child process (CLIENT) in the client namespace, started after the
# namespaces exist and driven over stdin/stdout; it reports CLOCK_MONOTONIC
# times, which this process compares with the time it injected the fault.
CLIENT = r"""
import asyncio, json, os, sys, time
import numpy as np
import ucxx

def say(*words):
    print("@@", *words, flush=True)

class Stdin:
    def __init__(self):
        self.buf = b""
    async def readline(self):
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buf:
            fut = loop.create_future()
            loop.add_reader(0, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(0)
            chunk = os.read(0, 4096)
            if not chunk:
                raise EOFError
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode().split()

async def roundtrip(ep, n):
    data = np.arange(n, dtype=np.uint64).view(np.uint8)[:n] if n else b""
    r = asyncio.ensure_future(ep.recv_obj())
    s = asyncio.ensure_future(ep.send_obj(data))
    res = await asyncio.gather(s, r, return_exceptions=True)
    for x in res:
        if isinstance(x, BaseException):
            raise x
    assert bytes(res[1]) == bytes(data)

async def main():
    host, port = os.environ["UXF_PEER"], int(os.environ["UXF_PORT"])
    stdin = Stdin()
    ep = None
    pending = {}
    failed = {}
    closed = []

    def done(name, t):
        e = t.exception() if not t.cancelled() else None
        failed[name] = (type(e).__name__ if e else None, time.monotonic(),
                        isinstance(e, ucxx.UCXError))
    while True:
        cmd = await stdin.readline()
        if cmd[0] == "connect":
            ep = await ucxx.create_endpoint(host, port)
            ep.set_close_callback(lambda: closed.append(time.monotonic()))
            for n in (0, 1, 1000, 100_000, 1 << 20):
                await roundtrip(ep, n)
            say("RESULT", json.dumps({}))
        elif cmd[0] == "pending":
            pending["recv"] = asyncio.ensure_future(ep.recv(bytearray(16), tag=0xBEEF))
            if cmd[1] == "active":
                pending["transfer"] = asyncio.ensure_future(roundtrip(ep, int(cmd[2])))
            for name, t in pending.items():
                t.add_done_callback(lambda t, name=name: done(name, t))
            await asyncio.sleep(0.02)
            say("RESULT", json.dumps({}))
        elif cmd[0] == "late_send":
            # a send posted after the fault: its data stays unacknowledged
            t = asyncio.ensure_future(ep.send(bytes(1024), tag=0xCAFE))
            pending["late_send"] = t
            t.add_done_callback(lambda t: done("late_send", t))
            say("RESULT", json.dumps({}))
        elif cmd[0] == "wait":
            # wait up to cmd[1] s for every pending operation to end
            deadline = time.monotonic() + float(cmd[1])
            while len(failed) < len(pending) and time.monotonic() < deadline:
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            late = None
            if len(failed) == len(pending):
                try:
                    await ep.send(b"late")
                except ucxx.UCXError as e:
                    late = type(e).__name__
            say("RESULT", json.dumps({"failed": failed, "pending": len(pending),
                                      "closed": closed, "alive": ep.alive,
                                      "late_send": late}))
        elif cmd[0] == "resume":
            # the in-flight transfer must now complete, and more after it
            await asyncio.wait_for(pending["transfer"], float(cmd[1]))
            for n in (1, 1 << 20):
                await roundtrip(ep, n)
            pending["recv"].cancel()
            await asyncio.gather(pending["recv"], return_exceptions=True)
            say("RESULT", json.dumps({"closed": closed, "alive": ep.alive}))
        elif cmd[0] == "recover":
            # a new endpoint to the same peer, retried until cmd[1] s passed
            deadline = time.monotonic() + float(cmd[1])
            tries = 0
            while True:
                tries += 1
                try:
                    ep2 = await ucxx.create_endpoint(host, port, connect_timeout=2)
                    await roundtrip(ep2, 4 << 20)
                    break
                except ucxx.UCXError:
                    if time.monotonic() > deadline:
                        raise
                    await asyncio.sleep(0.2)
            await ep2.close()
            say("RESULT", json.dumps({"tries": tries}))
        elif cmd[0] == "quit":
            for t in pending.values():
                t.cancel()
            await asyncio.gather(*pending.values(), return_exceptions=True)
            if ep is not None:
                ep.abort()
            say("RESULT", json.dumps({}))
            return

try:
    asyncio.run(main())
except BaseException as e:
    import traceback
    say("FAIL", repr(e), traceback.format_exc().replace("\n", " | "))
    sys.exit(1)
"""


class Client:
    """The CLIENT script in a fresh child process in the client namespace."""

    def __init__(self, net: _netns.Network, port: int, tuning: dict):
        self.net = net
        opts = {"TLS": "tcp", "NET_DEVICES": net["client"].ifname, **tuning}
        env = _env(opts, UXF_PEER=net["peer"].ip, UXF_PORT=port)
        self.proc = subprocess.Popen(
            ["ip", "netns", "exec", net["client"].ns, sys.executable, "-c", CLIENT],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env)
        from conftest import Peer

        self.peer = Peer(self.proc)
        _EXTRA_PEERS.append(self.peer)

    async def call(self, *words, timeout: float = 60.0) -> dict:
        import json

        self.proc.stdin.write((" ".join(str(w) for w in words) + "\n").encode())
        self.proc.stdin.flush()
        deadline = time.monotonic() + timeout
        while True:
            line = await self.peer.readline(max(0.1, deadline - time.monotonic()))
            if line.startswith("@@ FAIL"):
                raise AssertionError(f"client failed on {words}: {line}")
            if line.startswith("@@ RESULT"):
                return json.loads(line[len("@@ RESULT"):])


@pytest.fixture
def net_peer(netns):
    """``start(tuning=NET_TUNING) -> (peer, port)``: the echo peer in the
    peer namespace, UCX over tcp on its veth only."""

    async def start(tuning=NET_TUNING):
        opts = {"TLS": "tcp", "NET_DEVICES": netns["peer"].ifname, **tuning}
        env = _env(opts, UXF_MODE="sockaddr", UXF_HOST=netns["peer"].ip, UXF_PARENT="-",
                   UXF_BASE=0)
        peer = _run_in_netns(netns["peer"].ns, env)
        port = int(await peer.expect("PORT"))
        return peer, port

    return start


ACTIVE_BYTES = 64 << 20
NET_TIMES: dict[str, float] = {}


async def _fault_scenario(net, start_peer, inject, activity, bound, tuning=NET_TUNING,
                          undo=None, recover=True) -> float:
    """Connect, leave operations pending (a receive; with activity "active"
    also a 64 MiB echo in flight; with "late-send" also a 1 KiB send posted
    right after the fault, whose data the kernel can only retransmit),
    inject the fault, check that every pending operation fails with a typed
    UCXError within ``bound`` and the close callback runs once; undo the
    fault; a new endpoint then works.
    Returns the seconds from the fault to the last failure."""
    peer, port = await start_peer(tuning)
    client = Client(net, port, tuning)
    await client.call("connect")
    await client.call("pending", activity, ACTIVE_BYTES)
    t0 = time.monotonic()
    inject()
    if activity == "late-send":
        await client.call("late_send")
    try:
        res = await client.call("wait", bound, timeout=bound + 30)
    finally:
        if undo is not None:
            undo()
    failed = res["failed"]
    if len(failed) != res["pending"]:
        sockets = net["client"].sh("ss", "-tinoe", check=False).stdout
        raise AssertionError(
            f"{res['pending'] - len(failed)} operation(s) still pending {bound} s after "
            f"the fault: {res}; this side's sockets:\n{sockets}")
    for name, (etype, _t, is_ucx) in failed.items():
        if name == "late_send" and etype is None:
            continue  # an eager send completes once the kernel has its data
        assert is_ucx and etype != "UCXError", f"{name}: {etype}"
    dt = max(t for _e, t, _u in failed.values()) - t0
    assert dt < bound
    assert len(res["closed"]) == 1, res
    assert res["late_send"] is not None, "a send on the failed endpoint did not raise"
    if recover:
        await client.call("recover", 30)
    await client.call("quit")
    print(f" [errors: {sorted({e for e, _t, _u in failed.values() if e})}]", end="")
    return dt


@pytest.mark.timeout(120)
@pytest.mark.parametrize("activity", ["active", "idle", "late-send"])
@pytest.mark.parametrize("where", ["router", "local"])
async def test_link_down(netns, net_peer, where, activity):
    net = netns
    dt = await _fault_scenario(net, net_peer, lambda: _link(net, where, "down"), activity,
                               NET_BOUND_S, undo=lambda: _link(net, where, "up"))
    NET_TIMES[f"link down ({where}, {activity})"] = dt
    print(f"\nlink down ({where}, {activity}): all pending failed after {dt:.2f} s")


@pytest.mark.timeout(120)
async def test_link_down_detected_by_accepting_side(netns, net_peer):
    """The peer accepted the client's connection (and, having the higher
    address, UCX's data connection too: UCX enables the kernel's TCP
    keepalive only on sockets it connects). When the client's link goes
    down while the connection is idle, the peer's endpoint must fail within
    the same bound: UCX's own keepalive messages (the package's default)
    run on both sides."""
    net = netns
    peer, port = await net_peer()
    client = Client(net, port, NET_TUNING)
    await client.call("connect")
    t0 = time.monotonic()
    _link(net, "local", "down")
    try:
        err = await peer.expect("EPERR", timeout=NET_BOUND_S + 5)
        dt = time.monotonic() - t0
    finally:
        _link(net, "local", "up")
    assert err.startswith("UCX") and err != "UCXError", err
    assert dt < NET_BOUND_S, f"the accepting side noticed the silent client after {dt:.1f} s"
    NET_TIMES["link down (local, idle), accepting side"] = dt
    print(f"\nlink down (local, idle): the accepting side failed after {dt:.2f} s ({err})")
    await client.call("quit")


@pytest.mark.timeout(120)
@pytest.mark.parametrize("activity", ["active", "idle", "late-send"])
async def test_packets_dropped(netns, net_peer, activity):
    net = netns
    dt = await _fault_scenario(net, net_peer, net.drop_all, activity, NET_BOUND_S,
                               undo=net.undrop)
    NET_TIMES[f"100% loss ({net.drop_kind}, {activity})"] = dt
    print(f"\n100% loss via {net.drop_kind} ({activity}): all pending failed after {dt:.2f} s")


def test_fault_tests_run_the_package_defaults_with_a_shorter_user_timeout():
    """The link, loss and freeze tests above run NET_TUNING: the package's
    defaults (docs/DECISIONS.md) but for a TCP user timeout of 4 s instead of
    30 s, so that each bound is met in seconds. With the package's own 30 s,
    the same scenarios fail pending awaits after about 30 s (a silent idle
    host, or a link that went down with data unacknowledged: measured
    31.6-33.4 s); tests/test_api.py checks that UCX takes the 30 s."""
    from ucxx._lib_async.application_context import DEFAULT_UCX_OPTIONS

    for name, value in NET_TUNING.items():
        expected = "30s" if name == "TCP_USER_TIMEOUT" else value
        assert DEFAULT_UCX_OPTIONS[name] == expected, name


@pytest.mark.timeout(120)
async def test_peer_frozen_sigstop(netns, net_peer):
    """A stopped process is alive to the transport (its kernel still answers
    TCP keepalive probes): nothing fails while it is frozen (three times the
    keepalive bound), and after SIGCONT the transfer that was in flight
    completes and the endpoint keeps working."""
    net = netns
    peer, port = await net_peer()
    client = Client(net, port, NET_TUNING)
    await client.call("connect")
    os.kill(peer.pid, signal.SIGSTOP)
    try:
        await client.call("pending", "active", 8 << 20)
        res = await client.call("wait", 12, timeout=60)
        assert res["failed"] == {} and res["closed"] == [] and res["alive"], res
    finally:
        os.kill(peer.pid, signal.SIGCONT)
    res = await client.call("resume", 30)
    assert res["closed"] == [] and res["alive"], res
    await client.call("quit")
