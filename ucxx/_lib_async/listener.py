"""The public Listener and the per-connection server-side handler."""

from __future__ import annotations

import asyncio
import inspect
import logging
import weakref

from .endpoint import Endpoint
from .exchange_peer_info import exchange_peer_info, new_tag
from .utils import callable_bool

logger = logging.getLogger("ucx")


class _ListenerState:
    """What the C listener's callback needs. Holds no reference to the
    public Listener, so dropping the Listener stops listening."""

    __slots__ = ("ctx", "callback", "error_handling", "connect_timeout", "tasks", "__weakref__")

    def __init__(self, ctx, callback, error_handling, connect_timeout):
        self.ctx = ctx
        self.callback = callback
        self.error_handling = error_handling
        self.connect_timeout = connect_timeout
        self.tasks: set[asyncio.Task] = set()

    def on_connection(self, c_ep) -> None:
        """Called by the C listener, from the event loop, per connection."""
        loop = asyncio.get_running_loop()
        task = loop.create_task(
            _handle_connection(self, c_ep), name=f"ucxx-accept-{c_ep.uid:#x}"
        )
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        self.ctx._track_task(task)


async def _handle_connection(state: _ListenerState, c_ep) -> None:
    ctx = state.ctx
    recv_tag, ctrl_tag = new_tag(), new_tag()
    try:
        peer = await exchange_peer_info(
            c_ep, recv_tag, ctrl_tag, state.connect_timeout, peer="the client"
        )
    except Exception as e:
        logger.warning("Listener: incoming connection dropped: %s", e)
        return
    except asyncio.CancelledError:
        c_ep.abort()
        raise
    try:
        c_ep.send_tag = peer.recv_tag
        c_ep.recv_tag = recv_tag
        ep = Endpoint(c_ep, ctx, ctrl_send_tag=peer.ctrl_tag, ctrl_recv_tag=ctrl_tag)
        ctx._track_endpoint(ep)
    except Exception:
        c_ep.abort()
        logger.exception("Listener: could not set up the endpoint")
        return
    logger.debug(
        "Listener: accepted endpoint %#x (send tag %#x, recv tag %#x)",
        c_ep.uid, peer.recv_tag, recv_tag,
    )
    cb = state.callback
    del state
    try:
        result = cb(ep)
        if inspect.isawaitable(result):
            await result
    except asyncio.CancelledError:
        raise
    except Exception:
        logger.exception("Uncaught exception in the listener callback %r", cb)


class Listener:
    """A listening endpoint, from ``ucxx.create_listener()``.

    Listening stops on ``close()`` or when this object is garbage-collected:
    keep a reference to it.
    """

    def __init__(self, c_listener, state: _ListenerState):
        self._listener = c_listener
        self._state = state
        self._finalizer = weakref.finalize(self, c_listener.close)

    @property
    def port(self) -> int:
        """The listening port."""
        return self._listener.port

    @property
    def ip(self) -> str:
        """The listening IP address."""
        return self._listener.ip

    @property
    def closed(self):
        """Usable as a property and as a method (``listener.closed()``)."""
        return callable_bool(self._listener.closed)

    @property
    def active_clients(self) -> int:
        """Connections whose handshake or callback is still running."""
        return sum(1 for t in self._state.tasks if not t.done())

    def close(self) -> None:
        """Stop listening. Idempotent. Established endpoints stay open."""
        self._listener.close()

    def __repr__(self) -> str:
        if self._listener.closed:
            return "<ucxx.Listener closed>"
        return f"<ucxx.Listener {self.ip}:{self.port}>"
