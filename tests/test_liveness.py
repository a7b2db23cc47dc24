"""Same-host liveness (ucxx/_lib_async/liveness.py): the identity block of
the handshake, the pidfd watch, and endpoints failing when the peer process
exits. The kill tests over shared memory are in test_faults.py."""

import asyncio
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

import ucxx
import ucxx.core
from ucxx._lib_async import liveness
from conftest import child_env

HOST = "127.0.0.1"


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def _block(pid: int, start: int, host: bytes) -> bytes:
    body = liveness._IDENT_BODY.pack(liveness.IDENT_MAGIC, pid, start, host)
    return body + liveness._checksum(body)


def test_own_identity_names_this_process():
    pid, start = liveness.peer_pid(liveness.identity())
    assert pid == os.getpid()
    assert start == liveness._start_time(os.getpid()) > 0


def test_identity_of_another_host_or_unknown_host_is_not_trusted():
    start = liveness._start_time(os.getpid())
    assert liveness.peer_pid(_block(os.getpid(), start, b"otherhst")) is None
    assert liveness.peer_pid(_block(os.getpid(), start, bytes(8))) is None
    assert liveness.peer_pid(_block(0, start, liveness._own()[1])) is None


@pytest.mark.parametrize("damage", ["magic", "checksum"])
def test_malformed_identity_raises(damage):
    block = bytearray(liveness.identity())
    block[0 if damage == "magic" else 31] ^= 0xFF
    with pytest.raises(ValueError, match=damage):
        liveness.peer_pid(bytes(block))


async def test_watch_reports_exit_of_a_process():
    proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    loop = asyncio.get_running_loop()
    exited = asyncio.Event()
    try:
        start = None
        for _ in range(100):  # /proc/<pid>/stat exists from the fork on
            start = liveness._start_time(proc.pid)
            if start:
                break
            time.sleep(0.01)
        fd = liveness.watch(loop, proc.pid, start, exited.set)
        assert fd is not None
        await asyncio.sleep(0.05)
        assert not exited.is_set()
        t0 = time.monotonic()
        os.kill(proc.pid, signal.SIGKILL)  # not reaped: a zombie has exited too
        await asyncio.wait_for(exited.wait(), 5)
        assert time.monotonic() - t0 < 1.0
        liveness.unwatch(loop, fd)
    finally:
        proc.kill()
        proc.wait()


async def test_watch_of_a_gone_or_reused_pid_reports_exit_at_once():
    loop = asyncio.get_running_loop()
    calls = []
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert liveness.watch(loop, proc.pid, 1, lambda: calls.append("gone")) is None
    # Our own pid with another start time: the pid was reused.
    start = liveness._start_time(os.getpid())
    assert liveness.watch(loop, os.getpid(), start + 1, lambda: calls.append("reused")) is None
    assert calls == ["gone", "reused"]


