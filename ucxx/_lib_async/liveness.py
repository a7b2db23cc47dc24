"""Same-host liveness: a peer process's exit ends its endpoints at once.

The connection handshake carries an identity block (docs/PROTOCOL.md,
"Identity"): the sender's pid, its start time and a digest of the host's
boot id and the sender's pid namespace. Where the digest matches ours, the
pid names a process this one can see. An endpoint from a worker address
has no handshake; over shared memory the FIFO UCX attached for it names
the peer (``Endpoint._shm_peer_pid``, csrc/shm.c). Either way the endpoint
opens a pidfd on the peer and watches it with the event loop's
``add_reader``. When the peer exits (killed
included; a zombie counts as exited) the endpoint fails as on a UCX peer
error (``UCXConnectionResetError`` for every pending operation), which UCX's
own keepalive reports only after a second or more, and over shared memory
not at all while a rendezvous is in flight. Where ``pidfd_open`` is missing,
or the peer is on another host or in another pid namespace, UCX's keepalive
is all there is.
"""

from __future__ import annotations

import hashlib
import os
import struct

IDENT_MAGIC = b"UCXI"
_IDENT_BODY = struct.Struct("<4sIQ8s")
_IDENT = struct.Struct("<4sIQ8s8s")
IDENT_SIZE = _IDENT.size  # 32
_PERSON = b"ucxx-id1"
_NO_HOST = bytes(8)

assert IDENT_SIZE == 32


def _start_time(pid: int | str) -> int | None:
    """Field 22 of /proc/<pid>/stat (clock ticks after boot), or None."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        return int(stat[stat.rindex(b")") + 2:].split()[19])
    except (OSError, ValueError, IndexError):
        return None


def _host_digest() -> bytes:
    """8 bytes naming this boot and this process's pid namespace; zeros
    where either cannot be read (then no peer trusts our pid)."""
    try:
        with open("/proc/sys/kernel/random/boot_id", "rb") as f:
            boot = f.read().strip()
        ns = os.stat("/proc/self/ns/pid")
    except OSError:
        return _NO_HOST
    key = boot + b"/%d:%d" % (ns.st_dev, ns.st_ino)
    return hashlib.blake2b(key, digest_size=8, person=_PERSON).digest()


def _checksum(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8, person=_PERSON).digest()


_own_cache: dict = {}  # pid -> (identity block, host digest)


def _own() -> tuple[bytes, bytes]:
    """This process's identity block and host digest, read once (per pid:
    a forked child is another process)."""
    pid = os.getpid()
    own = _own_cache.get(pid)
    if own is None:
        host = _host_digest()
        body = _IDENT_BODY.pack(IDENT_MAGIC, pid, _start_time("self") or 0, host)
        own = _own_cache[pid] = (body + _checksum(body), host)
    return own


def identity() -> bytes:
    """This process's identity block (pid, start time, host digest)."""
    return _own()[0]


def peer_pid(data: bytes | bytearray | memoryview) -> tuple[int, int] | None:
    """(pid, start time) of a peer's identity block if the peer is a
    process of this host and pid namespace; None otherwise. ValueError
    naming the problem if the block is malformed."""
    data = bytes(data)
    magic, pid, start, host, checksum = _IDENT.unpack(data)
    if magic != IDENT_MAGIC:
        raise ValueError(f"bad identity magic {magic!r} (expected {IDENT_MAGIC!r})")
    if checksum != _checksum(data[: _IDENT_BODY.size]):
        raise ValueError("identity checksum mismatch")
    if host == _NO_HOST or host != _own()[1] or pid <= 0 or start == 0:
        return None
    return pid, start


def current(pid: int) -> tuple[int, int] | None:
    """(pid, start time) of a live process of this pid namespace (one an
    endpoint from a worker address talks shared memory to), or None."""
    start = _start_time(pid)
    return (pid, start) if start else None


def watch(loop, pid: int, start: int, on_exit):
    """Watch process ``pid`` (started at ``start``) on ``loop``: ``on_exit()``
    once it exits. Returns the pidfd (the caller ends the watch with
    :func:`unwatch`), or None: pidfds are not available, or the pid is gone
    or names another process now (then ``on_exit()`` has run)."""
    pidfd_open = getattr(os, "pidfd_open", None)
    if pidfd_open is None:
        return None
    try:
        fd = pidfd_open(pid)
    except ProcessLookupError:
        on_exit()
        return None
    except OSError:
        return None
    if _start_time(pid) != start:
        os.close(fd)
        on_exit()
        return None
    try:
        loop.add_reader(fd, on_exit)
    except BaseException:
        os.close(fd)
        raise
    return fd


def unwatch(loop, fd: int) -> None:
    """End the watch of pidfd ``fd`` and close it."""
    try:
        loop.remove_reader(fd)
    except Exception:  # the loop is closed: nothing reads it any more
        pass
    os.close(fd)
