"""ApplicationContext: one UCX context + one worker, and the connection
logic of the asyncio API (handshake, endpoint and listener bookkeeping)."""

from __future__ import annotations

import asyncio
import functools
import gc
import ipaddress
import logging
import os
import re
import socket
import weakref

from .. import _ucxx
from ..exceptions import UCXError
from ..types import Tag
from . import liveness, multi
from .endpoint import Endpoint, TagProbeResult, _probe_handle
from .exchange_peer_info import exchange_peer_info, new_tag
from .listener import ActiveClients, Listener, _ListenerState
from .utils import UCXAddress, get_event_loop

logger = logging.getLogger("ucx")

PROGRESS_MODES = ("blocking", "polling", "thread", "thread-polling")
DEFAULT_PROGRESS_MODE = "blocking"
DEFAULT_CONNECT_TIMEOUT = 5.0

# UCX options this package sets unless the caller (options) or the
# environment (UCX_<NAME>) says otherwise. See docs/DECISIONS.md.
DEFAULT_UCX_OPTIONS = {
    # Detect a dead peer within a few seconds on every transport (shared
    # memory has no connection whose reset the kernel would report).
    "KEEPALIVE_INTERVAL": "1s",
    # UCX's tcp transport either enables the kernel's TCP keepalive (UCX's
    # default: 10 s idle, 2 s interval, the kernel's 9 probes) or, when it is
    # disabled, gets UCX's own keepalive: a small message on every endpoint
    # each KEEPALIVE_INTERVAL. UCX sets the kernel's keepalive only on the
    # sockets it connects, not on those it accepts, and between two workers
    # the one with the lower address connects: the other side of an idle
    # connection to a silent host would never notice. UCX's messages run on
    # both sides, and keep data unacknowledged on a dead link, where the
    # user timeout below bounds the detection.
    "TCP_KEEPIDLE": "inf",
    # Time data may stay unacknowledged (UCX's "auto" leaves the kernel's
    # tcp_retries2, about 15 minutes). Linux also applies it to a peer whose
    # receive window stays closed (a receiver that stalls with a backlog),
    # so it is long: 30 s, as Dask's own tcp comm.
    "TCP_USER_TIMEOUT": "30s",
    # SO_REUSEADDR on listening sockets, as asyncio's servers and Dask's tcp
    # comm have: a listener restarted on its port (a scheduler or worker
    # after a crash) binds while the old connections are in TIME_WAIT,
    # instead of failing with UCXBusyError for a minute. Two listeners on
    # one port still fail.
    "TCP_CM_REUSEADDR": "y",
    # The tcp transport writes a message in segments of this size, one
    # send() each. UCX's 8K makes bulk transfers system-call bound (8192
    # send() calls per 64 MiB); 64K (UCX's receive segment size) moves
    # 64 KiB-64 MiB 1.6-2.5x faster over tcp at the same 1 B latency.
    # Left to UCX where the caller sets a receive segment size: a send
    # segment larger than that makes UCX refuse the worker.
    "TCP_TX_SEG_SIZE": "64K",
    # Between two processes of one host (shared memory, or tcp over
    # loopback) messages below 8 MiB go eagerly: the sender pushes the data
    # at once instead of waiting for the receiver's answer to a rendezvous
    # request (UCX's own threshold: about 566 KiB over shared memory,
    # 267 KiB over tcp). Each hand-off waits for the peer's event loop, so
    # beside busy tasks a 1 MiB message moves 1.1-2.8x faster; without
    # busy work it is within 7 %, mostly faster. Across hosts UCX's
    # threshold stays.
    "RNDV_THRESH": "intra:8m,inter:auto",
    # Shared memory moves a message of more than one segment in segments of
    # this size, each a FIFO slot and a copy on both sides. With UCX's 8256
    # bytes slot handling bounds 8 KiB-64 MiB; 16K moves them 3-12 % faster
    # (64 KiB 0.97x, 1 MiB 0.97x, 64 MiB 0.91x the time) at the same 1 B
    # latency, for 4 MiB more shared memory per worker. 32K loses at
    # 64 KiB; 64K hangs UCX at 1 MiB.
    "POSIX_SEG_SIZE": "16K",
    "SYSV_SEG_SIZE": "16K",
}

