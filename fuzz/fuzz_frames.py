"""Fuzz the one multi-frame format's receiving side
(``ucxx/_lib_async/frames.py``: ``recv_header``, which ``recv_multi`` and
the Dask comm both use).

    python fuzz/fuzz_frames.py -runs=100000 [corpus_dir ...]

Input layout (so that seeds are easy to write): byte 0 selects the limits
(``max_frames`` from bits 0-1, ``max_bytes`` from bits 2-3), bytes 1-2
(uint16 LE) are the length of message 1 (the header message), message 1
follows, and whatever remains is message 2 (the separate frame table,
received only when the header asks for one).

``recv_header`` itself runs on the two messages, through a ``recv`` that
behaves like a tagged receive (a message longer than the buffer raises
``UCXMessageTruncatedError``) and allocators that only record sizes. A
peer's bytes may only ever produce ``UCXError``; anything else
(struct.error, ValueError, MemoryError, IndexError...) is a bug, and so is
an accepted header that breaks the limits or that the sender's
``encode_header`` would not have produced byte for byte.

Without arguments, a seed corpus (``seeds()``) is written to a temporary
directory and used. ``test_one_input`` is importable without atheris.
"""

from __future__ import annotations

import os
import struct
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

try:
    import atheris
except ImportError:  # the in-process fuzz of tests/test_fuzz.py needs no atheris
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["ucxx._lib_async.frames"]):
        from ucxx._lib_async import frames
else:
    from ucxx._lib_async import frames

from ucxx._ucxx import UCXMessageTruncatedError  # noqa: E402
from ucxx.exceptions import UCXError  # noqa: E402

MAX_FRAMES = (0, 1, 16, 1 << 16)
MAX_BYTES = (0, 100, 1 << 20, 1 << 36)


def split(data: bytes):
    """(max_frames, max_bytes, message 1, message 2) from a fuzz input."""
    if len(data) < 3:
        return None
    sel = data[0]
    n1 = struct.unpack_from("<H", data, 1)[0]
    msg1 = data[3:3 + n1]
    msg2 = data[3 + n1:]
    return MAX_FRAMES[sel & 3], MAX_BYTES[(sel >> 2) & 3], msg1, msg2


def join(msg1: bytes, msg2: bytes = b"", sel: int = 0b1111) -> bytes:
    return bytes([sel]) + struct.pack("<H", len(msg1)) + msg1 + msg2


def table_follows(msg1: bytes) -> bool:
    """Whether the header asks for message 2 (the separate table)."""
    return len(msg1) >= frames.PREFIX_SIZE and bool(msg1[5] & frames.FLAG_TABLE)


def _run(coro):
    """Drive a coroutine whose awaits never suspend."""
    try:
        coro.send(None)
    except StopIteration as stop:
        return stop.value
    coro.close()
    raise AssertionError("recv_header suspended")


def decode(max_frames: int, max_bytes: int, msg1: bytes, msg2: bytes):
    """``frames.recv_header`` on received messages ``msg1`` (header) and
    ``msg2`` (separate table): (app_flags, sizes, memtypes, messages
    read), or UCXError."""
    pending = [msg1, msg2]
    read = []

    async def recv(buf):
        assert pending, "recv_header asked for a third message"
        msg = pending.pop(0)
        read.append(msg)
        if len(msg) > len(buf):
            raise UCXMessageTruncatedError("Message truncated")
        buf[: len(msg)] = msg
        return len(msg)

    saved = frames._device
    frames._device = (lambda n: ("cuda", n), lambda: None)
    try:
        app_flags, bufs = _run(frames.recv_header(recv, max_frames, max_bytes,
                                                  lambda n: ("host", n)))
    finally:
        frames._device = saved
    memtypes = bytes(frames.MEM_CUDA if kind == "cuda" else frames.MEM_HOST
                     for kind, _ in bufs)
    return app_flags, [n for _, n in bufs], memtypes, read


def test_one_input(data: bytes) -> None:
    parts = split(data)
    if parts is None:
        return
    max_frames, max_bytes, msg1, msg2 = parts
    try:
        app_flags, sizes, memtypes, read = decode(max_frames, max_bytes, msg1, msg2)
    except UCXError:
        return
    # Accepted: everything the receiver relies on holds ...
    count = len(sizes)
    assert count == len(memtypes), (count, len(memtypes))
    assert count <= max_frames, (count, max_frames)
    assert sum(sizes) <= max_bytes, (sum(sizes), max_bytes)
    assert all(m in (frames.MEM_HOST, frames.MEM_CUDA) for m in memtypes)
    # ... and the messages read are exactly what the sender encodes.
    assert frames.encode_header(sizes, memtypes, app_flags) == [bytes(m) for m in read]


def seeds() -> list[bytes]:
    P = frames.PREFIX
    out = []
    for sizes, mts, app in (([], [], 0), ([5], [0], 1), ([0, 1, 2], [0, 1, 0], 2),
                            ([7] * 500, [0] * 500, 0), ([1] * frames.INLINE_MAX, [1] * frames.INLINE_MAX, 3)):
        msgs = frames.encode_header(sizes, mts, app)
        out.append(join(msgs[0], msgs[1] if len(msgs) > 1 else b""))
    V = frames.VERSION
    out.append(join(P.pack(b"UCXM", V, 0, 0, 1, 5) + struct.pack("<Q", 6) + b"\0"))
    out.append(join(P.pack(b"UCXM", V, 1, 0, 2, 3), struct.pack("<QQ", 1, 2) + b"\0\1"))
    out.append(join(P.pack(b"UCXM", V, 1, 0, 500, 0), bytes(4499)))
    out.append(join(P.pack(b"UCXM", V, 0, 0, 2 ** 32 - 1, 2 ** 64 - 1)))
    out.append(join(P.pack(b"UCXM", 1, 0, 0, 0, 0)))
    out.append(join(b"UCXM\x02"))
    return out


def main(argv):
    from _atheris_main import run  # this folder: sys.path[0] when run as a script

    run(argv, test_one_input, seeds, "frames")


if __name__ == "__main__":
    main(sys.argv)
