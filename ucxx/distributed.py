"""A Dask ``distributed`` comm backend on ucxx: the ``ucxx-c://`` scheme,
and ``ucxx://`` unless distributed-ucxx is installed.

Install the package with the ``dask`` extra; ``distributed`` finds the backend
through the ``distributed.comm.backends`` entry points (``ucxx-c`` and
``ucxx``), so ``LocalCluster(protocol="ucxx-c")``, ``dask scheduler
--protocol ucxx-c`` and ``Client("ucxx-c://host:port")`` work without
importing anything. distributed-ucxx claims ``ucxx://`` as well; when it is
installed, ``ucxx://`` is distributed-ucxx's (running on this package), see
"Schemes" at the end and ``docs/DASK.md``.

Wire format: one dask message is one multi-frame message of the package's
one format (``ucxx._lib_async.frames``, docs/PROTOCOL.md "Multi-frame
messages"): a header message (frame count, sizes, host/CUDA kinds, and the
comm's flags CLOSE and HELLO in its application-flags field), then the
frames as ONE gathered operation (small host frames travel as one IOV
message). The writer posts all of it with ONE ``Endpoint.gather_send``
call; the reader receives the header, allocates every frame (host:
``host_array``; device: the package's one device helper, rmm, cupy or
numba, synchronised before UCX writes into it) and receives the frames
with ONE ``Endpoint.gather_recv`` call.

A CLOSE header (no frames) is the last message a comm sends: the peer
reads it as "the writer closed the comm". A HELLO header carrying one frame
(the connector's local address, UTF-8) is the first message a connector
sends, so that the listener side knows its peer's address.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import struct
import threading
import weakref
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import dask
from distributed.comm.addressing import parse_host_port, unparse_host_port
from distributed.comm.core import BaseListener, Comm, CommClosedError, Connector
from distributed.comm.registry import Backend
from distributed.comm.utils import ensure_concrete_host, from_frames, to_frames
from distributed.protocol.utils import host_array
from distributed.utils import ensure_ip, ensure_memoryview, get_ip

from ._lib_async import frames as _frames
from ._ucxx import Endpoint as _Endpoint

logger = logging.getLogger(__name__)

__all__ = [
    "UCXX",
    "UCXXBackend",
    "UCXXCBackend",
    "UCXXConnector",
    "UCXXListener",
    "ucxx_scheme_backend",
    "HEADER_SIZE",
    "pack_header",
    "unpack_header",
]

# --------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------

#: Defaults of the ``distributed.comm.ucxx`` dask config section.
CONFIG_DEFAULTS: dict[str, Any] = {
    # "blocking" (sleep on the worker's event fd), "polling", "thread",
    # "thread-polling". The UCXPY_PROGRESS_MODE environment variable wins.
    "progress-mode": "blocking",
    # Microseconds an await progresses the worker before it suspends
    # ("auto": adapted to the traffic, None: the progress mode's default,
    # 0: never spin).
    "spin-us": None,
    # UCX transports (UCX_TLS), e.g. "tcp", "tcp,sm", "all". None: UCX default.
    "tls": None,
    # Transports tried first for the connection establishment
    # (UCX_SOCKADDR_TLS_PRIORITY). None: UCX default.
    "sockaddr-tls-priority": None,
    # Seconds the ucxx connection handshake may take (None: ucxx default).
    "connect-timeout": None,
    # Any other UCX option, {"rndv-thresh": "8K"} -> UCX_RNDV_THRESH=8K.
    "environment": {},
    # UCX peer-failure handling on endpoints. With it UCX uses only
    # transports that can report a dead peer; without it shared memory and
    # CMA are used, but a dead peer may go unnoticed.
    "error-handling": True,
    # Shared memory between processes of one host, with error handling
    # (UCX_MM_ERROR_HANDLING=y): a dead peer process is reported by its
    # pidfd and the slot a dead sender left half-written in a shared-memory
    # FIFO is skipped (docs/RELIABILITY.md). False: tcp over loopback.
    "shared-memory": True,
    # Upper bound on the frame count of one received message (sanity check
    # of the header; a bigger count aborts the comm).
    "max-frames": 1 << 24,
    # Seconds a graceful close() waits for UCX to flush before aborting.
    "close-timeout": 5.0,
}

dask.config.update_defaults({"distributed": {"comm": {"ucxx": CONFIG_DEFAULTS}}})


def _config(key: str):
    return dask.config.get(f"distributed.comm.ucxx.{key}", CONFIG_DEFAULTS[key])


def _ucx_options() -> dict[str, str]:
    """UCX options (names without the ``UCX_`` prefix) from the dask config."""
    options: dict[str, str] = {}
    for k, v in (_config("environment") or {}).items():
        name = k.upper().replace("-", "_")
        if name.startswith("UCX_"):
            name = name[4:]
        options[name] = str(v)
    tls = _config("tls")
    if tls:
        options["TLS"] = tls if isinstance(tls, str) else ",".join(tls)
    prio = _config("sockaddr-tls-priority")
    if prio:
        options["SOCKADDR_TLS_PRIORITY"] = prio if isinstance(prio, str) else ",".join(prio)
    if _config("shared-memory") and _config("error-handling"):
        options.setdefault("MM_ERROR_HANDLING", "y")
    return options


# --------------------------------------------------------------------------
# ucxx initialisation and lifetime of the progress machinery
# --------------------------------------------------------------------------

ucxx = None  # the ucxx package, imported on first use
_UCXError: type[BaseException] = Exception
_init_lock = threading.Lock()
# Whether this module initialised the ucxx context (and may therefore reset
# it once the last comm/listener is gone).
_owns_context = False
# Live comms and listeners: id -> event loop they run on.
_resources: dict[int, asyncio.AbstractEventLoop | None] = {}
_resource_ids = itertools.count()


def _import_ucxx():
    global ucxx, _UCXError
    if ucxx is None:
        import ucxx as _ucxx_pkg
        from ucxx.exceptions import UCXError

        _UCXError = UCXError
        ucxx = _ucxx_pkg
    return ucxx


def _context_exists() -> bool:
    core = ucxx.core
    return getattr(core, "_ctx", None) is not None


def init_once() -> None:
    """Initialise ucxx from the ``distributed.comm.ucxx`` dask config, unless
    a ucxx context already exists (then it is used as it is)."""
    global _owns_context
    _import_ucxx()
    with _init_lock:
        if _context_exists():
            return
        options = _ucx_options()
        env_mode = os.environ.get("UCXPY_PROGRESS_MODE")
        mode = env_mode or _config("progress-mode") or "blocking"
        kwargs: dict[str, Any] = {
            "options": options,
            "env_takes_precedence": True,
            "progress_mode": mode,
        }
        timeout = _config("connect-timeout")
        if timeout is not None:
            kwargs["connect_timeout"] = float(timeout)
        spin = _config("spin-us")
        if spin is not None:
            kwargs["spin_us"] = spin if spin == "auto" else float(spin)
        logger.debug("ucxx.init(%s)", kwargs)
        ucxx.init(**kwargs)
        _owns_context = True


def _acquire() -> int:
    """Register one comm/listener; returns its id for :func:`_release`."""
    rid = next(_resource_ids)
    try:
        loop = asyncio.get_running_loop()
    except RuntimeError:  # pragma: no cover - always called from a loop
        loop = None
    _resources[rid] = loop
    return rid


def _release(rid: int | None) -> None:
    """Forget one comm/listener. When the last one is gone, ucxx is left as
    it was found: the context this module created is reset (its worker,
    progress task, fd reader and file descriptors go away); a context
    created by someone else only stops being progressed, unless it still
    has endpoints or listeners of its own."""
    if rid is None:
        return
    loop = _resources.pop(rid, None)
    if _resources or ucxx is None:
        return
    try:
        running = asyncio.get_running_loop()
    except RuntimeError:
        running = None
    if loop is not None and running is not loop and loop.is_running():
        # Called from another thread (a finalizer): do it on the loop.
        loop.call_soon_threadsafe(_release_idle)
    else:
        _release_idle()


def _release_idle() -> None:
    global _owns_context
    if _resources or ucxx is None:
        return
    ctx = getattr(ucxx.core, "_ctx", None)
    if ctx is None:
        return
    if _owns_context:
        try:
            if ctx.live_objects():  # endpoints/listeners of someone else
                logger.debug("ucxx context kept after the last comm: still in use")
                return
            ucxx.reset()
        except Exception as e:  # pragma: no cover - defensive
            logger.debug("ucxx.reset() after the last comm: %s", e)
        else:
            _owns_context = False
        return
    try:
        if not ctx.live_objects():
            ctx.worker.stop()
    except Exception as e:  # pragma: no cover - defensive
        logger.debug("stopping ucxx progress after the last comm: %r", e)


# --------------------------------------------------------------------------
# Message header: the package's one multi-frame format
# --------------------------------------------------------------------------

#: Application flags of the comm, in the header's app-flags field.
FLAG_CLOSE = 1
FLAG_HELLO = 2
#: The receive buffer of a header: the most a header message can be.
HEADER_SIZE = _frames.HEADER_MAX
#: Frames whose table travels inside the header message.
INLINE = _frames.INLINE_MAX
KIND_HOST = _frames.MEM_HOST
KIND_CUDA = _frames.MEM_CUDA
#: No bound on the bytes a peer announces (a comm allocates what dask
#: sent); the frame count is bounded by the ``max-frames`` config.
_MAX_BYTES = (1 << 64) - 1

_CLOSE_HEADER = _frames.encode_header([], [], FLAG_CLOSE)[0]


def pack_header(sizes: Sequence[int], kinds: Sequence[int], flags: int = 0) -> list[bytes]:
    """The header message (and the frame table message when the table does
    not fit in it) describing frames of ``sizes`` and ``kinds``."""
    return _frames.encode_header(sizes, kinds, flags)


def unpack_header(hdr, max_frames: int | None = None) -> tuple[int, int]:
    """Validate a header message; returns ``(flags, nframes)`` (flags: the
    comm's CLOSE / HELLO)."""
    _, app_flags, n, _total = _frames.decode_prefix(
        hdr, max_frames if max_frames is not None else (1 << 32) - 1, _MAX_BYTES
    )
    if app_flags & FLAG_CLOSE and n:
        raise _frames.UCXError("ucxx comm CLOSE header with frames")
    return app_flags, n


def _is_device(frame) -> bool:
    return hasattr(frame, "__cuda_array_interface__")


# --------------------------------------------------------------------------
# The comm
# --------------------------------------------------------------------------

# Serializer families tried, in order, when write() is given none: "cuda"
# first, so that device objects travel as device frames.
_SERIALIZERS = ("cuda", "dask", "pickle", "error")


def _on_endpoint_closed(ref) -> None:
    comm = ref()
    if comm is not None:
        comm._closed = True


def _abort_endpoint(ep, rid) -> None:
    """Finalizer of a comm that was never closed."""
    try:
        ep.abort()
    except Exception:  # pragma: no cover - interpreter shutdown
        pass
    _release(rid)


class UCXX(Comm):
    """An established ucxx connection carrying dask messages.

    One reader and one writer at a time (the ``Comm`` contract). Any UCX
    error while reading or writing aborts the comm and raises
    ``CommClosedError``; so does a CLOSE message from the peer.
    """

    def __init__(
        self,
        ep,
        local_addr: str,
        peer_addr: str,
        deserialize: bool = True,
        resource_id: int | None = None,
        initiator: bool = True,
    ):
        super().__init__(deserialize=deserialize)
        self._ep = ep
        # True on the connector's side, False on the listener's (see close()).
        self._initiator = initiator
        self._local_addr = local_addr
        self._peer_addr = peer_addr
        self._closed = False
        self._resource_id = resource_id
        self._max_frames = int(_config("max-frames"))
        self._sends: list = []  # send requests still in flight
        self._extra: dict = {}
        ep.set_close_callback(_on_endpoint_closed, cb_args=(weakref.ref(self),))
        self._finalizer = weakref.finalize(self, _abort_endpoint, ep, resource_id)
        self._finalizer.atexit = False

    # -- properties --------------------------------------------------------
    @property
    def local_address(self) -> str:
        return self._local_addr

    @property
    def peer_address(self) -> str:
        return self._peer_addr

    @property
    def extra_info(self) -> dict:
        return self._extra

    def closed(self) -> bool:
        return self._closed

    # -- writing -----------------------------------------------------------
    async def write(self, msg, serializers=None, on_error="message") -> int:
        ep = self._ep
        if ep is None or self._closed:
            raise CommClosedError(f"{self!r}: the comm is closed")
        frames = await to_frames(
            msg,
            allow_offload=self.allow_offload,
            serializers=serializers if serializers is not None else _SERIALIZERS,
            on_error=on_error,
            context={
                "sender": self.local_info,
                "recipient": self.remote_info,
                **self.handshake_options,
            },
        )
        return self._send_frames(frames)

    def _send_frames(self, frames: list, flags: int = 0) -> int:
        """Post header and frames with one gather_send (the one multi-frame
        format; device frames are synchronised first)."""
        ep = self._ep
        if ep is None:
            raise CommClosedError(f"{self!r}: the comm is closed")
        out = [f if _is_device(f) else ensure_memoryview(f) for f in frames]
        try:
            self._check_sends()
            sizes, kinds = _frames.describe(out)
            req = _frames.post_described(ep, out, sizes, kinds, app_flags=flags)
            if req.done():
                req.result()
            else:
                # Like a socket write, write() returns once the message is
                # queued: a large (rendezvous) frame completes only when the
                # peer receives it. Completion errors surface at the next
                # write; close() waits for what is still in flight.
                self._sends.append(req)
        except _UCXError as e:
            self.abort()
            raise CommClosedError(f"{self!r}: while writing: {e!r}") from e
        except BaseException:
            # Unknown state of the stream (cancelled mid-write...): the only
            # safe thing to do is to abort it.
            self.abort()
            raise
        return sum(sizes)

    def _check_sends(self) -> None:
        """Forget completed sends; raise the error of a failed one."""
        if self._sends:
            pending = []
            for req in self._sends:
                if req.done():
                    req.result()
                else:
                    pending.append(req)
            self._sends = pending

    # -- reading -----------------------------------------------------------
    async def read(self, deserializers=None):
        flags, frames = await self._recv_frames()
        try:
            return await from_frames(
                frames,
                deserialize=self.deserialize,
                deserializers=deserializers,
                allow_offload=self.allow_offload,
            )
        except EOFError:
            # Frames garbled or truncated by a communication error.
            self.abort()
            raise CommClosedError(f"{self!r}: aborted stream on truncated data")

    async def _recv_frames(self) -> tuple[int, list]:
        ep = self._ep
        if ep is None:
            raise CommClosedError(f"{self!r}: the comm is closed")
        try:
            flags, frames = await _frames.recv_header(
                lambda buf: _recv(ep, [buf], False), self._max_frames, _MAX_BYTES,
                host_array,
            )
            if flags & FLAG_CLOSE:
                if frames:
                    raise ValueError("ucxx comm CLOSE header with frames")
                await self._peer_closed()
                raise CommClosedError(f"{self!r}: the peer closed the comm")
            if frames:
                await _recv(ep, frames, True)
        except CommClosedError:
            raise
        except (ValueError, RuntimeError):
            # Malformed or unserviceable (no device allocator) message.
            self.abort()
            raise
        except _UCXError as e:
            self.abort()
            raise CommClosedError(f"{self!r}: while reading: {e!r}") from e
        except BaseException:
            # Some frames may have been consumed: the stream cannot be
            # resumed (cancellation, KeyboardInterrupt...).
            self.abort()
            raise
        return flags, frames

    # -- closing -----------------------------------------------------------
    #
    # Who closes the UCX endpoint, and how, follows one rule: only the
    # listener's side ever closes gracefully (flush); the connector's side
    # only aborts, once the listener's side has closed (or after a timeout).
    # The two ends of a connection therefore never race a graceful close
    # against a close or an abort of the other end.

    async def close(self) -> None:
        """Send CLOSE after everything written so far, then let the
        endpoint go. Returns without waiting for the peer; never raises for a
        peer that is already gone."""
        ep = self._ep
        self._closed = True
        if ep is None:
            return
        self._ep = None
        self._finalizer.detach()
        rid, self._resource_id = self._resource_id, None
        timeout = float(_config("close-timeout"))
        if ep.closed:
            _finish(ep, rid)
            return
        try:
            # CLOSE after everything written; wait until all of it is out.
            sends, self._sends = self._sends, []
            sends.append(ep.gather_send([_CLOSE_HEADER]))
            await asyncio.wait_for(_await_all(sends), timeout)
        except BaseException as e:
            logger.debug("%r: sending CLOSE failed: %r", self, e)
            _finish(ep, rid)
            if not isinstance(e, (Exception, asyncio.CancelledError)):
                raise
            return
        if self._initiator:
            # Linger until the listener's side has read CLOSE and closed its
            # end (which closes ours), or until the timeout.
            _Linger(ep, rid, timeout)
        else:
            await _close_gracefully(ep, rid, timeout)

    async def _peer_closed(self) -> None:
        """The peer's CLOSE was read: release our end."""
        ep = self._ep
        self._closed = True
        if ep is None:
            return
        self._ep = None
        self._finalizer.detach()
        rid, self._resource_id = self._resource_id, None
        if self._initiator or ep.closed:
            _finish(ep, rid)
        else:
            await _close_gracefully(ep, rid, float(_config("close-timeout")))

    def abort(self) -> None:
        """Close at once. A CLOSE message is still posted first (best
        effort: transports without peer-failure detection, such as shared
        memory alone, would otherwise leave the peer waiting)."""
        self._closed = True
        ep, self._ep = self._ep, None
        if ep is None:
            return
        self._sends = []
        self._finalizer.detach()
        rid, self._resource_id = self._resource_id, None
        if not ep.closed:
            try:
                ep.gather_send([_CLOSE_HEADER])
            except Exception:
                pass
        _finish(ep, rid)


def _finish(ep, rid) -> None:
    try:
        ep.abort()
        _drain(ep)
    finally:
        _release(rid)


def _drain(ep) -> None:
    """Consume the messages of a closed comm that arrived but were never
    read (the peer's CLOSE when both sides closed at once, ...): nobody will
    ever receive on this connection's tag again, and UCX would keep them in
    the worker's unexpected-message queue until the worker is destroyed."""
    try:
        worker = ep.worker
        tag = ep.recv_tag
        if worker.closed:
            return
    except Exception:
        return
    buf = bytearray(HEADER_SIZE)
    for _ in range(64):
        try:
            req = worker.tag_recv(buf, tag)
        except Exception:
            return
        if not req.done():
            req.cancel()
            return
        try:
            req.result()
        except Exception:  # a longer message, truncated: consumed all the same
            pass


async def _close_gracefully(ep, rid, timeout: float) -> None:
    try:
        await asyncio.wait_for(_await(ep.close()), timeout)
    except BaseException as e:
        logger.debug("graceful close of %r failed: %r", ep, e)
        if not isinstance(e, (Exception, asyncio.CancelledError)):
            _finish(ep, rid)
            raise
    _finish(ep, rid)


class _Linger:
    """Keeps a closed comm's endpoint until the peer closes it, at most
    ``timeout`` seconds; then aborts it. No task: the endpoint's close
    callback and one timer handle hold it."""

    __slots__ = ("ep", "rid", "handle")

    def __init__(self, ep, rid, timeout: float):
        self.ep = ep
        self.rid = rid
        self.handle = asyncio.get_running_loop().call_later(timeout, self.done)
        ep.set_close_callback(self.done)

    def done(self) -> None:
        ep, self.ep = self.ep, None
        if ep is None:
            return
        self.handle.cancel()
        ep.set_close_callback(None)
        _finish(ep, self.rid)


async def _await(aw):
    return await aw


async def _await_all(reqs) -> None:
    for req in reqs:
        await req


def _recv(ep, bufs: list, gather: bool):
    """Receive ``bufs`` on the comm's tag: one ``recv`` (awaitable of the
    received length) or one ``gather_recv``. Should the endpoint refuse
    because it is closed (the peer closed the connection, which closes our
    side too), the messages that had arrived before the close are still
    delivered, from the worker's queue of unexpected messages."""
    try:
        return ep.gather_recv(bufs) if gather else ep.recv(bufs[0])
    except _UCXError:
        if not ep.closed:
            raise
    return _recv_arrived(ep, bufs, gather)


async def _recv_arrived(ep, bufs: list, gather: bool):
    """Receive ``bufs`` from messages that already arrived, else fail: one
    worker-level receive per message (per run of a gather, received whole
    and scattered into its buffers)."""
    worker = ep.worker
    tag = ep.recv_tag
    if gather:
        runs = [(first, n, nbytes, bytearray(nbytes) if iov else bufs[first])
                for first, n, nbytes, iov in _Endpoint.gather_runs(bufs)]
    else:
        runs = [(0, 1, None, bufs[0])]
    reqs = [worker.tag_recv(target, tag) for *_, target in runs]
    try:
        for _ in range(_ARRIVED_SPINS):
            if all(r.done() for r in reqs):
                break
            worker.progress()
            await asyncio.sleep(0)
        got = []
        for r in reqs:
            if not r.done():
                raise CommClosedError("the peer closed the connection")
            got.append(r.result())
    finally:
        for r in reqs:
            if not r.done():
                r.cancel()
    if not gather:
        return got[0]
    for (first, n, nbytes, target), length in zip(runs, got):
        if length != nbytes:
            raise _UCXError(f"a message of {length} bytes for frames of {nbytes} bytes")
        if n > 1:
            view, off = memoryview(target), 0
            for b in bufs[first : first + n]:
                dst = memoryview(b).cast("B")
                dst[:] = view[off : off + dst.nbytes]
                off += dst.nbytes
    return None


# Progress rounds _recv_arrived allows for messages that are still being
# delivered when the endpoint closes (rendezvous fragments, ...).
_ARRIVED_SPINS = 64


def _local_address_for(ip: str) -> str:
    """The local IP through which ``ip`` is reached."""
    try:
        return get_ip(ip)
    except Exception:  # pragma: no cover - no route
        return "127.0.0.1"


# --------------------------------------------------------------------------
# Connector
# --------------------------------------------------------------------------


class UCXXConnector(Connector):
    prefix = "ucxx://"
    comm_class = UCXX
    encrypted = False

    async def connect(self, address: str, deserialize: bool = True, **connection_args) -> UCXX:
        if connection_args.get("require_encryption"):
            raise RuntimeError(
                "encryption required by Dask configuration, refusing "
                f"communication to {self.prefix + address!r} (ucxx is not encrypted)"
            )
        ip, port = parse_host_port(address)
        init_once()
        rid = _acquire()
        try:
            ep = await ucxx.create_endpoint(
                ip, port, endpoint_error_handling=bool(_config("error-handling"))
            )
        except _UCXError as e:
            _release(rid)
            raise CommClosedError(f"ucxx: cannot connect to {self.prefix + address}: {e!r}") from e
        except BaseException:
            _release(rid)
            raise
        local = self.prefix + unparse_host_port(_local_address_for(ensure_ip(ip)), _endpoint_port(ep))
        comm = self.comm_class(ep, local, self.prefix + address, deserialize, rid, True)
        # HELLO: our address, so that the listener side knows its peer.
        comm._send_frames([local.encode()], FLAG_HELLO)
        return comm


def _endpoint_port(ep) -> int:
    """Local port of the endpoint's connection when ucxx exposes it, else 0."""
    for name in ("local_port", "port"):
        port = getattr(ep, name, None)
        if isinstance(port, int):
            return port
    return 0


# --------------------------------------------------------------------------
# Listener
# --------------------------------------------------------------------------


class UCXXListener(BaseListener):
    prefix = UCXXConnector.prefix
    comm_class = UCXXConnector.comm_class
    encrypted = UCXXConnector.encrypted

    def __init__(
        self,
        address: str,
        comm_handler: Callable[[UCXX], Awaitable[None]] | None = None,
        deserialize: bool = True,
        allow_offload: bool = True,
        default_host: str | None = None,
        default_port: int = 0,
        **connection_args: Any,
    ):
        super().__init__()
        if connection_args.get("require_encryption"):
            raise RuntimeError(
                "encryption required by Dask configuration, refusing "
                f"communication from {self.prefix + address!r} (ucxx is not encrypted)"
            )
        if address.startswith(self.prefix):
            address = address[len(self.prefix) :]
        self.ip, self._input_port = parse_host_port(address, default_port)
        if not self.ip:
            self.ip = "0.0.0.0"
        self.default_host = default_host
        self.comm_handler = comm_handler
        self.deserialize = deserialize
        self.allow_offload = allow_offload
        self._listener = None
        self._resource_id: int | None = None
        self._pending: set[UCXX] = set()

    async def start(self) -> None:
        init_once()
        self._resource_id = _acquire()
        try:
            self._listener = ucxx.create_listener(
                self._on_accept,
                port=self._input_port or None,
                host=self.ip,
                endpoint_error_handling=bool(_config("error-handling")),
            )
        except _UCXError as e:
            _release(self._resource_id)
            self._resource_id = None
            raise OSError(
                f"ucxx: cannot listen on {self.prefix}{unparse_host_port(self.ip, self._input_port)}: {e!r}"
            ) from e
        except BaseException:
            _release(self._resource_id)
            self._resource_id = None
            raise

    async def _on_accept(self, ep) -> None:
        """ucxx listener callback (runs in the listener's task for this
        connection): HELLO, dask handshake, then the comm handler."""
        if self._listener is None:
            ep.abort()
            return
        local = self.contact_address
        comm = self.comm_class(
            ep, local, self.prefix + "unknown:0", self.deserialize, _acquire(), False
        )
        comm.allow_offload = self.allow_offload
        self._pending.add(comm)
        try:
            try:
                timeout = dask.utils.parse_timedelta(
                    dask.config.get("distributed.comm.timeouts.connect"), default="seconds"
                )
                flags, frames = await asyncio.wait_for(comm._recv_frames(), timeout)
                if not flags & FLAG_HELLO or len(frames) != 1:
                    raise ValueError("the first message of a ucxx comm is not a HELLO")
                comm._peer_addr = bytes(frames[0]).decode()
            except (CommClosedError, asyncio.TimeoutError, ValueError) as e:
                logger.debug("ucxx connection closed before its HELLO: %r", e)
                comm.abort()
                return
            if self._listener is None:
                # stop() ran meanwhile; abort_handshaking_comms() did not see us.
                comm.abort()
                return
        finally:
            self._pending.discard(comm)
        try:
            await self.on_connection(comm)
        except CommClosedError:
            logger.debug("Connection from %s closed before handshake completed", comm.peer_address)
            return
        except BaseException:
            comm.abort()
            raise
        if self.comm_handler is not None:
            await self.comm_handler(comm)

    def stop(self) -> None:
        listener, self._listener = self._listener, None
        if listener is not None:
            listener.close()
        for comm in list(self._pending):
            comm.abort()
        self._pending.clear()
        self.abort_handshaking_comms()
        rid, self._resource_id = self._resource_id, None
        _release(rid)

    def get_host_port(self) -> tuple[str, int]:
        if self._listener is None:
            raise ValueError("invalid operation on non-started UCXXListener")
        return self.ip, self._listener.port

    @property
    def port(self) -> int:
        return self.get_host_port()[1]

    @property
    def listen_address(self) -> str:
        return self.prefix + unparse_host_port(*self.get_host_port())

    @property
    def contact_address(self) -> str:
        host, port = self.get_host_port()
        host = ensure_concrete_host(host, default_host=self.default_host)
        return self.prefix + unparse_host_port(host, port)


# --------------------------------------------------------------------------
# Backend
# --------------------------------------------------------------------------


class UCXXBackend(Backend):
    """This package's backend under the ``ucxx://`` scheme."""

    connector_class = UCXXConnector
    listener_class = UCXXListener

    def get_connector(self) -> UCXXConnector:
        return self.connector_class()

    def get_listener(self, loc, handle_comm, deserialize, **connection_args) -> UCXXListener:
        return self.listener_class(loc, handle_comm, deserialize, **connection_args)

    def get_address_host(self, loc: str) -> str:
        return parse_host_port(loc)[0]

    def get_address_host_port(self, loc: str) -> tuple[str, int]:
        return parse_host_port(loc)

    def resolve_address(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(ensure_ip(host), port)

    def get_local_address_for(self, loc: str) -> str:
        host, port = parse_host_port(loc)
        return unparse_host_port(_local_address_for(ensure_ip(host)), None)


# --------------------------------------------------------------------------
# Schemes (docs/DASK.md, "Schemes")
# --------------------------------------------------------------------------
#
# distributed-ucxx (RAPIDS' Dask backend, which runs on this package's API)
# registers ``ucx://`` and ``ucxx://`` too, and distributed takes whichever
# ``ucxx`` entry point it finds first. So that the choice does not depend on
# that order, this package's ``ucxx`` entry point is :func:`ucxx_scheme_backend`,
# which defers to distributed-ucxx when it is installed; this backend is
# always reachable as ``ucxx-c://``.

SCHEME_C = "ucxx-c"


class UCXXCConnector(UCXXConnector):
    prefix = SCHEME_C + "://"


class UCXXCListener(UCXXListener):
    prefix = UCXXCConnector.prefix


class UCXXCBackend(UCXXBackend):
    """This package's backend under the ``ucxx-c://`` scheme (the same
    comms as :class:`UCXXBackend`; only the addresses differ)."""

    connector_class = UCXXCConnector
    listener_class = UCXXCListener


def ucxx_scheme_backend() -> Backend:
    """The backend of the ``ucxx://`` scheme (this package's entry point):
    distributed-ucxx's (its ``ucxx://`` prefix, on this package's engine)
    when distributed-ucxx is installed, since it claims the scheme too,
    else this package's :class:`UCXXBackend`."""
    try:
        import distributed_ucxx
    except ImportError:
        return UCXXBackend()
    return distributed_ucxx.UCXXBackendLegacyPrefix()
