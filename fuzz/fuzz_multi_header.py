"""Fuzz the recv_multi header/table decoder (ucxx/_lib_async/multi.py).

    python fuzz/fuzz_multi_header.py -runs=100000 [corpus_dir ...]

Input layout (so that seeds are easy to write): byte 0 selects the limits
(``recv_multi_max_frames`` from bits 0-1, ``recv_multi_max_bytes`` from bits
2-3), bytes 1-2 (uint16 LE) are the length of message 1 (the header
message), message 1 follows, and whatever remains is message 2 (the
separate frame table, used when the header's flag bit 0 asks for one).

The decoding below follows ``multi.recv_multi`` step by step (same checks,
same order) with the byte strings in place of received messages. A peer's
bytes may only ever produce ``UCXError`` (or ``UCXMessageTruncatedError``,
what UCX reports for a message longer than the posted receive); anything
else (struct.error, ValueError, MemoryError, IndexError...) is a bug, and
so is an accepted header whose frames break the limits or do not add up.

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
    with atheris.instrument_imports(include=["ucxx._lib_async.multi"]):
        from ucxx._lib_async import multi
else:
    from ucxx._lib_async import multi

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
    """Whether recv_multi will receive message 2 (the separate table)."""
    return len(msg1) >= multi.PREFIX_SIZE and bool(msg1[5] & multi.FLAG_TABLE_FOLLOWS)


def decode(max_frames: int, max_bytes: int, msg1: bytes, msg2: bytes):
    """recv_multi's decoding of received messages ``msg1`` (header) and
    ``msg2`` (separate table): (sizes, memtypes) or UCXError."""
    if len(msg1) > multi.HEADER_MAX:
        # UCX: the header receive is HEADER_MAX bytes long.
        from ucxx._ucxx import UCXMessageTruncatedError

        raise UCXMessageTruncatedError("Message truncated")
    data = memoryview(bytearray(msg1))
    n = len(msg1)
    flags, count, total = multi.decode_prefix(data, max_frames, max_bytes)
    if flags & multi.FLAG_TABLE_FOLLOWS:
        if n != multi.PREFIX_SIZE:
            raise UCXError(f"recv_multi: header of {n} bytes with a separate table")
        table = bytearray(9 * count)
        got = min(len(msg2), len(table))
        if len(msg2) > len(table):
            from ucxx._ucxx import UCXMessageTruncatedError

            raise UCXMessageTruncatedError("Message truncated")
        table[:got] = msg2[:got]
        if got != len(table):
            raise UCXError("recv_multi: short frame table")
    else:
        table = data[multi.PREFIX_SIZE:]
    return multi.decode_table(table, count, total)


def test_one_input(data: bytes) -> None:
    parts = split(data)
    if parts is None:
        return
    max_frames, max_bytes, msg1, msg2 = parts
    try:
        sizes, memtypes = decode(max_frames, max_bytes, msg1, msg2)
    except UCXError:
        return
    # Accepted: everything the receiver relies on holds.
    count = len(sizes)
    assert count == len(memtypes), (count, len(memtypes))
    assert count <= max_frames, (count, max_frames)
    assert sum(sizes) <= max_bytes, (sum(sizes), max_bytes)
    assert all(s >= 0 for s in sizes)
    assert all(m in (multi.MEM_HOST, multi.MEM_CUDA) for m in memtypes)
    # And the sender's encoder produces what was accepted.
    msgs = multi.encode_header(list(sizes), list(memtypes))
    again = decode(max_frames, max_bytes, msgs[0], msgs[1] if len(msgs) > 1 else b"")
    assert tuple(again[0]) == tuple(sizes) and bytes(again[1]) == bytes(memtypes)


def seeds() -> list[bytes]:
    P = multi._PREFIX
    out = []
    for sizes, mts in (([], []), ([5], [0]), ([0, 1, 2], [0, 1, 0]), ([7] * 500, [0] * 500)):
        msgs = multi.encode_header(sizes, mts)
        out.append(join(msgs[0], msgs[1] if len(msgs) > 1 else b""))
    out.append(join(P.pack(b"UCXM", 1, 0, 0, 1, 5) + struct.pack("<Q", 6) + b"\0"))
    out.append(join(P.pack(b"UCXM", 1, 1, 0, 2, 3), struct.pack("<QQ", 1, 2) + b"\0\1"))
    out.append(join(P.pack(b"UCXM", 1, 0, 0, 2 ** 32 - 1, 2 ** 64 - 1)))
    out.append(join(b"UCXM\x01"))
    return out


def main(argv):
    from _atheris_main import run  # this folder: sys.path[0] when run as a script

    run(argv, test_one_input, seeds, "multi")


if __name__ == "__main__":
    main(sys.argv)
