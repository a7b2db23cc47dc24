"""The one multi-frame wire format and its device-memory helper.

``Endpoint.send_multi`` / ``recv_multi`` and the Dask comm
(``ucxx.distributed``) speak it; docs/PROTOCOL.md ("Multi-frame messages")
is the reference. All messages of one multi-frame message go on one tag:

1. the header: a 20-byte prefix ``<4s B B H I Q>`` -- magic ``b"UCXM"``,
   version 2, flags (bit 0: the frame table is message 2), application
   flags (uint16, carried for the caller: the Dask comm's CLOSE and
   HELLO), frame count, total bytes -- followed by the frame table unless
   flag bit 0 is set. At most ``HEADER_MAX`` bytes.
2. only with flag bit 0: the frame table alone.
3. the frames, as ONE ``gather_send`` / ``gather_recv`` (its runs: docs/
   PROTOCOL.md, "Gathers on the wire").

The frame table is ``count`` uint64 sizes then ``count`` memory-type bytes
(0 host, 1 CUDA). The receiver learns sizes and memory types from it, so it
allocates buffers that split into the sender's runs.
"""

from __future__ import annotations

import struct

from ..exceptions import UCXError

MAGIC = b"UCXM"
VERSION = 2
FLAG_TABLE = 1
MEM_HOST = 0
MEM_CUDA = 1

PREFIX = struct.Struct("<4sBBHIQ")
PREFIX_SIZE = PREFIX.size  # 20
HEADER_MAX = 4096
#: Frames whose table still fits in a header message of HEADER_MAX bytes.
INLINE_MAX = (HEADER_MAX - PREFIX_SIZE) // 9  # 452


class CUDAAllocatorError(UCXError, RuntimeError):
    """A peer announced a frame in device memory and this process has no
    CUDA allocator (rmm, cupy or numba)."""


# ------------------------------------------------------------------ format
def frame_info(frame) -> tuple[int, int]:
    """(nbytes, memory type) of a frame, as the C layer classifies it: the
    buffer protocol first (host), else ``__cuda_array_interface__``."""
    try:
        return memoryview(frame).nbytes, MEM_HOST
    except TypeError:
        pass
    iface = getattr(frame, "__cuda_array_interface__", None)
    if iface is None:
        raise TypeError(
            "a bytes-like object or an object with __cuda_array_interface__ "
            f"is required, not {type(frame).__name__!r}"
        )
    n = 1
    for d in iface["shape"]:
        n *= d
    return n * int(iface["typestr"][2:]), MEM_CUDA


def describe(frames) -> tuple[list[int], list[int]]:
    """Sizes and memory types of ``frames``."""
    sizes = []
    memtypes = []
    for f in frames:
        n, m = frame_info(f)
        sizes.append(n)
        memtypes.append(m)
    return sizes, memtypes


def encode_header(sizes, memtypes, app_flags: int = 0) -> list[bytes]:
    """The header message, and the table message when the table does not
    fit in it, for frames of ``sizes`` / ``memtypes``."""
    count = len(sizes)
    table = struct.pack(f"<{count}Q", *sizes) + bytes(memtypes)
    total = sum(sizes)
    if count <= INLINE_MAX:
        return [PREFIX.pack(MAGIC, VERSION, 0, app_flags, count, total) + table]
    return [PREFIX.pack(MAGIC, VERSION, FLAG_TABLE, app_flags, count, total), table]


def decode_prefix(data, max_frames: int, max_bytes: int) -> tuple[int, int, int, int]:
    """Validate a header message's prefix: (flags, app_flags, count, total)."""
    if len(data) < PREFIX_SIZE:
        raise UCXError(f"multi-frame header too short ({len(data)} bytes)")
    magic, version, flags, app_flags, count, total = PREFIX.unpack_from(data)
    if magic != MAGIC:
        raise UCXError(f"multi-frame header: bad magic {bytes(magic)!r} (expected {MAGIC!r})")
    if version != VERSION:
        raise UCXError(
            f"multi-frame header: the peer speaks version {version}, this side {VERSION}"
        )
    if flags & ~FLAG_TABLE:
        raise UCXError(f"multi-frame header: unknown flags {flags:#x}")
    if count > max_frames:
        raise UCXError(
            f"multi-frame header: the peer announced {count} frames, more than the "
            f"limit of {max_frames} (recv_multi_max_frames)"
        )
    if total > max_bytes:
        raise UCXError(
            f"multi-frame header: the peer announced {total} bytes, more than the "
            f"limit of {max_bytes} (recv_multi_max_bytes)"
        )
    if flags & FLAG_TABLE:
        if len(data) != PREFIX_SIZE:
            raise UCXError(
                f"multi-frame header of {len(data)} bytes with a separate table"
            )
        if count <= INLINE_MAX:
            raise UCXError(f"multi-frame header: a separate table for {count} frames")
    elif len(data) != PREFIX_SIZE + 9 * count:
        raise UCXError(
            f"multi-frame header of {len(data)} bytes for {count} frames "
            f"(expected {PREFIX_SIZE + 9 * count})"
        )
    return flags, app_flags, count, total


