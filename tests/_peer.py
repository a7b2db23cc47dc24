"""A peer process for the two-process tests of ``ucxx._ucxx``.

Run as ``python _peer.py '<json config>'``; the parent side is
:class:`PeerProcess` / :func:`connect`. The config names the UCX options,
the progress mode, how to connect (``sockaddr``: the peer listens and
prints ``PORT n``; ``address``: worker addresses are exchanged over
stdin/stdout) and a role:

- ``echo``: receive (8-byte size on tag 1, payload on tag 2), send the
  payload back on tag 3, until the size is 2**64-1.
- ``gather_echo``: receive a frame-size table (tag 4), gather_recv the
  frames (tag 5), gather_send them back (tag 6), until the count is 0.
- ``am_echo``: am_recv / am_send back ``count`` active messages.
- ``stress``: ``_util.stress`` then ``_util.pingpong`` as side 1.

The peer prints ``READY`` once connected, ``DONE <json>`` when its role
finished, then waits for ``BYE`` on stdin and closes everything. Any
failure prints ``FAIL <message>`` and exits with status 1.
"""

from __future__ import annotations

import asyncio
import json
import os
import struct
import subprocess
import sys
import tempfile
import traceback

HERE = os.path.dirname(os.path.abspath(__file__))
STOP = (1 << 64) - 1


# ------------------------------------------------------------------ child
class _Stdin:
    """Line reader for stdin that does not block the event loop."""

    def __init__(self):
        self.buf = b""
        self.fd = sys.stdin.fileno()

    async def readline(self) -> str:
        loop = asyncio.get_running_loop()
        while b"\n" not in self.buf:
            fut = loop.create_future()
            loop.add_reader(self.fd, lambda: fut.done() or fut.set_result(None))
            try:
                await fut
            finally:
                loop.remove_reader(self.fd)
            chunk = os.read(self.fd, 65536)
            if not chunk:
                raise EOFError("parent closed stdin")
            self.buf += chunk
        line, _, self.buf = self.buf.partition(b"\n")
        return line.decode().strip()


MARK = "@@"


def say(*words):
    # Protocol lines are marked: UCX may log to stdout too.
    print(MARK, *words, flush=True)


async def _role_echo(w, ep, cfg):
    hdr = bytearray(8)
    n_msgs = 0
    delay = cfg.get("delay_s", 0)  # before each echo
    while True:
        await ep.tag_recv(hdr, 1)
        (n,) = struct.unpack("<Q", hdr)
        if n == STOP:
            return {"messages": n_msgs}
        buf = bytearray(n)
        got = await ep.tag_recv(buf, 2)
        assert got == n, (got, n)
        if delay:
            await asyncio.sleep(delay)
        await ep.tag_send(buf, 3)
        n_msgs += 1


async def _role_gather_echo(w, ep, cfg):
    count = bytearray(8)
    rounds = 0
    while True:
        await ep.tag_recv(count, 4)
        (n,) = struct.unpack("<Q", count)
        if n == 0:
            return {"rounds": rounds}
        table = bytearray(8 * n)
        await ep.tag_recv(table, 4)
        sizes = struct.unpack(f"<{n}Q", table)
        frames = [bytearray(s) for s in sizes]
        await ep.gather_recv(frames, 5, force_tag=True)
        await ep.gather_send(frames, 6, force_tag=True)
        rounds += 1


async def _role_am_echo(w, ep, cfg):
    for _ in range(cfg["count"]):
        msg = await ep.am_recv()
        await ep.am_send(msg)
    return {"messages": cfg["count"]}


async def _role_stress(w, ep, cfg):
    import _util

    probe = _util.BlockingPollProbe(asyncio.get_running_loop(), [w])
    try:
        stats = await _util.stress(w, ep, 1, 0, cfg["seed"], cfg["nstreams"], cfg["nmsgs"],
                                   timeout=cfg.get("timeout", 60))
        stats["pingpong"] = await _util.pingpong(w, ep, 1, cfg["npingpong"], cfg["seed"])
    finally:
        probe.close()
    stats["blocking_polls"] = probe.blocking
    stats["violations"] = probe.violations[:10]
    return stats


ROLES = {
    "echo": _role_echo,
    "gather_echo": _role_gather_echo,
    "am_echo": _role_am_echo,
    "stress": _role_stress,
}


async def _child_main(U, w, cfg):
    loop = asyncio.get_running_loop()
    stdin = _Stdin()
    w.start(loop)
    if cfg["connect"] == "sockaddr":
        accepted = loop.create_future()
        listener = w.listen(lambda ep: accepted.done() or accepted.set_result(ep),
                            0, "127.0.0.1")
        say("PORT", listener.port)
        ep = await asyncio.wait_for(accepted, 30)
        listener.close()
    else:
        say("ADDR", w.address.hex())
        line = await stdin.readline()
        assert line.startswith("ADDR "), line
        ep = w.ep_from_address(bytes.fromhex(line[5:]))
    say("READY", json.dumps({"error_handling": ep.error_handling}))
    result = await ROLES[cfg["role"]](w, ep, cfg)
    say("DONE", json.dumps(result))
    line = await asyncio.wait_for(stdin.readline(), 60)
    assert line == "BYE", line
    ep.abort()


