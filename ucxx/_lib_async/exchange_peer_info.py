"""Connection handshake (see docs/PROTOCOL.md, "Connection handshake").

Run once per connection, on both sides, right after the UCX endpoint exists
(client: ``Worker.ep_from_sockaddr``; server: the endpoint delivered by the
listener). Each side sends one fixed-size message over the UCX stream API
and receives the peer's:

    offset size  field
    0      4     magic     b"UCXH"
    4      2     version   uint16 little endian (1)
    6      2     flags     uint16: FLAG_IDENTITY, other bits reserved
    8      8     recv_tag  uint64: tag the sender receives messages on
    16     8     ctrl_tag  uint64: tag the sender receives control messages on
    24     8     checksum  first 8 bytes of BLAKE2b(bytes 0..23, person=b"ucxx-hs1")

With FLAG_IDENTITY set, the sender's 32-byte identity block follows on the
stream (liveness.py: pid, start time, host digest); a receiver that knows
the flag reads it, an older one leaves it unread.

The listener's side sends first and then receives; the client receives
first and then sends: when the listener's side goes on, the client's
endpoint is ready (docs/PROTOCOL.md).
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import struct
from dataclasses import dataclass

from .. import _ucxx
from ..exceptions import UCXError, UCXTimedOutError
from . import liveness

MAGIC = b"UCXH"
VERSION = 1
# flags: an identity block follows (liveness.py).
FLAG_IDENTITY = 1
_BODY = struct.Struct("<4sHHQQ")
_MSG = struct.Struct("<4sHHQQ8s")
MSG_SIZE = _MSG.size  # 32
_PERSON = b"ucxx-hs1"

assert MSG_SIZE == 32


def _checksum(body: bytes) -> bytes:
    return hashlib.blake2b(body, digest_size=8, person=_PERSON).digest()


def pack(recv_tag: int, ctrl_tag: int, version: int = VERSION, flags: int = 0) -> bytes:
    body = _BODY.pack(MAGIC, version, flags, recv_tag, ctrl_tag)
    return body + _checksum(body)


@dataclass(frozen=True)
class PeerInfo:
    recv_tag: int
    ctrl_tag: int
    version: int
    flags: int = 0


def unpack(data: bytes | bytearray | memoryview) -> PeerInfo:
    """Validate and decode a peer's message; UCXError saying what is wrong."""
    data = bytes(data)
    if len(data) != MSG_SIZE:
        raise UCXError(
            f"handshake failed: expected {MSG_SIZE} bytes from the peer, got {len(data)}"
        )
    magic, version, flags, recv_tag, ctrl_tag, checksum = _MSG.unpack(data)
    if magic != MAGIC:
        raise UCXError(
            f"handshake failed: bad magic {magic!r} (expected {MAGIC!r}); "
            "the peer is not a ucxx endpoint"
        )
    if version != VERSION:
        raise UCXError(
            f"handshake failed: peer speaks protocol version {version}, "
            f"this side speaks version {VERSION}"
        )
    if checksum != _checksum(data[: _BODY.size]):
        raise UCXError(
            f"handshake failed: checksum mismatch ({checksum.hex()} != "
            f"{_checksum(data[:_BODY.size]).hex()})"
        )
    return PeerInfo(recv_tag=recv_tag, ctrl_tag=ctrl_tag, version=version, flags=flags)


def decode_peer(data: bytes | bytearray | memoryview) -> tuple[PeerInfo, tuple[int, int] | None]:
    """The peer's whole handshake as received: its message, then its
    identity block if the message's flags announce one. (PeerInfo, the
    peer's (pid, start time) on this host or None); UCXError naming what
    is wrong."""
    data = bytes(data)
    info = unpack(data[:MSG_SIZE])
    if not info.flags & FLAG_IDENTITY:
        return info, None
    ident = data[MSG_SIZE:MSG_SIZE + liveness.IDENT_SIZE]
    if len(ident) != liveness.IDENT_SIZE:
        raise UCXError(
            f"handshake failed: identity block missing ({len(ident)} of "
            f"{liveness.IDENT_SIZE} bytes)"
        )
    try:
        return info, liveness.peer_pid(ident)
    except ValueError as e:
        raise UCXError(f"handshake failed: {e}") from None


