"""The public Listener and the per-connection server-side handler."""

from __future__ import annotations

import asyncio
import inspect
import logging
import threading
import traceback
import weakref

from ..exceptions import UCXError, UCXMessageTruncatedError
from .endpoint import Endpoint
from .exchange_peer_info import exchange_peer_info, new_tag

logger = logging.getLogger("ucx")


def _log_exception(message: str) -> None:
    """Log the exception being handled with its traceback as text: the log
    record keeps no frame (and so no endpoint or context) alive."""
    logger.error("%s\n%s", message, traceback.format_exc().rstrip(), stacklevel=2)


class ActiveClients:
    """Connection handlers still running, per listener id (an application
    context has one of these for all its listeners)."""

    def __init__(self):
        self._lock = threading.Lock()
        self._active: dict[int, int] = {}

    def add_listener(self, ident: int) -> None:
        with self._lock:
            if ident in self._active:
                raise ValueError(f"Listener {ident} is already registered")
            self._active[ident] = 0

    def remove_listener(self, ident: int) -> None:
        """Forget the listener; RuntimeError if handlers still run (then it
        stays registered: they still decrement it)."""
        with self._lock:
            n = self._active.get(ident, 0)
            if n > 0:
                raise RuntimeError(
                    f"Listener {ident} is being removed with {n} active client(s)"
                )
            self._active.pop(ident, None)

    def inc(self, ident: int) -> None:
        with self._lock:
            self._active[ident] = self._active.get(ident, 0) + 1

    def dec(self, ident: int) -> None:
        with self._lock:
            n = self._active.get(ident, 0)
            if n == 0:
                raise ValueError(f"There are no active clients for listener {ident}")
            self._active[ident] = n - 1

    def get_active(self, ident: int) -> int:
        return self._active.get(ident, 0)


class _ListenerState:
    """What the C listener's callback needs. Holds no reference to the
    public Listener, so dropping the Listener stops listening."""

    __slots__ = (
        "ctx", "callback", "error_handling", "connect_timeout", "ident",
        "active_clients", "tasks", "__weakref__",
    )

    def __init__(self, ctx, callback, error_handling, connect_timeout, ident, active_clients):
        self.ctx = ctx
        self.callback = callback
        self.error_handling = error_handling
        self.connect_timeout = connect_timeout
        self.ident = ident
        self.active_clients = active_clients
        self.tasks: set[asyncio.Task] = set()

    def on_connection(self, c_ep) -> None:
        """Called by the C listener, from the event loop, per connection."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(
            _listener_handler_coroutine(
                c_ep, self.ctx, self.callback, self.error_handling,
                self.connect_timeout, self.ident, self.active_clients,
            ),
            name=f"ucxx-accept-{c_ep.uid:#x}",
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.ctx._track_task(task)


async def _listener_handler_coroutine(
    conn_request,
    ctx,
    func,
    endpoint_error_handling,
    connect_timeout,
    ident,
    active_clients,
):
    """One accepted connection: handshake on the C endpoint
    ``conn_request``, adopt it as an Endpoint, run the listener's callback.

    Every failure is logged (logger ``"ucx"``, as text: the record keeps no
    frame alive); the references this frame holds are dropped before the
    connection stops counting as active."""
    active_clients.inc(ident)
    endpoint = None
    ep = None
    try:
        endpoint = conn_request
        msg_tag, ctrl_tag = new_tag(), new_tag()
        try:
            try:
                peer_info = await exchange_peer_info(
                    endpoint=endpoint,
                    msg_tag=msg_tag,
                    ctrl_tag=ctrl_tag,
                    listener=True,
                    connect_timeout=connect_timeout,
                )
            except UCXMessageTruncatedError:
                # The peer sent more than a handshake (or closed mid-way):
                # its endpoint error, if any, says more.
                endpoint.raise_on_error()
                raise
        except UCXError as e:
            # The peer went away, stayed silent or is no ucxx peer: nothing
            # unexpected for a listener (the endpoint is aborted already).
            logger.warning("Listener: incoming connection dropped: %s", e)
            return
        tags = {
            "msg_send": peer_info["msg_tag"],
            "msg_recv": msg_tag,
            "ctrl_send": peer_info.get("ctrl_tag"),
            "ctrl_recv": ctrl_tag,
            "peer_pid": peer_info.get("peer_pid"),
        }
        try:
            ep = Endpoint(endpoint=endpoint, ctx=ctx, tags=tags)
        except BaseException:
            _abort(endpoint)
            raise
        logger.debug(
            "Listener: accepted endpoint %#x (error handling %s, send tag %#x, "
            "recv tag %#x)",
            endpoint.handle, endpoint_error_handling, tags["msg_send"], msg_tag,
        )
        try:
            result = func(ep)
            if inspect.isawaitable(result):
                await result
        except asyncio.CancelledError:
            raise
        except Exception:
            _log_exception("Uncaught listener callback error")
    except asyncio.CancelledError:
        if ep is None:
            _abort(endpoint)
        raise
    except Exception:
        _log_exception("Unexpected error in listener handler coroutine")
    finally:
        ctx = None
        endpoint = None
        conn_request = None
        ep = None
        active_clients.dec(ident)


def _abort(endpoint) -> None:
    abort = getattr(endpoint, "abort", None)
    if abort is not None:
        abort()


def _finalize(c_listener, ident: int, active_clients: ActiveClients) -> None:
    """The public Listener was closed or collected: stop listening; warn if
    connection handlers still run (the application dropped its listener
    before its clients were served)."""
    c_listener.close()
    try:
        active_clients.remove_listener(ident)
    except RuntimeError:
        logger.warning(
            "Listener object is being destroyed, but %d client handler(s) "
            "is(are) still alive. This usually indicates the Listener was "
            "prematurely destroyed.",
            active_clients.get_active(ident),
        )


class Listener:
    """A listening endpoint, from ``ucxx.create_listener()``.

    Listening stops on ``close()`` or when this object is garbage-collected:
    keep a reference to it.
    """

    def __init__(self, c_listener, state: _ListenerState):
        self._listener = c_listener
        self._state = state
        self._ident = state.ident
        state.active_clients.add_listener(state.ident)
        self._finalizer = weakref.finalize(
            self, _finalize, c_listener, state.ident, state.active_clients
        )

    @property
    def port(self) -> int:
        """The listening port."""
        return self._listener.port

    @property
    def ip(self) -> str:
        """The listening IP address."""
        return self._listener.ip

    @property
    def closed(self) -> bool:
        """True once closed."""
        return bool(self._listener.closed)

    @property
    def active_clients(self) -> int:
        """Connections whose handshake or callback is still running."""
        return self._state.active_clients.get_active(self._ident)

    def close(self) -> None:
        """Stop listening. Idempotent. Established endpoints stay open."""
        self._listener.close()

    def __repr__(self) -> str:
        if self._listener.closed:
            return "<ucxx.Listener closed>"
        return f"<ucxx.Listener {self.ip}:{self.port}>"
