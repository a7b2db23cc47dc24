"""``send_multi`` / ``recv_multi``: several frames with a self-describing
header, in the one multi-frame format of :mod:`.frames` (docs/PROTOCOL.md,
"Multi-frame messages"): the header message, then the frames as one
gathered operation.

The sender posts header and frames with one C call. The receiver receives
the header, allocates the frames it announces (numpy ``uint8`` for host,
rmm/cupy/numba for device memory) and posts one ``gather_recv``; a lock per
endpoint covers the header receive up to that post, so concurrent
``recv_multi`` calls on one endpoint take whole messages, in order.
"""

from __future__ import annotations

import asyncio
import os

from .. import _ucxx
from . import frames as _frames

# The C methods, called on the endpoint explicitly: an Endpoint subclass
# (close_after_n_recv's) wraps the public ones, and counts a recv_multi once.
_C = _ucxx.Endpoint


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


def _host_alloc(n: int):
    import numpy as np

    return np.empty(n, dtype=np.uint8)


async def send_multi(ep, buffers, tag=None, force_tag=False) -> None:
    if not isinstance(buffers, (list, tuple)):
        raise ValueError("The `buffers` argument must be a `list` or `tuple`")
    await _frames.post_frames(ep, buffers, tag, force_tag)


async def recv_multi(ep, tag=None, force_tag=False) -> list:
    lock = ep._multi_lock
    if lock is None:
        lock = ep._multi_lock = asyncio.Lock()

    def recv(buf):
        return _C.recv(ep, buf, tag, force_tag)

    async with lock:
        _app, frames = await _frames.recv_header(
            recv, ep.recv_multi_max_frames, ep.recv_multi_max_bytes, _host_alloc
        )
        req = _C.gather_recv(ep, frames, tag, force_tag) if frames else None
    if req is not None:
        await req
    return frames