# A default left to UCX where the caller sets one of these options:
# UCX refuses a tcp send segment above the receive segment, and
# POSIX_SEG_SIZE and SYSV_SEG_SIZE inherit UCX's MM_SEG_SIZE.
DEFAULT_YIELDS_TO = {
    "TCP_TX_SEG_SIZE": ("TCP_RX_SEG_SIZE",),
    "POSIX_SEG_SIZE": ("MM_SEG_SIZE",),
    "SYSV_SEG_SIZE": ("MM_SEG_SIZE",),
}

# Instead of TCP_KEEPIDLE=inf where the loaded UCX has no TCP_USER_TIMEOUT
# (before 1.22): without a user timeout UCX's keepalive messages to a silent
# host would be retransmitted for about 15 minutes, while the kernel's
# keepalive closes (the connecting side's) idle socket after 1 s + 3 x 1 s.
KERNEL_KEEPALIVE_OPTIONS = {"TCP_KEEPIDLE": "1s", "TCP_KEEPINTVL": "1s", "TCP_KEEPCNT": "3"}


def _normalize_options(options) -> dict[str, str]:
    out = {}
    for k, v in dict(options or {}).items():
        if not isinstance(k, str):
            raise TypeError(f"UCX option names must be str, got {k!r}")
        name = k[4:] if k.startswith("UCX_") else k
        if isinstance(v, bool):
            v = "y" if v else "n"
        out[name] = str(v)
    return out


@functools.lru_cache(maxsize=1)
def _known_options() -> frozenset[str]:
    """The names of DEFAULT_UCX_OPTIONS (and KERNEL_KEEPALIVE_OPTIONS) the
    loaded UCX has (TCP_USER_TIMEOUT, say, only from UCX 1.22 on): UCX
    refuses the others."""
    known = set()
    for name, value in {**DEFAULT_UCX_OPTIONS, **KERNEL_KEEPALIVE_OPTIONS}.items():
        try:
            _ucxx.get_config({name: value})
        except UCXError:
            continue
        known.add(name)
    return frozenset(known)


def _defaults() -> dict[str, str]:
    """DEFAULT_UCX_OPTIONS that the loaded UCX has; the kernel's keepalive
    instead of UCX's on tcp where it has no TCP_USER_TIMEOUT."""
    known = _known_options()
    defaults = dict(DEFAULT_UCX_OPTIONS)
    if "TCP_USER_TIMEOUT" not in known:
        defaults.update(KERNEL_KEEPALIVE_OPTIONS)
    return {k: v for k, v in defaults.items() if k in known}


def effective_options(options=None) -> dict[str, str]:
    """``options`` plus this package's defaults for the options that neither
    ``options`` nor the environment set and that the loaded UCX has."""
    opts = _normalize_options(options)
    given = set(opts)
    given.update(k[4:] for k in os.environ if k.startswith("UCX_"))
    for name, value in _defaults().items():
        if given.isdisjoint((name, *DEFAULT_YIELDS_TO.get(name, ()))):
            opts[name] = value
    return opts


def _resolve_progress_mode(progress_mode) -> str:
    source = "progress_mode"
    if progress_mode is None:
        progress_mode = os.environ.get("UCXPY_PROGRESS_MODE") or None
        source = "$UCXPY_PROGRESS_MODE"
    if progress_mode is None:
        return DEFAULT_PROGRESS_MODE
    if not isinstance(progress_mode, str) or progress_mode not in PROGRESS_MODES:
        raise ValueError(
            f"Unknown progress mode {progress_mode!r} (from {source}), valid "
            f"modes are: {', '.join(repr(m) for m in PROGRESS_MODES)}"
        )
    return progress_mode


def _resolve_float(value, env: str, default, what: str, allow_zero: bool):
    source = what
    if value is None:
        value = os.environ.get(env) or None
        source = f"${env}"
    if value is None:
        return default
    try:
        f = float(value)
    except (TypeError, ValueError):
        raise ValueError(f"invalid {what} {value!r} (from {source})") from None
    if f != f or f < 0 or (f == 0 and not allow_zero):
        raise ValueError(f"invalid {what} {value!r} (from {source})")
    return f


def _resolve_spin(spin_us):
    """spin_us: None (the mode's default), "auto", or microseconds >= 0;
    None falls back to $UCXPY_SPIN_US."""
    if spin_us is None:
        spin_us = os.environ.get("UCXPY_SPIN_US") or None
        if spin_us is None:
            return None
        source = "$UCXPY_SPIN_US"
    else:
        source = "spin_us"
    if spin_us == "auto":
        return "auto"
    return _resolve_float(spin_us, "", None, f"spin_us (from {source})", True)


