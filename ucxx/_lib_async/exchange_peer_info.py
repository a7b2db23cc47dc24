"""Connection handshake (see docs/PROTOCOL.md, "Connection handshake").

Run once per connection, on both sides, right after the UCX endpoint exists
(client: ``Worker.ep_from_sockaddr``; server: the endpoint delivered by the
listener). Each side sends one fixed-size message over the UCX stream API
and receives the peer's:

    offset size  field
    0      4     magic     b"UCXH"
    4      2     version   uint16 little endian (1)
    6      2     flags     uint16, 0 (reserved)
    8      8     recv_tag  uint64: tag the sender receives messages on
    16     8     ctrl_tag  uint64: tag the sender receives control messages on
    24     8     checksum  first 8 bytes of BLAKE2b(bytes 0..23, person=b"ucxx-hs1")

Both sides post their send and their receive at once (no side waits for the
other to speak first), so the exchange costs one round trip.
"""

from __future__ import annotations

import asyncio
import hashlib
import secrets
import struct
from dataclasses import dataclass

from .. import _ucxx
from ..exceptions import UCXError, UCXTimedOutError

MAGIC = b"UCXH"
VERSION = 1
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


def unpack(data: bytes | bytearray | memoryview) -> PeerInfo:
    """Validate and decode a peer's message; UCXError saying what is wrong."""
    data = bytes(data)
    if len(data) != MSG_SIZE:
        raise UCXError(
            f"handshake failed: expected {MSG_SIZE} bytes from the peer, got {len(data)}"
        )
    magic, version, _flags, recv_tag, ctrl_tag, checksum = _MSG.unpack(data)
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
    return PeerInfo(recv_tag=recv_tag, ctrl_tag=ctrl_tag, version=version)


def new_tag() -> int:
    """A random 64-bit tag."""
    return secrets.randbits(64)


async def _exchange(c_ep, my_msg: bytes, peer_buf: bytearray) -> None:
    send_req = c_ep.stream_send(my_msg)
    recv_req = c_ep.stream_recv(peer_buf)
    await recv_req
    await send_req


async def exchange_peer_info(
    c_ep,
    recv_tag: int,
    ctrl_tag: int,
    timeout: float,
    peer: str = "peer",
) -> PeerInfo:
    """Run the handshake on the C endpoint ``c_ep``.

    Returns the peer's tags. On any failure the C endpoint is aborted and a
    UCXError is raised: UCXTimedOutError if the peer stayed silent for
    ``timeout`` seconds, the typed transport error if the connection failed,
    a plain UCXError naming the problem if the peer sent garbage.
    """
    my_msg = pack(recv_tag, ctrl_tag)
    peer_buf = bytearray(MSG_SIZE)
    try:
        try:
            await asyncio.wait_for(_exchange(c_ep, my_msg, peer_buf), timeout)
        except asyncio.TimeoutError:
            raise UCXTimedOutError(
                f"handshake with {peer} timed out after {timeout:g} s "
                "(the peer never answered; is it a ucxx listener?)"
            ) from None
        except UCXError as e:
            if isinstance(e, _ucxx.UCXMessageTruncatedError):
                raise UCXError(
                    f"handshake with {peer} failed: the peer sent more than "
                    f"{MSG_SIZE} bytes"
                ) from e
            raise type(e)(f"handshake with {peer} failed: {e}") from e
        return unpack(peer_buf)
    except BaseException:
        try:
            c_ep.abort()
        except Exception:  # pragma: no cover - abort is documented idempotent
            pass
        raise