def new_tag() -> int:
    """A random 64-bit tag."""
    return secrets.randbits(64)


async def _exchange(
    c_ep, my_msg: bytes, peer_buf: bytearray, timeout: float, listener: bool
) -> bool:
    """The listener sends first, then receives; the client receives, then
    sends. So the listener's side goes on (runs its callback, sends) only
    once the client has its answer: the client's endpoint is ready first.

    False if ``timeout`` expired first. The timeout aborts the endpoint (its
    transfers then fail) rather than running the exchange in a task of
    ``asyncio.wait_for``, which would cost loop turns.
    """
    expired = []

    def expire():
        expired.append(True)
        c_ep.abort()

    async def receive():
        await c_ep.stream_recv(peer_buf)
        try:
            flags = unpack(peer_buf).flags
        except UCXError:
            return  # refused by the caller, without waiting for more
        if flags & FLAG_IDENTITY:
            ident = bytearray(liveness.IDENT_SIZE)
            await c_ep.stream_recv(ident)
            peer_buf.extend(ident)

    timer = asyncio.get_running_loop().call_later(timeout, expire)
    try:
        if listener:
            await c_ep.stream_send(my_msg)
            await receive()
        else:
            await receive()
            await c_ep.stream_send(my_msg)
    except UCXError:
        if expired:
            return False
        raise
    finally:
        timer.cancel()
    return not expired


async def exchange_peer_info(
    endpoint,
    msg_tag: int,
    ctrl_tag: int,
    listener: bool,
    connect_timeout: float = 5.0,
    peer: str | None = None,
) -> dict:
    """Run the handshake on the C endpoint ``endpoint``: send our receive
    tag ``msg_tag`` and control tag ``ctrl_tag``, receive the peer's.

    Returns ``{"msg_tag": ..., "ctrl_tag": ..., "peer_pid": ...}`` of the
    peer (``peer_pid``: (pid, start time) of a peer process on this host,
    else None). On any
    failure the endpoint is aborted and a UCXError is raised:
    UCXTimedOutError if the peer stayed silent for ``connect_timeout``
    seconds, the typed transport error if the connection failed, a plain
    UCXError naming the problem if the peer sent garbage. (Both sides post
    their send and receive at once; ``listener`` only names the peer in
    messages.)
    """
    if peer is None:
        peer = "the client" if listener else "the listener"
    my_msg = pack(msg_tag, ctrl_tag, flags=FLAG_IDENTITY) + liveness.identity()
    peer_buf = bytearray(MSG_SIZE)
    try:
        try:
            if not await _exchange(endpoint, my_msg, peer_buf, connect_timeout, listener):
                raise UCXTimedOutError(
                    f"handshake with {peer} timed out after {connect_timeout:g} s "
                    "(the peer never answered; is it a ucxx listener?)"
                )
        except UCXTimedOutError as e:
            if "handshake" in str(e):
                raise
            raise UCXTimedOutError(f"handshake with {peer} failed: {e}") from e
        except UCXError as e:
            if isinstance(e, _ucxx.UCXMessageTruncatedError):
                raise UCXError(
                    f"handshake with {peer} failed: the peer sent more than "
                    f"{MSG_SIZE} bytes"
                ) from e
            raise type(e)(f"handshake with {peer} failed: {e}") from e
        info, peer_pid = decode_peer(peer_buf)
        return {"msg_tag": info.recv_tag, "ctrl_tag": info.ctrl_tag, "peer_pid": peer_pid}
    except BaseException:
        try:
            endpoint.abort()
        except Exception:  # pragma: no cover - abort is documented idempotent
            pass
        raise