def _resolve_host(host, port) -> str:
    """Numeric IP for ``host``; ValueError naming a bad host or port."""
    if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
        raise ValueError(f"invalid port {port!r}: expected an int in 0..65535")
    if not isinstance(host, str) or not host:
        raise ValueError(f"invalid address {host!r}: expected an IP address or host name")
    try:
        return str(ipaddress.ip_address(host))
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as e:
        raise ValueError(f"invalid address {host!r}: {e}") from None
    for family in (socket.AF_INET, socket.AF_INET6):
        for info in infos:
            if info[0] == family:
                return info[4][0]
    raise ValueError(f"invalid address {host!r}: no IPv4/IPv6 address")


def _env_flag(name: str):
    """True/False from ``$name`` ("0" is False), None if unset."""
    value = os.environ.get(name)
    if value is None:
        return None
    return value != "0"


class Worker(_ucxx.Worker):
    """The context's worker: the C worker, plus the two RAPIDS capability
    flags, recorded as given (see ``ApplicationContext``)."""

    __slots__ = ("enable_delayed_submission", "enable_python_future")


def _address_bytes(address) -> bytes:
    if isinstance(address, bytes):
        return address
    if hasattr(address, "__bytes__"):
        return bytes(address)
    try:
        return bytes(memoryview(address))
    except TypeError:
        raise TypeError(
            f"a UCX worker address must be bytes-like, got {type(address).__name__}"
        ) from None


