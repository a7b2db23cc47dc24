"""``send_multi`` / ``recv_multi``: several frames with a self-describing
header (wire format in docs/PROTOCOL.md, "send_multi / recv_multi").

Messages, all on the same tag (the endpoint's send tag, or the user tag):

1. header: ``<4s B B H I Q``: magic ``b"UCXM"``, version 1, flags
   (bit 0: the frame table follows in message 2), reserved, frame count,
   total payload bytes; then, unless flag bit 0 is set, the frame table
   inline: ``count`` little-endian uint64 sizes followed by ``count``
   memory-type bytes (0 host, 1 CUDA). The header message is at most
   ``HEADER_MAX`` bytes; a longer table is sent as message 2 instead.
2. (only with flag bit 0) the frame table, exactly ``9 * count`` bytes.
3. the frames, one tagged message each, sent with one ``gather_send``.

UCX keeps per-(sender, tag) order, so the receiver posts the header
receive, then (under a per-endpoint lock, so that concurrent
``recv_multi`` calls cannot interleave their posts) the frame receives.
"""

from __future__ import annotations

import asyncio
import os
import struct

from .. import _ucxx
from ..exceptions import UCXError

# The C methods, called on the endpoint explicitly: an Endpoint subclass
# (close_after_n_recv's) may wrap the public ones.
_C = _ucxx.Endpoint

MAGIC = b"UCXM"
VERSION = 1
FLAG_TABLE_FOLLOWS = 1
MEM_HOST = 0
MEM_CUDA = 1

_PREFIX = struct.Struct("<4sBBHIQ")
PREFIX_SIZE = _PREFIX.size  # 20
HEADER_MAX = 4096


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    if value is None or value == "":
        return default
    try:
        from ..utils import parse_bytes

        return int(parse_bytes(value))
    except ValueError:
        raise ValueError(f"invalid value for ${name}: {value!r}") from None


DEFAULT_MAX_FRAMES = _env_int("UCXPY_RECV_MULTI_MAX_FRAMES", 1 << 16)
DEFAULT_MAX_BYTES = _env_int("UCXPY_RECV_MAX_BYTES", 1 << 36)  # 64 GiB


def _frame_info(buf):
    """(nbytes, memory type) of a frame."""
    iface = getattr(buf, "__cuda_array_interface__", None)
    if iface is not None:
        n = 1
        for d in iface["shape"]:
            n *= d
        return n * int(iface["typestr"][2:]), MEM_CUDA
    return memoryview(buf).nbytes, MEM_HOST


def encode_header(sizes, memtypes) -> list[bytes]:
    """The header message(s) for frames of ``sizes`` / ``memtypes``."""
    count = len(sizes)
    table = struct.pack(f"<{count}Q", *sizes) + bytes(memtypes)
    total = sum(sizes)
    if PREFIX_SIZE + len(table) <= HEADER_MAX:
        return [_PREFIX.pack(MAGIC, VERSION, 0, 0, count, total) + table]
    return [_PREFIX.pack(MAGIC, VERSION, FLAG_TABLE_FOLLOWS, 0, count, total), table]


def decode_prefix(data, max_frames: int, max_bytes: int):
    if len(data) < PREFIX_SIZE:
        raise UCXError(f"recv_multi: header too short ({len(data)} bytes)")
    magic, version, flags, _r, count, total = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise UCXError(f"recv_multi: bad header magic {magic!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise UCXError(f"recv_multi: unsupported header version {version}")
    if count > max_frames:
        raise UCXError(
            f"recv_multi: the peer announced {count} frames, more than the limit "
            f"of {max_frames} (recv_multi_max_frames)"
        )
    if total > max_bytes:
        raise UCXError(
            f"recv_multi: the peer announced {total} bytes, more than the limit "
            f"of {max_bytes} (recv_multi_max_bytes)"
        )
    return flags, count, total


def decode_table(table, count: int, total: int):
    if len(table) != 9 * count:
        raise UCXError(
            f"recv_multi: frame table of {len(table)} bytes for {count} frames"
        )
    sizes = struct.unpack_from(f"<{count}Q", table)
    memtypes = bytes(table[8 * count :])
    if sum(sizes) != total:
        raise UCXError(
            f"recv_multi: frame sizes add up to {sum(sizes)}, header says {total}"
        )
    for m in memtypes:
        if m not in (MEM_HOST, MEM_CUDA):
            raise UCXError(f"recv_multi: unknown memory type {m} in frame table")
    return sizes, memtypes


def _host_alloc(n: int):
    import numpy as np

    return np.empty(n, dtype=np.uint8)


def _cuda_alloc(n: int):
    try:
        import rmm  # type: ignore

        return rmm.DeviceBuffer(size=n)
    except ImportError:
        pass
    try:
        import cupy  # type: ignore

        return cupy.empty(n, dtype="u1")
    except ImportError:
        pass
    try:
        from numba import cuda  # type: ignore

        return cuda.device_array(n, dtype="u1")
    except ImportError:
        pass
    raise UCXError(
        "recv_multi: the peer sent a CUDA frame but no CUDA allocator "
        "(rmm, cupy or numba) is available"
    )


async def send_multi(ep, buffers, tag=None, force_tag=False) -> None:
    if not isinstance(buffers, (list, tuple)):
        raise ValueError("The `buffers` argument must be a `list` or `tuple`")
    sizes = []
    memtypes = []
    for b in buffers:
        n, m = _frame_info(b)
        sizes.append(n)
        memtypes.append(m)
    # Post everything before awaiting anything: the posts are in order.
    reqs = [_C.send(ep, h, tag, force_tag) for h in encode_header(sizes, memtypes)]
    if buffers:
        reqs.append(_C.gather_send(ep, list(buffers), tag, force_tag))
    for r in reqs:
        await r


async def recv_multi(ep, tag=None, force_tag=False) -> list:
    lock = ep._multi_lock
    if lock is None:
        lock = ep._multi_lock = asyncio.Lock()
    async with lock:
        header = bytearray(HEADER_MAX)
        # The header through recv() (it counts as the endpoint's one receive
        # of this recv_multi), the rest through tag_recv/gather_recv.
        n = await _C.recv(ep, header, tag, force_tag)
        if n is None:
            n = HEADER_MAX
        data = memoryview(header)[:n]
        flags, count, total = decode_prefix(
            data, ep.recv_multi_max_frames, ep.recv_multi_max_bytes
        )
        if flags & FLAG_TABLE_FOLLOWS:
            if n != PREFIX_SIZE:
                raise UCXError(f"recv_multi: header of {n} bytes with a separate table")
            table = bytearray(9 * count)
            got = await _C.tag_recv(ep, table, ep.recv_tag_for(tag, force_tag))
            if got is not None and got != len(table):
                raise UCXError("recv_multi: short frame table")
        else:
            table = data[PREFIX_SIZE:]
        sizes, memtypes = decode_table(table, count, total)
        frames = [
            _cuda_alloc(s) if m == MEM_CUDA else _host_alloc(s)
            for s, m in zip(sizes, memtypes)
        ]
        req = _C.gather_recv(ep, frames, tag, force_tag) if frames else None
    if req is not None:
        await req
    return frames