def decode_table(table, count: int, total: int) -> tuple[tuple[int, ...], bytes]:
    """Validate a frame table: (sizes, memory types)."""
    if len(table) != 9 * count:
        raise UCXError(f"multi-frame table of {len(table)} bytes for {count} frames")
    sizes = struct.unpack_from(f"<{count}Q", table)
    memtypes = bytes(table[8 * count :])
    if sum(sizes) != total:
        raise UCXError(f"multi-frame table: sizes add up to {sum(sizes)}, header says {total}")
    for m in memtypes:
        if m not in (MEM_HOST, MEM_CUDA):
            raise UCXError(f"multi-frame table: unknown memory type {m}")
    return sizes, memtypes


# ------------------------------------------------------------------ device memory
_device: tuple | None = None  # (allocate, synchronize) once found


def device_support():
    """``(allocate(n), synchronize())`` for device memory, the first of
    rmm, cupy and numba that imports (allocation); cupy, else numba, for
    synchronising the device (with rmm alone: nothing to call). Raises
    :class:`CUDAAllocatorError` when none imports."""
    global _device
    if _device is not None:
        return _device
    allocs = []
    syncs = []
    try:
        import rmm  # type: ignore
    except ImportError:
        pass
    else:
        allocs.append(lambda n: rmm.DeviceBuffer(size=n))
    try:
        import cupy  # type: ignore
    except ImportError:
        pass
    else:
        allocs.append(lambda n: cupy.empty((n,), dtype="u1"))
        syncs.append(lambda: cupy.cuda.runtime.deviceSynchronize())
    try:
        import numba.cuda  # type: ignore
    except ImportError:
        pass
    else:
        allocs.append(lambda n: numba.cuda.device_array((n,), dtype="u1"))
        syncs.append(lambda: numba.cuda.default_stream().synchronize())
    if not allocs:
        raise CUDAAllocatorError(
            "the peer sent a CUDA frame but no CUDA allocator (rmm, cupy or numba) "
            "is importable in this process"
        )
    _device = (allocs[0], syncs[0] if syncs else (lambda: None))
    return _device


def synchronize_device() -> None:
    """Wait until the device is idle: UCX is not stream-ordered, so the
    producers of device frames (sender) and the allocations (receiver) must
    be complete before UCX touches the memory. Nothing to do where no
    device library imports (no device frame can exist then)."""
    try:
        _, sync = device_support()
    except CUDAAllocatorError:
        return
    sync()


def allocate(sizes, memtypes, host_alloc):
    """Receive buffers for a frame table; device memory through
    :func:`device_support`, synchronised before it is returned."""
    frames = []
    device = False
    for size, mem in zip(sizes, memtypes):
        if mem == MEM_CUDA:
            alloc, _ = device_support()
            frames.append(alloc(size))
            device = True
        else:
            frames.append(host_alloc(size))
    if device:
        synchronize_device()
    return frames


# ------------------------------------------------------------------ transfers
def post_frames(c_ep, frames, tag=None, force_tag=False, app_flags: int = 0):
    """Post a multi-frame message on endpoint ``c_ep``: the header (and
    table) messages, then the frames as one gather, with ONE C call (every
    buffer is checked before anything is posted, and nothing else sent on
    the tag can come between them). Returns its Request."""
    sizes, memtypes = describe(frames)
    return post_described(c_ep, frames, sizes, memtypes, tag, force_tag, app_flags)


def post_described(c_ep, frames, sizes, memtypes, tag=None, force_tag=False,
                   app_flags: int = 0):
    """:func:`post_frames` for frames already described (``describe``)."""
    if MEM_CUDA in memtypes:
        synchronize_device()
    return c_ep.gather_send(frames, tag, force_tag,
                            header=encode_header(sizes, memtypes, app_flags))


async def recv_header(recv, max_frames: int, max_bytes: int, host_alloc):
    """Receive a header (and table) through ``recv(buf) -> awaitable of the
    received length``; returns ``(app_flags, frames)`` with the frames
    allocated (not yet received)."""
    header = bytearray(HEADER_MAX)
    n = await recv(header)
    flags, app_flags, count, total = decode_prefix(
        memoryview(header)[: _received(n, header)], max_frames, max_bytes
    )
    if flags & FLAG_TABLE:
        table = bytearray(9 * count)
        got = await recv(table)
        if got is not None and got != len(table):
            raise UCXError(f"multi-frame table of {got} bytes for {count} frames")
    else:
        table = memoryview(header)[PREFIX_SIZE : PREFIX_SIZE + 9 * count]
    sizes, memtypes = decode_table(table, count, total)
    return app_flags, allocate(sizes, memtypes, host_alloc)


def _received(n, header) -> int:
    """Length of a received header; a receive that does not report one
    (None) is taken at the length its prefix implies."""
    if n is not None:
        return n
    if len(header) < PREFIX_SIZE:
        return len(header)
    flags, count = header[5], PREFIX.unpack_from(header)[4]
    return PREFIX_SIZE if flags & FLAG_TABLE else min(len(header), PREFIX_SIZE + 9 * count)