class ApplicationContext:
    """The context of the asyncio interface: one ``ucp_context``, one worker.

    Created lazily by ``ucxx.core._get_ctx()`` or explicitly by
    ``ucxx.init()``.
    """

    def __init__(
        self,
        options=None,
        env_takes_precedence=False,
        progress_mode=None,
        connect_timeout=None,
        spin_us=None,
        enable_delayed_submission=None,
        enable_python_future=None,
    ):
        self.progress_mode = _resolve_progress_mode(progress_mode)
        # RAPIDS ucxx's capability flags: accepted in every progress mode and
        # recorded; neither changes anything here (docs/COMPAT.md).
        if enable_delayed_submission is None:
            enable_delayed_submission = _env_flag("UCXPY_ENABLE_DELAYED_SUBMISSION")
        if enable_delayed_submission is None:
            enable_delayed_submission = self.progress_mode.startswith("thread")
        if enable_python_future is None:
            enable_python_future = bool(_env_flag("UCXPY_ENABLE_PYTHON_FUTURE"))
        self.enable_delayed_submission = bool(enable_delayed_submission)
        self.enable_python_future = bool(enable_python_future)
        self._listener_active_clients = ActiveClients()
        self._next_listener_id = 0
        self.spin_us = _resolve_spin(spin_us)
        self.connect_timeout = _resolve_float(
            connect_timeout, "UCXPY_CONNECT_TIMEOUT", DEFAULT_CONNECT_TIMEOUT,
            "connect_timeout", False,
        )
        self.recv_multi_max_frames = multi.DEFAULT_MAX_FRAMES
        self.recv_multi_max_bytes = multi.DEFAULT_MAX_BYTES
        self.options = effective_options(options)
        self._endpoints: weakref.WeakSet = weakref.WeakSet()
        self._listeners: weakref.WeakSet = weakref.WeakSet()
        self._tasks: set[asyncio.Task] = set()
        self.context = _ucxx.Context(
            self.options, env_takes_precedence=bool(env_takes_precedence)
        )
        try:
            self.worker = Worker(
                self.context, progress_mode=self.progress_mode, spin_us=self.spin_us
            )
        except BaseException:
            self.context.close()
            raise
        self.worker.enable_delayed_submission = self.enable_delayed_submission
        self.worker.enable_python_future = self.enable_python_future
        # Active messages arrive as numpy uint8 arrays, as in RAPIDS ucxx
        # (np.empty is C: no Python frame per message).
        import numpy as np

        self.worker.register_am_allocator(
            _ucxx.MEMORY_TYPE_HOST, functools.partial(np.empty, dtype=np.uint8)
        )
        logger.info(
            "UCX context created: UCX %s, progress mode %r, TLS %s",
            ".".join(map(str, _ucxx.get_ucx_version())),
            self.progress_mode,
            self.context.config.get("TLS", "?"),
        )
        # Progress right away when created inside a running loop, so that a
        # peer can reach this worker by address before any local call.
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            pass
        else:
            self.continuous_ucx_progress()

    # ------------------------------------------------------------ properties
    @property
    def config(self) -> dict:
        """UCX configuration of this context (names without ``UCX_``)."""
        return self.context.config

    @property
    def ucp_context_info(self) -> str:
        return self.context.info()

    @property
    def ucp_worker_info(self) -> str:
        return self.worker.info()

    @property
    def ucp_worker(self) -> int:
        """The ``ucp_worker_h`` as an int."""
        return self.worker.handle

    @property
    def ucxx_worker(self) -> int:
        """The address of the worker object (RAPIDS: its ``ucxx::Worker``)."""
        return id(self.worker)

    @property
    def worker_address(self) -> UCXAddress:
        return UCXAddress(self.worker.address)

    def get_worker_address(self) -> UCXAddress:
        return UCXAddress(self.worker.address)

    def get_config(self) -> dict:
        return self.config

    # -------------------------------------------------------------- bookkeeping
    def _track_endpoint(self, ep: Endpoint) -> None:
        self._endpoints.add(ep)

    def _track_task(self, task: asyncio.Task) -> None:
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def live_objects(self) -> list:
        """Endpoints and listeners of this context still in use: referenced
        by the application and not closed by it (an endpoint whose peer
        failed counts until it is closed or aborted, as in RAPIDS ucxx; one
        the peer closed does not; one the application dropped is collected,
        or is closing by itself)."""
        gc.collect()
        out = [ep for ep in list(self._endpoints) if ep._in_use]
        out += [lst for lst in list(self._listeners) if not lst._listener.closed]
        return out

    # --------------------------------------------------------------- progress
    def continuous_ucx_progress(self, event_loop=None, loop=None):
        """Attach the worker to ``loop`` (default: the running loop, else the
        current one): one progress task per loop. Called automatically by
        ``create_listener()``, ``create_endpoint()`` and friends."""
        loop = loop or event_loop or get_event_loop()
        return self.worker.start(loop)

    def progress(self) -> int:
        return self.worker.progress()

    def clear_progress_tasks(self) -> None:
        """RAPIDS ucxx forgets its per-loop progress tasks here. The progress
        coroutine here is one per worker and loop and lives as long as the
        worker (``reset()`` ends it), so there is nothing to forget; calling
        ``continuous_ucx_progress()`` again is harmless."""
        logger.debug("clear_progress_tasks(): progress stays with the worker")

    def start_notifier_thread(self) -> None:
        """Kept for compatibility: completions resolve asyncio futures
        directly, there is no notifier thread to start."""
        logger.debug("start_notifier_thread(): no notifier thread")

    def stop_notifier_thread(self) -> None:
        """Kept for compatibility: this implementation has no notifier
        thread, so there is nothing to stop."""
        logger.debug("stop_notifier_thread(): no notifier thread")

    # ------------------------------------------------------------ connections
    def create_listener(
        self,
        callback_func,
        port=0,
        endpoint_error_handling=True,
        connect_timeout=None,
        host=None,
    ) -> Listener:
        """Start listening for connections.

        ``callback_func(ep)``: a function or coroutine function, called with
        the new :class:`Endpoint` after the handshake. Exceptions it raises
        are logged (logger ``"ucx"``). ``port``: 0 or None lets UCX choose.
        ``host``: the address to bind (default: all interfaces).

        Listening stops when the returned Listener is closed or
        garbage-collected.
        """
        if not callable(callback_func):
            raise TypeError(f"callback_func must be callable, got {callback_func!r}")
        if port is None:
            port = 0
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ValueError(f"invalid port {port!r}: expected an int in 0..65535")
        if host is not None:
            host = _resolve_host(host, port)
        timeout = self.connect_timeout
        if connect_timeout is not None:
            timeout = _resolve_float(connect_timeout, "", None, "connect_timeout", False)
        self.continuous_ucx_progress()
        ident = self._next_listener_id
        self._next_listener_id += 1
        state = _ListenerState(
            self, callback_func, endpoint_error_handling, timeout, ident,
            self._listener_active_clients,
        )
        c_listener = self.worker.listen(
            state.on_connection,
            port=port,
            host=host,
            error_handling=bool(endpoint_error_handling),
        )
        listener = Listener(c_listener, state)
        self._listeners.add(listener)
        logger.info("create_listener(): listening on %s:%d", listener.ip, listener.port)
        return listener

    async def create_endpoint(
        self, ip_address, port, endpoint_error_handling=True, connect_timeout=None
    ) -> Endpoint:
        """Connect to a listener at ``ip_address:port`` and run the
        handshake (bounded by ``connect_timeout``)."""
        host = _resolve_host(ip_address, port)
        timeout = self.connect_timeout
        if connect_timeout is not None:
            timeout = _resolve_float(connect_timeout, "", None, "connect_timeout", False)
        self.continuous_ucx_progress()
        where = f"{ip_address}:{port}"
        try:
            c_ep = self.worker.ep_from_sockaddr(
                host, port, error_handling=bool(endpoint_error_handling)
            )
        except UCXError as e:
            raise type(e)(f"cannot connect to {where}: {e}") from e
        recv_tag, ctrl_tag = new_tag(), new_tag()
        peer = await exchange_peer_info(
            c_ep, recv_tag, ctrl_tag, listener=False, connect_timeout=timeout,
            peer=f"the listener at {where}",
        )
        tags = {
            "msg_send": peer["msg_tag"],
            "msg_recv": recv_tag,
            "ctrl_send": peer["ctrl_tag"],
            "ctrl_recv": ctrl_tag,
            "peer_pid": peer.get("peer_pid"),
        }
        try:
            ep = Endpoint(c_ep, self, tags)
        except BaseException:
            c_ep.abort()
            raise
        logger.debug(
            "create_endpoint(): %#x to %s (send tag %#x, recv tag %#x)",
            c_ep.uid, where, tags["msg_send"], recv_tag,
        )
        return ep

    async def create_endpoint_from_worker_address(
        self, address, endpoint_error_handling=True
    ) -> Endpoint:
        """Endpoint to the worker whose UCX address is ``address``. No
        handshake: use explicit tags (``force_tag=True``) with such an
        endpoint, or the worker-level ``ucxx.recv()`` on the peer."""
        addr = _address_bytes(address)
        self.continuous_ucx_progress()
        c_ep = self.worker.ep_from_address(addr, error_handling=bool(endpoint_error_handling))
        # A peer on shared memory is named by its FIFO (no handshake here).
        peer = liveness.current(c_ep._shm_peer_pid) if c_ep._shm_peer_pid else None
        return Endpoint(c_ep, self, {"peer_pid": peer} if peer else None)

    async def recv(self, buffer, tag):
        """Receive on the worker (from any endpoint) into ``buffer``, tag
        (an int or a :class:`ucxx.types.Tag`) matched exactly. Returns the
        number of bytes received."""
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"tag must be an int, got {tag!r}")
        self.continuous_ucx_progress()
        return await self.worker.tag_recv(buffer, tag & 0xFFFFFFFFFFFFFFFF)

    def tag_probe(self, tag, remove=False) -> TagProbeResult:
        """Whether a message with exactly ``tag`` has arrived at the worker
        (from any endpoint), without receiving it. With ``remove`` the
        message leaves UCX's queue: receive it with :meth:`recv_with_handle`.
        Does not progress the worker."""
        if isinstance(tag, bool) or not isinstance(tag, int):
            raise TypeError(f"tag must be an int, got {tag!r}")
        return TagProbeResult(self.worker.tag_probe(Tag(tag & 0xFFFFFFFFFFFFFFFF), (1 << 64) - 1, bool(remove)))

    async def recv_with_handle(self, buffer, probe_result):
        """Receive the message a ``tag_probe(..., remove=True)`` took from
        the queue into ``buffer``. Returns the number of bytes received."""
        self.continuous_ucx_progress()
        return await self.worker.tag_recv_with_handle(buffer, _probe_handle(probe_result))

    # ---------------------------------------------------------------- closing
    def close(self) -> None:
        """Close the worker and the context (pending requests fail with
        UCXCanceledError). Used by ``ucxx.reset()``."""
        for lst in list(self._listeners):
            try:
                lst.close()
            except Exception:  # pragma: no cover
                logger.debug("closing listener failed", exc_info=True)
        for ep in list(self._endpoints):
            try:
                ep.abort()
            except Exception:  # pragma: no cover
                logger.debug("aborting endpoint failed", exc_info=True)
        for task in list(self._tasks):
            if not task.done():
                try:
                    task.cancel()
                except RuntimeError:  # its loop is closed
                    pass
        self.worker.close()
        self.context.close()

    def __repr__(self) -> str:
        return f"<ucxx.ApplicationContext progress_mode={self.progress_mode!r}>"


def get_active_transports(info: str) -> set[str]:
    """Transports named in ``ucp_context_print_info`` output."""
    resources = re.findall(r"^#.*resource.*md.*dev.*flags.*$", info, re.MULTILINE)
    return {r.split()[-1].split("/")[0] for r in resources}