def child(cfg):
    sys.path.insert(0, HERE)
    import ucxx  # noqa: F401
    from ucxx import _ucxx as U

    ctx = U.Context(cfg["opts"])
    w = U.Worker(ctx, cfg.get("mode", "blocking"), cfg.get("spin_us"))
    try:
        asyncio.run(_child_main(U, w, cfg))
    except BaseException as e:
        say("FAIL", repr(e), "|", traceback.format_exc().replace("\n", " | "))
        os._exit(1)
    w.close()
    ctx.close()


# ------------------------------------------------------------------ parent
class PeerProcess:
    """The peer as seen from the test: a child process and line I/O."""

    def __init__(self, cfg: dict, env: dict | None = None):
        self.cfg = cfg
        self._err = tempfile.TemporaryFile()
        env = dict(os.environ if env is None else env)
        env.setdefault("PYTHONUNBUFFERED", "1")
        root = os.path.dirname(HERE)
        env["PYTHONPATH"] = os.pathsep.join([root, HERE, env.get("PYTHONPATH", "")])
        # UCX configuration is per process: say it in the environment too.
        env["UCX_TLS"] = cfg["opts"]["TLS"]
        self.proc = subprocess.Popen(
            [sys.executable, os.path.abspath(__file__), json.dumps(cfg)],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._err, env=env)
        self._buf = b""
        self.noise: list[str] = []  # unmarked stdout lines (UCX logs)

    def stderr(self) -> str:
        self._err.seek(0)
        return self._err.read().decode(errors="replace")[-4000:]

    async def readline(self, timeout: float = 30.0) -> str:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - loop.time()
            if remaining <= 0:
                raise TimeoutError(f"peer silent for {timeout}s; stderr: {self.stderr()}")
            fut = loop.create_future()
            loop.add_reader(fd, lambda: fut.done() or fut.set_result(None))
            try:
                await asyncio.wait_for(fut, remaining)
            except asyncio.TimeoutError:
                raise TimeoutError(
                    f"peer silent for {timeout}s; stderr: {self.stderr()}") from None
            finally:
                loop.remove_reader(fd)
            chunk = os.read(fd, 65536)
            if not chunk:
                rc = self.proc.wait()
                raise EOFError(f"peer exited with {rc}; stderr: {self.stderr()}")
            self._buf += chunk
        line, _, self._buf = self._buf.partition(b"\n")
        line = line.decode(errors="replace").strip()
        if not line.startswith(MARK + " "):
            self.noise.append(line)
            return await self.readline(max(0.1, deadline - loop.time()))
        line = line[len(MARK) + 1:]
        if line.startswith("FAIL"):
            raise AssertionError(f"peer failed: {line}")
        return line

    async def expect(self, word: str, timeout: float = 30.0) -> str:
        line = await self.readline(timeout)
        assert line.split(" ", 1)[0] == word, f"expected {word} from the peer, got {line!r}"
        return line[len(word):].strip()

    def write(self, line: str) -> None:
        self.proc.stdin.write(line.encode() + b"\n")
        self.proc.stdin.flush()

    async def finish(self, timeout: float = 30.0) -> int:
        self.write("BYE")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout
        while self.proc.poll() is None:
            if loop.time() > deadline:
                raise TimeoutError("peer did not exit")
            await asyncio.sleep(0.01)
        assert self.proc.returncode == 0, self.stderr()
        return self.proc.returncode

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait(10)
        for f in (self.proc.stdin, self.proc.stdout):
            try:
                f.close()
            except OSError:
                pass
        self._err.close()


class Session:
    """This process's side of a two-process test."""

    def __init__(self, peer, ctx, w, ep, peer_info):
        self.peer, self.ctx, self.w, self.ep = peer, ctx, w, ep
        self.peer_info = peer_info

    async def done(self, timeout: float = 60.0) -> dict:
        """Wait for the peer's DONE, return its result."""
        return json.loads(await self.peer.expect("DONE", timeout))

    async def finish(self):
        """Let the peer close and exit, then close this side."""
        await self.peer.finish()
        self.close()

    def close(self):
        try:
            self.ep.abort()
            self.w.close()
            self.ctx.close()
        finally:
            self.peer.close()


CONNECT = {"tcp": "sockaddr", "shm": "address", "shm_eh": "sockaddr"}


async def connect(transport: str, role: str, mode: str = "blocking", spin_us=None,
                  peer_mode: str | None = None, peer_spin_us=None, **params) -> Session:
    """Start a peer with ``role`` and connect to it; returns the Session."""
    import _util
    import ucxx  # noqa: F401
    from ucxx import _ucxx as U

    opts = _util.options(transport)
    cfg = {"opts": opts, "mode": peer_mode or mode,
           "spin_us": peer_spin_us if peer_mode else spin_us,
           "connect": CONNECT[transport], "role": role, **params}
    peer = PeerProcess(cfg)
    ctx = w = ep = None
    try:
        ctx = U.Context(opts)
        w = U.Worker(ctx, mode, spin_us)
        w.start(asyncio.get_running_loop())
        if cfg["connect"] == "sockaddr":
            port = int(await peer.expect("PORT"))
            ep = w.ep_from_sockaddr("127.0.0.1", port)
        else:
            addr = bytes.fromhex(await peer.expect("ADDR"))
            ep = w.ep_from_address(addr)
            peer.write("ADDR " + w.address.hex())
        info = json.loads(await peer.expect("READY"))
    except BaseException:
        if ep is not None:
            ep.abort()
        if w is not None:
            w.close()
        if ctx is not None:
            ctx.close()
        peer.close()
        raise
    return Session(peer, ctx, w, ep, info)


if __name__ == "__main__":
    child(json.loads(sys.argv[1]))
