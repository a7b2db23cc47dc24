"""The public Endpoint: a thin wrapper around the C endpoint.

The per-message methods (``send``, ``recv``, ``gather_send``,
``gather_recv``, ``am_send``, ``am_recv``, ...) are the C endpoint's bound
methods stored as instance attributes: ``await ep.send(buf)`` calls C
directly and awaits the C Request, with no Python frame in between.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import struct
import weakref

from .. import _ucxx
from ..exceptions import UCXError, UCXMessageTruncatedError
from . import multi
from .utils import callable_bool

logger = logging.getLogger("ucx")

# Control messages (docs/PROTOCOL.md, "Connection handshake"), sent on the
# peer's control tag.
CTRL_MAGIC = b"UCXC"
CTRL_VERSION = 1
CTRL_CLOSE = 1
CTRL_CLOSE_ACK = 2
_CTRL = struct.Struct("<4sHHQ")
CTRL_SIZE = _CTRL.size  # 16
_CLOSE_MSG = _CTRL.pack(CTRL_MAGIC, CTRL_VERSION, CTRL_CLOSE, 0)
_CLOSE_ACK_MSG = _CTRL.pack(CTRL_MAGIC, CTRL_VERSION, CTRL_CLOSE_ACK, 0)

_OBJ_HEADER = struct.Struct("<Q")


def _close_by_peer(c_ep) -> None:
    """Local abort after the peer announced its close. The C layer keeps
    matching receives against messages that had already arrived."""
    close_by_peer = getattr(c_ep, "_close_by_peer", None)
    if close_by_peer is not None:
        close_by_peer()
    else:
        c_ep.abort()


async def _watch_ctrl(c_ep, ctrl_tag: int, peer_ctrl_tag: int, timeout: float, wref):
    """Keep one receive posted on our control tag; act on what arrives.

    Returns the kind of control message received (CTRL_CLOSE or
    CTRL_CLOSE_ACK), or None if the receive ended without one: the endpoint
    was closed or aborted locally (UCXCanceledError), or the peer died
    (UCXConnectionResetError, ...). ``Endpoint._close`` awaits this task to
    learn that the peer has seen its close message.
    """
    buf = bytearray(CTRL_SIZE)
    try:
        await c_ep.tag_recv(buf, ctrl_tag)
    except UCXMessageTruncatedError:
        logger.warning(
            "Endpoint %#x: oversized control message from the peer; aborting",
            c_ep.uid,
        )
        c_ep.abort()
        return None
    except UCXError as e:
        logger.debug("Endpoint %#x: control receive ended: %r", c_ep.uid, e)
        return None
    except asyncio.CancelledError:
        # The loop is shutting down: leave the endpoint to its owner.
        return None
    magic, _version, kind, _ = _CTRL.unpack(buf)
    if magic != CTRL_MAGIC or kind not in (CTRL_CLOSE, CTRL_CLOSE_ACK):
        logger.warning(
            "Endpoint %#x: unknown control message %r; aborting", c_ep.uid, bytes(buf)
        )
        c_ep.abort()
        return None
    ep = wref()
    if kind == CTRL_CLOSE and not (ep is not None and ep._closing):
        # The peer closes: acknowledge (so it can close at once), then close
        # locally. Our pending receives fail with UCXCanceledError.
        logger.debug("Endpoint %#x: peer closed the connection", c_ep.uid)
        if ep is not None:
            ep._closing = True
        del ep
        try:
            await asyncio.wait_for(_await(c_ep.tag_send(_CLOSE_ACK_MSG, peer_ctrl_tag)), timeout)
        except (UCXError, asyncio.TimeoutError) as e:
            logger.debug("Endpoint %#x: close ack not sent: %r", c_ep.uid, e)
        _close_by_peer(c_ep)
    # CTRL_CLOSE_ACK, or the peer's CTRL_CLOSE while we are closing too: the
    # closing side (Endpoint._close) finishes the job.
    return kind


def _finalize(c_ep) -> None:
    """Abort the C endpoint when its wrapper is garbage-collected."""
    try:
        if not c_ep.closed:
            logger.debug("Endpoint %#x collected while open: aborting", c_ep.uid)
            c_ep.abort()
    except Exception:  # pragma: no cover - interpreter shutdown
        pass


class Endpoint:
    """A connection to a peer.

    Create one with ``ucxx.create_endpoint()``, ``ucxx.create_listener()``
    (delivered to the callback) or ``ucxx.create_endpoint_from_worker_address()``.

    ``await ep.send(buf, tag=None, force_tag=False)`` /
    ``await ep.recv(buf, tag=None, force_tag=False)``: tagged transfer of
    one buffer (anything with the buffer protocol, or
    ``__cuda_array_interface__``). With ``tag=None`` the connection's tags
    agreed in the handshake are used; a user tag is mixed with them unless
    ``force_tag=True``. ``recv`` returns the number of bytes received.

    ``await ep.gather_send(list)`` / ``await ep.gather_recv(list)``: several
    buffers as one operation (small host buffers as one IOV message; see
    docs/ENGINE.md, "Gathers"), one awaitable; the receiver's buffers must
    have the sender's sizes and memory types.
    """

    def __init__(self, c_ep, ctx=None, ctrl_send_tag=None, ctrl_recv_tag=None):
        if not isinstance(c_ep, _ucxx.Endpoint):
            raise TypeError("c_ep must be a ucxx._ucxx.Endpoint")
        self._ep = c_ep
        self._ctx = ctx
        # Hot path: the C endpoint's methods, bound once.
        self.send = c_ep.send
        self.recv = c_ep.recv
        self.tag_send = c_ep.tag_send
        self.tag_recv = c_ep.tag_recv
        self.gather_send = c_ep.gather_send
        self.gather_recv = c_ep.gather_recv
        self.stream_send = c_ep.stream_send
        self.stream_recv = c_ep.stream_recv
        self.am_send = c_ep.am_send
        self.am_recv = c_ep.am_recv

        self._ctrl_send_tag = ctrl_send_tag
        self._ctrl_recv_tag = ctrl_recv_tag
        self._ctrl_task: asyncio.Task | None = None
        self._closing = False
        self._close_task: asyncio.Future | None = None
        self._close_cb = None
        self._multi_lock: asyncio.Lock | None = None
        self.recv_multi_max_frames = multi.DEFAULT_MAX_FRAMES
        self.recv_multi_max_bytes = multi.DEFAULT_MAX_BYTES
        if ctx is not None:
            self.recv_multi_max_frames = ctx.recv_multi_max_frames
            self.recv_multi_max_bytes = ctx.recv_multi_max_bytes
        self._finalizer = weakref.finalize(self, _finalize, c_ep)
        if ctrl_recv_tag is not None:
            self._start_ctrl_watch()

    # ----------------------------------------------------------------- state
    def _start_ctrl_watch(self) -> None:
        loop = asyncio.get_running_loop()
        timeout = self._ctx.connect_timeout if self._ctx is not None else 5.0
        task = loop.create_task(
            _watch_ctrl(
                self._ep, self._ctrl_recv_tag, self._ctrl_send_tag, timeout,
                weakref.ref(self),
            ),
            name=f"ucxx-ctrl-{self._ep.uid:#x}",
        )
        self._ctrl_task = task
        if self._ctx is not None:
            self._ctx._track_task(task)

    @property
    def alive(self) -> bool:
        """False once the endpoint is closed or the peer is gone."""
        return self._ep.alive

    @property
    def closed(self):
        """True once closed (locally, by the peer, or by an error).

        Usable both as a property (``ep.closed``) and as a method
        (``ep.closed()``)."""
        ep = self._ep
        return callable_bool(ep.closed or not ep.alive)

    @property
    def uid(self) -> int:
        """Unique id of the underlying UCX endpoint."""
        return self._ep.uid

    @property
    def ucp_endpoint(self) -> int:
        """The ``ucp_ep_h`` as an int."""
        return self._ep.handle

    @property
    def ucp_worker(self) -> int:
        """The ``ucp_worker_h`` as an int."""
        return self._ep.worker.handle

    @property
    def worker(self):
        return self._ep.worker

    @property
    def send_tag(self) -> int:
        return self._ep.send_tag

    @property
    def recv_tag(self) -> int:
        return self._ep.recv_tag

    def __repr__(self) -> str:
        try:
            state = "closed" if self.closed else ("alive" if self.alive else "failed")
            return f"<ucxx.Endpoint uid={self.uid:#x} {state}>"
        except Exception:  # pragma: no cover
            return "<ucxx.Endpoint>"

    # --------------------------------------------------------------- closing
    def set_close_callback(self, callback, cb_args=None, cb_kwargs=None) -> None:
        """Call ``callback(*cb_args, **cb_kwargs)`` once, from the event loop,
        when the endpoint closes (locally or by the peer) or fails."""
        if callback is not None and (cb_args or cb_kwargs):
            callback = functools.partial(callback, *(cb_args or ()), **(cb_kwargs or {}))
        self._close_cb = callback
        self._ep.set_close_callback(callback)

    def abort(self, *args, **kwargs) -> None:
        """Close immediately, without telling the peer. Pending operations
        fail with UCXCanceledError. Idempotent. (Extra arguments are
        accepted for compatibility and ignored.)"""
        self._closing = True
        self._ep.abort()

    def close(self, *args, **kwargs):
        """Gracefully close: tell the peer, flush, close. Awaitable and
        idempotent: every call returns the same awaitable. (Extra arguments
        are accepted for compatibility and ignored.)"""
        fut = self._close_task
        if fut is None:
            fut = self._close_task = asyncio.ensure_future(self._close())
        return fut

    async def _close(self) -> None:
        c_ep = self._ep
        already_closing = self._closing
        self._closing = True
        if already_closing or c_ep.closed or not c_ep.alive:
            c_ep.abort()
            return
        timeout = self._ctx.connect_timeout if self._ctx is not None else 5.0
        ctrl = self._ctrl_task
        try:
            if ctrl is not None and not ctrl.done():
                # Tell the peer, wait until it has seen it (its ack, its own
                # close message, or the connection going away), then close.
                await asyncio.wait_for(_await(c_ep.tag_send(_CLOSE_MSG, self._ctrl_send_tag)), timeout)
                await asyncio.wait_for(asyncio.shield(ctrl), timeout)
            elif ctrl is None:
                # No control channel (endpoint from a worker address): UCX's
                # flushing close.
                await asyncio.wait_for(_await(c_ep.close()), timeout)
        except (UCXError, asyncio.TimeoutError) as e:
            logger.debug("Endpoint %#x: graceful close incomplete (%r)", c_ep.uid, e)
        finally:
            c_ep.abort()

    # ------------------------------------------------------ composite messages
    async def send_obj(self, obj, tag=None, force_tag=False) -> None:
        """Send a buffer-like ``obj`` to a peer calling ``recv_obj()``: a size
        header message, then the payload (docs/PROTOCOL.md)."""
        nbytes = memoryview(obj).nbytes if not hasattr(obj, "__cuda_array_interface__") else _cuda_nbytes(obj)
        # One C call posts both messages, in order, on the same tag (the
        # size header as a message of its own).
        await self._ep.gather_send((obj,), tag, force_tag, header=(_OBJ_HEADER.pack(nbytes),))

    async def recv_obj(self, tag=None, allocator=bytearray, force_tag=False):
        """Receive an object sent with ``send_obj()``; returns
        ``allocator(nbytes)`` filled with the payload (bytearray by default)."""
        header = bytearray(_OBJ_HEADER.size)
        n = await self._ep.recv(header, tag, force_tag)
        if n is not None and n != _OBJ_HEADER.size:
            raise UCXError(f"recv_obj: malformed size header ({n} bytes)")
        (nbytes,) = _OBJ_HEADER.unpack(header)
        if nbytes > self.recv_multi_max_bytes:
            raise UCXError(
                f"recv_obj: the peer announced {nbytes} bytes, more than the "
                f"limit of {self.recv_multi_max_bytes} (recv_multi_max_bytes)"
            )
        buf = allocator(nbytes)
        await self._ep.recv(buf, tag, force_tag)
        return buf

    async def send_multi(self, buffers, tag=None, force_tag=False) -> None:
        """Send a list of buffers to a peer calling ``recv_multi()``: a header
        (count, sizes, memory types), then the frames (docs/PROTOCOL.md)."""
        await multi.send_multi(self, buffers, tag, force_tag)

    async def recv_multi(self, tag=None, force_tag=False) -> list:
        """Receive the frames of one ``send_multi()``; host frames come back
        as numpy ``uint8`` arrays."""
        return await multi.recv_multi(self, tag, force_tag)

    # ------------------------------------------------------------ deprecated
    def is_alive(self) -> bool:
        return self.alive

    def get_ucp_endpoint(self) -> int:
        return self.ucp_endpoint

    def get_ucp_worker(self) -> int:
        return self.ucp_worker


async def _await(aw):
    return await aw


def _cuda_nbytes(obj) -> int:
    iface = obj.__cuda_array_interface__
    n = 1
    for d in iface["shape"]:
        n *= d
    itemsize = int(iface["typestr"][2:])
    return n * itemsize
