"""Fuzz the connection handshake decoder
(``ucxx/_lib_async/exchange_peer_info.py``: ``decode_peer``: the message,
then the identity block it may announce).

    python fuzz/fuzz_handshake.py -runs=100000 [corpus_dir ...]

The input is the peer's message as received. A peer's bytes may only
produce ``UCXError``; an accepted message must be exactly what ``pack``
builds from the tags it decoded to (with the flags it carried), and
``pack``/``unpack`` must round-trip for any tags and flags.

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
except ImportError:
    atheris = None

if atheris is not None:
    with atheris.instrument_imports(include=["ucxx._lib_async.exchange_peer_info"]):
        from ucxx._lib_async import exchange_peer_info as hs
else:
    from ucxx._lib_async import exchange_peer_info as hs
from ucxx._lib_async import liveness  # noqa: E402

from ucxx.exceptions import UCXError  # noqa: E402


def test_one_input(data: bytes) -> None:
    try:
        info = hs.unpack(data)
    except UCXError:
        pass
    else:
        assert len(data) == hs.MSG_SIZE
        flags = struct.unpack_from("<H", data, 6)[0]
        assert hs.pack(info.recv_tag, info.ctrl_tag, flags=flags) == bytes(data)
        assert info.version == hs.VERSION
    try:
        info, pid = hs.decode_peer(data)
    except UCXError:
        pass
    else:
        assert info == hs.unpack(data[:hs.MSG_SIZE])
        if info.flags & hs.FLAG_IDENTITY:
            assert len(data) >= hs.MSG_SIZE + liveness.IDENT_SIZE
        assert pid is None or pid[0] > 0
    # Round trip of whatever tags the input spells.
    if len(data) >= 18:
        a, b = struct.unpack_from("<QQ", data, 0)
        f = data[16] | (data[17] << 8)
        back = hs.unpack(hs.pack(a, b, flags=f))
        assert (back.recv_tag, back.ctrl_tag) == (a, b)


def seeds() -> list[bytes]:
    good = hs.pack(0x1234, 0x5678)
    ident = hs.pack(3, 4, flags=hs.FLAG_IDENTITY) + liveness.identity()
    return [good, hs.pack(2 ** 64 - 1, 0, flags=7), good[:20], good + b"x",
            b"X" * hs.MSG_SIZE, hs.pack(1, 2, version=2), good[:-1] + b"\0",
            ident, ident[:-1] + b"\0", ident[:40]]


def main(argv):
    from _atheris_main import run  # this folder: sys.path[0] when run as a script

    run(argv, test_one_input, seeds, "handshake")


if __name__ == "__main__":
    main(sys.argv)
