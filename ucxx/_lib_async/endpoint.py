"""The public Endpoint: a Python subclass of the C endpoint.

A C endpoint (``ucxx._ucxx.Endpoint``, from a worker or a listener) becomes
a public :class:`Endpoint` when the asyncio layer adopts it
(``Endpoint(c_ep, ctx, tags)``): its class is switched to this subclass,
which adds no instance layout (``__slots__ = ()``). The per-message methods
(``send``, ``recv``, ``gather_send``, ``gather_recv``, ``am_send``,
``am_recv``, ...) are therefore the C methods, found on the class: ``await
ep.send(buf)`` calls C directly and awaits the C Request, with no Python
frame in between, and ``unittest.mock.patch.object(ucxx.Endpoint, "send",
...)`` or ``inspect.signature(ucxx.Endpoint.send)`` work as on any class.

What the Python layer keeps per endpoint lives in one ``_EndpointState``
object in the C endpoint's ``_state`` slot. Nothing the library keeps
internally (the control-message watcher, the close callback) refers to the
endpoint itself, so an endpoint the application dropped is collected (and
aborted) like any object, which is what ``ucxx.reset()`` relies on.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import os
import struct
import weakref

from .. import _ucxx
from ..types import Tag
from ..exceptions import UCXCanceledError, UCXError, UCXMessageTruncatedError
from . import liveness, multi
from .utils import callable_bool, get_event_loop

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

_C = _ucxx.Endpoint
_c_closed = _C.closed.__get__  # the C endpoint's own `closed`
DEFAULT_CLOSE_TIMEOUT = 5.0


class _EndpointState:
    """The asyncio layer's state of one public Endpoint (its ``_state``).
    Refers to no endpoint: internal tasks and callbacks hold this object
    (and a weak reference to the endpoint) instead."""

    __slots__ = (
        "ctx",
        "timeout",
        "ctrl_send_tag",
        "ctrl_recv_tag",
        "ctrl_task",
        "ctrl_req",
        "closing",
        "dropped",
        "closer",
        "close_cb",
        "close_cb_done",
        "multi_lock",
        "recv_multi_max_frames",
        "recv_multi_max_bytes",
        "close_after",
        "finished_recv",
        "close_msg",
        "pidfd",
        "pidfd_loop",
        "__weakref__",
    )

    def __init__(self, ctx, ctrl_send_tag, ctrl_recv_tag):
        self.ctx = ctx
        self.timeout = ctx.connect_timeout if ctx is not None else DEFAULT_CLOSE_TIMEOUT
        self.ctrl_send_tag = ctrl_send_tag
        self.ctrl_recv_tag = ctrl_recv_tag
        self.ctrl_task = None
        self.ctrl_req = None
        self.closing = False
        self.dropped = False
        self.closer = None
        self.close_cb = None
        self.close_cb_done = False
        self.multi_lock = None
        self.recv_multi_max_frames = getattr(ctx, "recv_multi_max_frames", multi.DEFAULT_MAX_FRAMES)
        self.recv_multi_max_bytes = getattr(ctx, "recv_multi_max_bytes", multi.DEFAULT_MAX_BYTES)
        self.close_after = None
        self.finished_recv = 0
        self.close_msg = None  # the posted close message's Request
        self.pidfd = None  # the peer process's pidfd, watched on pidfd_loop
        self.pidfd_loop = None

    def stop_liveness(self) -> None:
        """End the watch of the peer process (liveness.py)."""
        fd, self.pidfd = self.pidfd, None
        if fd is not None:
            liveness.unwatch(self.pidfd_loop, fd)
        self.pidfd_loop = None

    def __del__(self):
        # The loop closed with the watch on (its reader kept this alive).
        if self.pidfd is not None:
            os.close(self.pidfd)

    def stop_ctrl(self) -> None:
        """Cancel the control receive (a worker-level receive: the endpoint
        closing does not end it by itself)."""
        req = self.ctrl_req
        self.ctrl_req = None
        if req is not None and not req.done():
            req.cancel()


def _on_c_close(state: _EndpointState) -> None:
    """The C endpoint's close callback (run from the loop once it closed,
    was aborted, failed or was collected): end the control watcher and the
    peer process's watch, then run the application's callback."""
    state.stop_ctrl()
    state.stop_liveness()
    state.close_cb_done = True
    cb, state.close_cb = state.close_cb, None
    if cb is not None:
        cb()


def _on_peer_exit(state: _EndpointState, wref) -> None:
    """The peer process exited: the endpoint fails (UCXConnectionResetError)."""
    state.stop_liveness()
    ep = wref()
    if ep is not None:
        _C._peer_exited(ep)


async def _watch_ctrl(req, buf, state: _EndpointState, wref):
    """Wait for the receive ``req`` posted on our control tag; act on what
    arrives in ``buf``.

    Returns the kind of control message received (CTRL_CLOSE or
    CTRL_CLOSE_ACK), or None if the receive ended without one (the endpoint
    closed, failed or was collected, or the loop shut down).
    ``Endpoint._close`` awaits this task to learn that the peer has seen its
    close message.
    """
    try:
        await req
    except UCXMessageTruncatedError:
        ep = wref()
        if ep is not None:
            logger.warning(
                "Endpoint %#x: oversized control message from the peer; aborting", ep.uid
            )
            ep.abort()
        return None
    except UCXError as e:
        logger.debug("control receive ended: %r", e)
        return None
    except asyncio.CancelledError:
        # The loop is shutting down: leave the endpoint to its owner.
        state.stop_ctrl()
        return None
    finally:
        if state.ctrl_req is req:
            state.ctrl_req = None
    magic, _version, kind, _ = _CTRL.unpack(buf)
    ep = wref()
    if ep is None:
        return None
    if magic != CTRL_MAGIC or kind not in (CTRL_CLOSE, CTRL_CLOSE_ACK):
        logger.warning(
            "Endpoint %#x: unknown control message %r; aborting", ep.uid, bytes(buf)
        )
        ep.abort()
        return None
    if kind == CTRL_CLOSE and not state.closing:
        # The peer closes: acknowledge (so it can close at once), then close
        # locally. Our pending receives fail with UCXCanceledError.
        logger.debug("Endpoint %#x: peer closed the connection", ep.uid)
        state.closing = True
        ack = _C.tag_send(ep, _CLOSE_ACK_MSG, state.ctrl_send_tag)
        try:
            # Usually sent at once (eager): then this task ends without
            # another loop turn, so nothing of it outlives the close.
            if not ack.done():
                ep = None  # the wait must not keep the endpoint alive
                await asyncio.wait_for(_await(ack), state.timeout)
                ep = wref()
            else:
                ack.result()
        except (UCXError, asyncio.TimeoutError) as e:
            logger.debug("close ack not sent: %r", e)
            ep = wref()
        if ep is not None:
            _C._close_by_peer(ep)
    # CTRL_CLOSE_ACK, or the peer's CTRL_CLOSE while we are closing too: the
    # closing side (Endpoint._close) finishes the job.
    return kind


class Endpoint(_ucxx.Endpoint):
    """A connection to a peer.

    Create one with ``ucxx.create_endpoint()``, ``ucxx.create_listener()``
    (delivered to the callback) or ``ucxx.create_endpoint_from_worker_address()``.

    ``await ep.send(buf, tag=None, force_tag=False)`` /
    ``await ep.recv(buf, tag=None, force_tag=False)``: tagged transfer of
    one buffer (anything with the buffer protocol, or
    ``__cuda_array_interface__``). With ``tag=None`` the connection's tags
    agreed in the handshake are used; a user tag (an int, or a str/bytes
    name) is mixed with them unless ``force_tag=True``. ``recv`` returns the
    number of bytes received.

    ``await ep.gather_send(list)`` / ``await ep.gather_recv(list)``: several
    buffers as one operation (small host buffers as one IOV message; see
    docs/ENGINE.md, "Gathers"), one awaitable; the receiver's buffers must
    have the sender's sizes and memory types.
    """

    __slots__ = ()

    def __new__(cls, endpoint, ctx=None, tags=None):
        """Adopt the C endpoint ``endpoint`` (it becomes this object).

        ``tags``: ``{"msg_send", "msg_recv", "ctrl_send", "ctrl_recv"}`` as
        agreed in the handshake (None: an endpoint from a worker address,
        which has no control channel), and ``"peer_pid"``: the peer
        process's (pid, start time) where it runs on this host, watched
        while the endpoint is open."""
        if type(endpoint) is not _C:
            raise TypeError(
                "endpoint must be a ucxx._ucxx.Endpoint not yet adopted, got "
                f"{type(endpoint).__name__}"
            )
        tags = tags or {}
        state = _EndpointState(ctx, tags.get("ctrl_send"), tags.get("ctrl_recv"))
        if tags.get("msg_send") is not None:
            endpoint.send_tag = tags["msg_send"]
        if tags.get("msg_recv") is not None:
            endpoint.recv_tag = tags["msg_recv"]
        endpoint._state = state
        _C.set_close_callback(endpoint, functools.partial(_on_c_close, state))
        endpoint.__class__ = cls
        if state.ctrl_recv_tag is not None and state.ctrl_send_tag is not None:
            endpoint._start_ctrl_watch()
        if tags.get("peer_pid") is not None:
            endpoint._start_liveness(*tags["peer_pid"])
        if ctx is not None:
            ctx._track_endpoint(endpoint)
        return endpoint

    # ----------------------------------------------------------------- state
    def _start_ctrl_watch(self) -> None:
        state = self._state
        loop = asyncio.get_running_loop()
        if not self.alive:
            return
        # Posted here, not in the task: the close callback that cancels it
        # may run before the task's first step.
        buf = bytearray(CTRL_SIZE)
        req = state.ctrl_req = self.worker.tag_recv(buf, state.ctrl_recv_tag)
        task = loop.create_task(
            _watch_ctrl(req, buf, state, weakref.ref(self)),
            name=f"ucxx-ctrl-{self.uid:#x}",
        )
        state.ctrl_task = task
        if state.ctx is not None:
            state.ctx._track_task(task)

    def _start_liveness(self, pid: int, start: int) -> None:
        state = self._state
        if not self.alive:
            return
        loop = asyncio.get_running_loop()
        on_exit = functools.partial(_on_peer_exit, state, weakref.ref(self))
        state.pidfd = liveness.watch(loop, pid, start, on_exit)
        if state.pidfd is not None:
            state.pidfd_loop = loop

    @property
    def _ep(self):
        """This endpoint (RAPIDS ucxx keeps its C endpoint here; here the
        endpoint is the C endpoint)."""
        return self

    @property
    def _ctx(self):
        """The ApplicationContext (None once aborted)."""
        return self._state.ctx

    @property
    def _tags(self) -> dict:
        return {"msg_send": self.send_tag, "msg_recv": self.recv_tag}

    @property
    def _ctrl_send_tag(self):
        return self._state.ctrl_send_tag

    @property
    def _closing(self) -> bool:
        return self._state.closing

    @property
    def _in_use(self) -> bool:
        """Neither closed (locally or by the peer) nor aborted, nor dropped
        by the application (then it closes by itself): what ``reset()``
        counts as still in use."""
        state = self._state
        return not (state.closing or state.dropped or self.peer_closed)

    @property
    def _multi_lock(self):
        return self._state.multi_lock

    @_multi_lock.setter
    def _multi_lock(self, lock) -> None:
        self._state.multi_lock = lock

    @property
    def recv_multi_max_frames(self) -> int:
        """Largest frame count a ``recv_multi()`` header may announce."""
        return self._state.recv_multi_max_frames

    @recv_multi_max_frames.setter
    def recv_multi_max_frames(self, n: int) -> None:
        self._state.recv_multi_max_frames = n

    @property
    def recv_multi_max_bytes(self) -> int:
        """Largest total size a ``recv_multi()``/``recv_obj()`` may announce."""
        return self._state.recv_multi_max_bytes

    @recv_multi_max_bytes.setter
    def recv_multi_max_bytes(self, n: int) -> None:
        self._state.recv_multi_max_bytes = n

    @property
    def closed(self):
        """True once closed (locally, by the peer, or by an error).

        Usable both as a property (``ep.closed``) and as a method
        (``ep.closed()``)."""
        return callable_bool(_c_closed(self) or not self.alive)

    @property
    def ucp_endpoint(self) -> int:
        """The ``ucp_ep_h`` as an int."""
        return self.handle

    @property
    def ucp_worker(self) -> int:
        """The ``ucp_worker_h`` as an int."""
        return self.worker.handle

    @property
    def ucxx_endpoint(self) -> int:
        """The address of this endpoint object (RAPIDS: its ``ucxx::Endpoint``)."""
        return id(self)

    @property
    def ucxx_worker(self) -> int:
        """The address of the worker object (RAPIDS: its ``ucxx::Worker``)."""
        return id(self.worker)

    # --------------------------------------------------------------- closing
    def set_close_callback(self, callback_func, cb_args=None, cb_kwargs=None) -> None:
        """Call ``callback_func(*cb_args, **cb_kwargs)`` once, from the event
        loop, when the endpoint closes (locally or by the peer) or fails.
        Set after that happened, it is called soon. None removes it."""
        cb = callback_func
        if cb is not None:
            if not callable(cb):
                raise TypeError("callback must be callable or None")
            if cb_args or cb_kwargs:
                cb = functools.partial(cb, *(cb_args or ()), **(cb_kwargs or {}))
        state = self._state
        if state.close_cb_done and cb is not None:
            get_event_loop().call_soon(cb)
            return
        state.close_cb = cb

    def abort(self, period=None, max_attempts=None) -> None:
        """Close immediately, without telling the peer. Pending operations
        fail with UCXCanceledError. Idempotent. (``period`` and
        ``max_attempts`` are accepted for compatibility: this abort does not
        wait.)"""
        state = self._state
        state.closing = True
        state.stop_ctrl()
        _C.abort(self)
        state.ctx = None

    async def close(self, period=None, max_attempts=None) -> None:
        """Gracefully close: tell the peer, wait until it has seen it (at
        most ``connect_timeout``), close. A coroutine: it runs on whatever
        loop awaits it. Idempotent; a close already running elsewhere is
        awaited. (``period`` and ``max_attempts`` are accepted for
        compatibility.)"""
        state = self._state
        loop = asyncio.get_running_loop()
        closer = state.closer
        if closer is not None:
            if not closer.done() and closer.get_loop() is loop:
                await asyncio.shield(closer)
            return
        closer = state.closer = loop.create_future()
        try:
            await self._close(loop)
        finally:
            closer.set_result(None)

    async def _close(self, loop) -> None:
        state = self._state
        already_closing = state.closing
        state.closing = True
        try:
            timeout = state.timeout
            ctrl = state.ctrl_task
            if already_closing or _c_closed(self) or not self.alive:
                # The peer closed first (or the endpoint failed): the watcher
                # may still be sending its ack. Close returns once it ended,
                # so that no task of this endpoint outlives the close.
                if ctrl is not None and not ctrl.done() and ctrl.get_loop() is loop:
                    await asyncio.wait_for(asyncio.shield(ctrl), timeout)
                return
            if ctrl is not None and not ctrl.done():
                # Tell the peer, wait until it has seen it (its ack, its own
                # close message, or the connection going away), then close.
                # Pending receives end with UCXCanceledError either way.
                _C._begin_close(self)
                if state.close_msg is None:
                    state.close_msg = _C.tag_send(self, _CLOSE_MSG, state.ctrl_send_tag)
                await asyncio.wait_for(_await(state.close_msg), timeout)
                if ctrl.get_loop() is loop:
                    await asyncio.wait_for(asyncio.shield(ctrl), timeout)
                else:
                    # The watcher runs on another loop: let UCX flush.
                    await asyncio.wait_for(_await(_C.close(self)), timeout)
            elif ctrl is None:
                # No control channel (endpoint from a worker address): UCX's
                # flushing close.
                await asyncio.wait_for(_await(_C.close(self)), timeout)
        except (UCXError, asyncio.TimeoutError) as e:
            logger.debug("Endpoint %#x: graceful close incomplete (%r)", self.uid, e)
        finally:
            self.abort()

    def close_after_n_recv(self, n, count_from_ep_creation=False) -> None:
        """Abort the endpoint once ``n`` more receives (``recv``,
        ``am_recv``, ``recv_multi``, ``recv_obj``, ``recv_with_handle``)
        completed, counted from now, or from the endpoint's creation with
        ``count_from_ep_creation``. Receives are counted as they complete
        only after this call; before it, the receives posted so far count."""
        state = self._state
        if state.close_after is not None:
            raise UCXError(
                "close_after_n_recv has already been set to: %d (abs)" % state.close_after
            )
        done = self.recv_count
        if not count_from_ep_creation:
            n += done
        if n == done:
            self.abort()
        elif n > done:
            state.finished_recv = done
            state.close_after = n
            self.__class__ = _CountingEndpoint
        else:
            raise UCXError(
                "`n` cannot be less than current recv_count: %d (abs) < %d (abs)" % (n, done)
            )

    # ------------------------------------------------------- tag probe / recv
    def tag_probe(self, tag=None, force_tag=False, remove=False):
        """Whether a message for ``recv(buf, tag, force_tag)`` has arrived,
        without receiving it (see :class:`TagProbeResult`). With ``remove``
        the message leaves UCX's queue: receive it with
        :meth:`recv_with_handle`. Does not progress the worker."""
        return TagProbeResult(self.worker.tag_probe(self.recv_tag_for(tag, force_tag), _FULL_MASK, bool(remove)))

    async def recv_with_handle(self, buffer, probe_result):
        """Receive the message a ``tag_probe(..., remove=True)`` took from
        the queue into ``buffer``. Returns the number of bytes received."""
        return await self.worker.tag_recv_with_handle(buffer, _probe_handle(probe_result))

    # ------------------------------------------------------ composite messages
    async def send_obj(self, obj, tag=None, force_tag=False) -> None:
        """Send a buffer-like ``obj`` to a peer calling ``recv_obj()``: a size
        header message, then the payload (docs/PROTOCOL.md)."""
        nbytes = memoryview(obj).nbytes if not hasattr(obj, "__cuda_array_interface__") else _cuda_nbytes(obj)
        # One C call posts both messages, in order, on the same tag (the
        # size header as a message of its own).
        await _C.gather_send(self, (obj,), tag, force_tag, header=(_OBJ_HEADER.pack(nbytes),))

    async def recv_obj(self, tag=None, allocator=bytearray, force_tag=False):
        """Receive an object sent with ``send_obj()``; returns
        ``allocator(nbytes)`` filled with the payload (bytearray by default)."""
        header = bytearray(_OBJ_HEADER.size)
        n = await _C.recv(self, header, tag, force_tag)  # counted: one recv_obj
        if n is not None and n != _OBJ_HEADER.size:
            raise UCXError(f"recv_obj: malformed size header ({n} bytes)")
        (nbytes,) = _OBJ_HEADER.unpack(header)
        if nbytes > self._state.recv_multi_max_bytes:
            raise UCXError(
                f"recv_obj: the peer announced {nbytes} bytes, more than the "
                f"limit of {self._state.recv_multi_max_bytes} (recv_multi_max_bytes)"
            )
        buf = allocator(nbytes)
        await _C.tag_recv(self, buf, self.recv_tag_for(tag, force_tag))
        return buf

    async def send_multi(self, buffers, tag=None, force_tag=False) -> None:
        """Send a list of buffers to a peer calling ``recv_multi()``: a header
        (count, sizes, memory types), then the frames (docs/PROTOCOL.md)."""
        await multi.send_multi(self, buffers, tag, force_tag)

    async def recv_multi(self, tag=None, force_tag=False) -> list:
        """Receive the frames of one ``send_multi()``; host frames come back
        as numpy ``uint8`` arrays."""
        return await multi.recv_multi(self, tag, force_tag)

    # ------------------------------------------------------------- lifetime
    def __del__(self, _abort=_C.abort, _closed=_c_closed):
        """Dropped while open: close gracefully in the background when this
        runs on the thread of a running loop (the peer's pending receives
        then fail with UCXCanceledError, as after ``close()``), else abort.
        (This replaces the C endpoint's finalizer, which warns: a public
        endpoint may be dropped, as in RAPIDS ucxx.)"""
        try:
            if _closed(self):
                return
            state = self._state
            if state is not None and not state.closing and state.ctrl_task is not None:
                try:
                    loop = asyncio.get_running_loop()
                except RuntimeError:
                    loop = None
                if loop is not None and not state.ctrl_task.done():
                    # The close message is posted now, the rest of the close
                    # runs in a task: the peer learns of it at its next
                    # progress, whenever this loop runs the task.
                    try:
                        state.close_msg = _C.tag_send(self, _CLOSE_MSG, state.ctrl_send_tag)
                    except UCXError:
                        pass  # failed meanwhile: the close task aborts it
                    task = loop.create_task(self.close(), name=f"ucxx-close-{self.uid:#x}")
                    state.dropped = True  # not live for reset()
                    if state.ctx is not None:
                        state.ctx._track_task(task)
                    return  # the task holds the endpoint until it is closed
            _abort(self)
        except BaseException:
            _abort(self)
            raise

    # ------------------------------------------------------------ deprecated
    def is_alive(self) -> bool:
        return self.alive

    def get_ucp_endpoint(self) -> int:
        return self.ucp_endpoint

    def get_ucp_worker(self) -> int:
        return self.ucp_worker


def _counting(name):
    base = getattr(Endpoint, name)

    @functools.wraps(base)
    async def method(self, *args, **kwargs):
        result = await base(self, *args, **kwargs)
        state = self._state
        state.finished_recv += 1
        if state.close_after is not None and state.finished_recv >= state.close_after:
            self.abort()
        return result

    return method


class _CountingEndpoint(Endpoint):
    """An Endpoint after ``close_after_n_recv()``: its receives count and
    the one that reaches the limit aborts it. (Only such endpoints pay for
    counting; the class is switched by ``close_after_n_recv``.)"""

    __slots__ = ()

    recv = _counting("recv")
    am_recv = _counting("am_recv")
    recv_multi = _counting("recv_multi")
    recv_obj = _counting("recv_obj")
    recv_with_handle = _counting("recv_with_handle")


_FULL_MASK = (1 << 64) - 1


class TagProbeResult:
    """The answer of a tag probe: ``matched``; when matched, ``sender_tag``
    (a :class:`ucxx.types.Tag`), ``length`` (bytes) and, for a probe with
    ``remove=True``, ``handle`` (for ``recv_with_handle``; else None)."""

    __slots__ = ("matched", "sender_tag", "length", "handle")

    def __init__(self, found):
        self.matched = found is not None
        if found is None:
            self.sender_tag = self.length = self.handle = None
        else:
            tag, self.length, self.handle = found
            self.sender_tag = Tag(tag)

    def __repr__(self) -> str:
        if not self.matched:
            return "<TagProbeResult matched=False>"
        return (
            f"<TagProbeResult matched=True sender_tag={int(self.sender_tag):#x} "
            f"length={self.length} handle={'yes' if self.handle is not None else 'no'}>"
        )


def _probe_handle(probe_result):
    handle = getattr(probe_result, "handle", None)
    if handle is None:
        raise ValueError(
            "recv_with_handle() needs the result of a matched tag_probe(..., remove=True)"
        )
    return handle


async def _await(aw):
    return await aw


def _cuda_nbytes(obj) -> int:
    iface = obj.__cuda_array_interface__
    n = 1
    for d in iface["shape"]:
        n *= d
    itemsize = int(iface["typestr"][2:])
    return n * itemsize


__all__ = ["Endpoint", "TagProbeResult", "UCXCanceledError"]