async def _watched_pair_closed():
    """Connect to our own listener: both ends watch this process; close:
    both watches end."""
    accepted = []
    lst = ucxx.create_listener(accepted.append, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    for _ in range(100):
        if accepted:
            break
        await asyncio.sleep(0.01)
    assert ep._state.pidfd is not None and accepted[0]._state.pidfd is not None
    assert ep.transports and all(len(t) == 2 for t in ep.transports)
    await ep.close()
    for _ in range(100):  # the close callbacks run from the loop
        if ep._state.pidfd is None and accepted[0]._state.pidfd is None:
            break
        await asyncio.sleep(0.01)
    assert ep._state.pidfd is None and accepted[0]._state.pidfd is None
    assert ep.transports == ()
    lst.close()
    del accepted[:]
    await asyncio.sleep(0.05)


async def test_listener_endpoints_watch_the_peer_and_close_the_pidfd():
    await _watched_pair_closed()  # UCX opens a timer fd on the first connection
    fds = _fds()
    for _ in range(3):
        await _watched_pair_closed()
    assert _fds() <= fds


async def test_peer_exited_fails_pending_operations_typed():
    accepted = []  # kept: a dropped endpoint closes, which would cancel the receive
    lst = ucxx.create_listener(accepted.append, host=HOST)
    ep = await ucxx.create_endpoint(HOST, lst.port)
    recv = asyncio.ensure_future(ep.recv(bytearray(8), tag=1))
    await asyncio.sleep(0)
    ep._peer_exited()
    ep._peer_exited()  # idempotent
    with pytest.raises(ucxx.UCXConnectionResetError):
        await asyncio.wait_for(recv, 5)
    assert not ep.alive
    ep.abort()
    lst.close()


PEER = r"""
import asyncio, ucxx

async def main():
    async def handler(ep):
        try:
            while True:
                await ep.send_obj(await ep.recv_obj())
        except ucxx.UCXError:
            pass
    lst = ucxx.create_listener(handler, host="127.0.0.1")
    print("PORT", lst.port, flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


TRANSPORTS = {"tcp": {"TLS": "tcp"},
              "shm": {"TLS": "posix,sysv,cma,tcp", "MM_ERROR_HANDLING": "y"}}


async def _start_peer(script: str, transport: str):
    """This process and a child running ``script`` on ``transport``: the
    child and the first line it printed."""
    opts = TRANSPORTS[transport]
    ucxx.reset()
    ucxx.init(options=opts)
    env = child_env()
    env.update({f"UCX_{k}": v for k, v in opts.items()})
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(script)],
                            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, env=env, text=True)
    line = await asyncio.get_running_loop().run_in_executor(None, proc.stdout.readline)
    return proc, line


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_killed_peer_fails_an_idle_receive_within_a_second(transport):
    """A peer process killed while nothing is in flight: the endpoint's
    pending receive fails at once, not after UCX's keepalive."""
    proc, line = await _start_peer(PEER, transport)
    try:
        ep = await ucxx.create_endpoint(HOST, int(line.split()[1]))
        await ep.send_obj(b"ping")
        assert await ep.recv_obj() == b"ping"
        if transport == "shm":
            assert {"posix", "sysv"} & {t for t, _ in ep.transports}, ep.transports
        recv = asyncio.ensure_future(ep.recv_obj())
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        proc.kill()
        with pytest.raises(ucxx.UCXError) as ei:
            await asyncio.wait_for(recv, 5)
        assert time.monotonic() - t0 < 1.0
        assert type(ei.value) is not ucxx.UCXError
        ep.abort()
    finally:
        proc.kill()
        proc.wait()
        ucxx.reset()


ADDRESS_PEER = r"""
import asyncio, sys, ucxx

async def main():
    print("ADDR", ucxx.get_worker_address().hex(), flush=True)
    await asyncio.sleep(3600)

asyncio.run(main())
"""


@pytest.mark.parametrize("transport", ["tcp", "shm"])
async def test_address_endpoint_names_its_shared_memory_peer(transport):
    """An endpoint from a worker address has no handshake: where it talks
    shared memory, the FIFO UCX attaches names the peer process, which is
    then watched; over tcp nothing names it."""
    proc, line = await _start_peer(ADDRESS_PEER, transport)
    try:
        ep = await ucxx.create_endpoint_from_worker_address(bytes.fromhex(line.split()[1]))
        if transport == "tcp":
            assert ep._shm_peer_pid == 0 and ep._state.pidfd is None
            ep.abort()
            return
        assert ep._shm_peer_pid == proc.pid
        assert ep._state.pidfd is not None
        recv = asyncio.ensure_future(ep.recv(bytearray(8), tag=5, force_tag=True))
        await asyncio.sleep(0.05)
        t0 = time.monotonic()
        proc.kill()
        with pytest.raises(ucxx.UCXConnectionResetError):
            await asyncio.wait_for(recv, 5)
        assert time.monotonic() - t0 < 1.0
        ep.abort()
    finally:
        proc.kill()
        proc.wait()
        ucxx.reset()
