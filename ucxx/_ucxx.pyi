"""Type stubs for the C extension ``ucxx._ucxx``.

Every transfer returns a :class:`Request`: await it (inside a running event
loop) or poll ``done()`` while calling ``Worker.progress()`` (no asyncio).
"""

import asyncio
from collections.abc import Callable, Coroutine, Generator, Sequence
from typing import Any

from typing_extensions import Buffer, Self, disjoint_base, final

# (major, minor, release) of the UCX headers this extension was built with.
UCX_BUILD_VERSION: tuple[int, int, int]

# Context features (bit flags, the values of ucp_feature).
FEATURE_TAG: int
FEATURE_RMA: int
FEATURE_AMO32: int
FEATURE_AMO64: int
FEATURE_WAKEUP: int
FEATURE_STREAM: int
FEATURE_AM: int
DEFAULT_FEATURES: int  # TAG | WAKEUP | STREAM | AM

# Memory types (ucs_memory_type_t).
MEMORY_TYPE_HOST: int
MEMORY_TYPE_CUDA: int
MEMORY_TYPE_UNKNOWN: int

class UCXError(Exception): ...
class UCXCanceledError(UCXError): ...
class UCXCloseError(UCXError): ...
class UCXConfigError(UCXError): ...
class UCXConnectionResetError(UCXError): ...
class UCXMessageTruncatedError(UCXError): ...
class UCXNotConnectedError(UCXError): ...
class UCXUnreachableError(UCXError): ...
class UCXTimedOutError(UCXError): ...
class UCXNoMemoryError(UCXError): ...
class UCXNoResourceError(UCXError): ...
class UCXInvalidParamError(UCXError): ...
class UCXBusyError(UCXError): ...
class UCXUnsupportedError(UCXError): ...
class UCXRejectedError(UCXError): ...
class UCXNoDeviceError(UCXError): ...
class UCXEndpointTimeoutError(UCXError): ...
class UCXBufferTooSmallError(UCXError): ...
class UCXAlreadyExistsError(UCXError): ...
class UCXExceedsLimitError(UCXError): ...
class UCXFirstEndpointFailureError(UCXError): ...
class UCXFirstLinkFailureError(UCXError): ...
class UCXIOError(UCXError): ...
class UCXInvalidAddrError(UCXError): ...
class UCXLastEndpointFailureError(UCXError): ...
class UCXLastLinkFailureError(UCXError): ...
class UCXNoElemError(UCXError): ...
class UCXNoMessageError(UCXError): ...
class UCXNoProgressError(UCXError): ...
class UCXNotImplementedError(UCXError): ...
class UCXOutOfRangeError(UCXError): ...
class UCXShmemSegmentError(UCXConnectionResetError):
    """UCS_ERR_SHMEM_SEGMENT: a shared-memory peer died (so also a
    UCXConnectionResetError)."""
class UCXSomeConnectsFailedError(UCXError): ...
class UCXInvalidOptionError(UCXConfigError, UCXInvalidParamError):
    """A UCX option name or value UCX refused (Context, get_config)."""

def get_ucx_version() -> tuple[int, int, int]:
    """Version of the UCX library loaded at run time (no context created)."""

def _status_exception(status: int, /) -> UCXError:
    """The exception a UCX error status (negative ``ucs_status_t``) becomes."""
def _slice_wake(fut: asyncio.Future[None], /) -> None:
    """Resolve a slice yield's future unless it is done (cancelled)."""

def get_config(options: dict[str, str] | None = None) -> dict[str, str]:
    """UCX configuration as ``{NAME: value}`` without the ``UCX_`` prefix,
    after applying ``options``; creates no context. Unknown option names raise
    UCXConfigError naming the option."""

@disjoint_base
class Context:
    """``Context(options={}, features=DEFAULT_FEATURES,
    env_takes_precedence=False)``: ``ucp_init``.

    ``options`` keys are UCX variable names without the ``UCX_`` prefix
    (``{"TLS": "tcp"}``). With ``env_takes_precedence`` an option already set
    in the environment (``UCX_TLS``) wins over ``options``."""

    def __new__(
        cls,
        options: dict[str, str] | None = None,
        features: int = ...,
        env_takes_precedence: bool = False,
    ) -> Self: ...
    @property
    def config(self) -> dict[str, str]: ...
    @property
    def closed(self) -> bool: ...
    @property
    def handle(self) -> int: ...
    @property
    def features(self) -> int: ...
    def info(self) -> str:
        """``ucp_context_print_info`` as a string."""
    def close(self) -> None:
        """Idempotent. Raises UCXError if workers are still open on it."""

@final
class Request:
    """The awaitable of one transfer (or of one gather).

    ``await req`` returns the result (bytes received for a receive, None for
    a send, an object for ``am_recv``) or raises the typed UCXError. A
    request that UCX completed immediately returns without suspending. While
    pending, it holds the buffers it was given."""

    def __await__(self) -> Any: ...
    def send(self, value: None, /) -> Any:
        """Coroutine protocol (the Request is its own iterator)."""
    def throw(self, typ: Any, val: Any = ..., tb: Any = ..., /) -> Any:
        """Coroutine protocol: a cancelled await cancels a pending receive."""
    def close(self) -> None: ...
    def done(self) -> bool: ...
    def result(self) -> Any:
        """Result or raise; ``asyncio.InvalidStateError`` if not done."""
    def cancel(self) -> bool:
        """``ucp_request_cancel`` (receives; a send cannot be recalled).
        True if a cancel was requested. Completion then raises
        UCXCanceledError."""
    @property
    def status(self) -> int:
        """UCS status code (0 = OK, 1 = in progress, negative = error)."""

@disjoint_base
class Worker:
    """``Worker(context, progress_mode="blocking", spin_us=None)``:
    ``ucp_worker_create`` (thread mode SINGLE; SERIALIZED in the thread
    modes).

    ``progress_mode`` is ``"blocking"``, ``"polling"``, ``"thread"`` or
    ``"thread-polling"`` (a C progress thread; see docs/ENGINE.md).
    ``spin_us`` is how long an await progresses the worker before it
    suspends: ``"auto"`` (adapted to the traffic, at most 200 us), or a
    fixed number of microseconds (0: never spin). None: the mode's default,
    ``"auto"`` in blocking and thread mode, 100 in polling mode, 0 in
    thread-polling mode."""

    def __new__(
        cls,
        context: Context,
        progress_mode: str = "blocking",
        spin_us: float | str | None = None,
    ) -> Self: ...
    context: Context
    progress_mode: str
    spin_us: float
    """The budget now (the adaptive one while ``spin_auto``); set a number
    or ``"auto"``."""
    @property
    def spin_auto(self) -> bool:
        """True while the spin budget adapts to the traffic."""
    @property
    def spin_stats(self) -> dict[str, int]:
        """Counters of the spin policy: ``hits`` (awaits completed by a
        spin), ``grows``, ``shrinks`` (of the auto budget),
        ``slice_yields`` (loop turns the time slice gave), ``busy_polls``,
        ``follows`` (progress kept going for a transfer of 64 KiB or more
        in flight) and ``follow_stops`` (following given up after 200 ms
        without a large transfer settling)."""
    @property
    def shm_slots_skipped(self) -> int:
        """Slots of this process's shared-memory receive FIFOs that a dead
        sender reserved and never wrote, skipped so that the FIFO serves
        its other senders again (watched for 10 s after each peer error;
        a slot stuck for 1 s is skipped)."""
    @property
    def efd(self) -> int: ...
    @property
    def address(self) -> bytes:
        """This worker's UCX address (pass to ``Worker.ep_from_address``)."""
    @property
    def closed(self) -> bool: ...
    @property
    def handle(self) -> int: ...
    @property
    def loop(self) -> asyncio.AbstractEventLoop | None:
        """The event loop the worker is attached to."""
    @property
    def task(self) -> asyncio.Task[None] | None:
        """The progress Task on that loop."""
    @property
    def armed(self) -> bool:
        """ucp_worker_arm succeeded and no UCX call happened since."""
    @property
    def npending(self) -> int:
        """Requests UCX still holds."""
    def progress(self) -> int:
        """One ``ucp_worker_progress`` (GIL released in thread modes), then
        delivers the completions it produced. Returns the UCX count."""
    def arm(self) -> bool:
        """``ucp_worker_arm``: True if armed, False if busy (progress again)."""
    def signal(self) -> None: ...
    def info(self) -> str: ...
    def start(self, loop: asyncio.AbstractEventLoop, /) -> asyncio.Task[None]:
        """Attach the worker to ``loop``: register the event-fd reader
        (blocking mode) and start the one progress coroutine in a Task.
        Idempotent per loop; returns the Task. Awaiting a request inside a
        loop the worker is not attached to attaches it implicitly."""
    def stop(self) -> None:
        """Detach from the current loop (remove reader, end the task)."""
    def tag_recv(
        self, buf: Buffer, tag: int, mask: int = 0xFFFFFFFFFFFFFFFF, /
    ) -> Request:
        """Receive into a writable C-contiguous buffer from any endpoint."""
    def tag_probe(
        self, tag: int, mask: int = 0xFFFFFFFFFFFFFFFF, remove: bool = False, /
    ) -> tuple[int, int, Any] | None:
        """``ucp_tag_probe_nb``: None if no matching message has arrived,
        else ``(sender_tag, length, handle)``; ``handle`` (remove=True only,
        else None) is for :meth:`tag_recv_with_handle`. Does not progress."""
    def tag_recv_with_handle(self, buf: Buffer, handle: Any, /) -> Request:
        """``ucp_tag_msg_recv_nbx`` of the message a probe with remove=True
        took from the queue; each handle once, on its own worker."""
    def ep_from_address(
        self, address: bytes, error_handling: bool = True
    ) -> Endpoint:
        """Endpoint to the worker with this UCX address (no handshake). Its
        header (version, the fixed fields it announces) is checked
        (``UCXInvalidParamError``); the device list is parsed by UCX only,
        so the address must come from a trusted peer."""
    def ep_from_sockaddr(
        self, host: str, port: int, error_handling: bool = True
    ) -> Endpoint:
        """Client endpoint to a listener (no handshake at this level)."""
    def listen(
        self,
        callback: Callable[[Endpoint], object],
        port: int = 0,
        host: str | None = None,
        error_handling: bool = True,
    ) -> Listener:
        """``ucp_listener_create``; ``callback(endpoint)`` is called from the
        event loop (``loop.call_soon``) for each accepted connection."""
    def register_am_allocator(
        self, memory_type: int, allocator: Callable[[int], Buffer], /
    ) -> None:
        """Allocator used by ``am_recv`` for messages of that memory type
        (``MEMORY_TYPE_HOST``, ``MEMORY_TYPE_CUDA``, or another UCS memory
        type; ``ValueError`` otherwise)."""
    def close(self) -> None:
        """Idempotent: fail pending requests with UCXCanceledError, remove
        the reader, end the progress task, ``ucp_worker_destroy``."""

@final
class Endpoint:
    """A ``ucp_ep_h``. Created by Worker or Listener, never directly. A
    subclass adding no instance layout (``__slots__ = ()``) may be assigned
    to ``__class__`` (``ucxx.Endpoint`` is one)."""

    worker: Worker
    # Tags used by send()/recv() when tag is None; set by the handshake.
    send_tag: int
    recv_tag: int
    @property
    def alive(self) -> bool: ...
    @property
    def closed(self) -> bool: ...
    @property
    def handle(self) -> int: ...
    @property
    def uid(self) -> int: ...
    @property
    def error_handling(self) -> bool:
        """Peer error handling in effect (False after the shared-memory
        fallback, see docs/ENGINE.md)."""
    @property
    def peer_closed(self) -> bool: ...
    @property
    def _shm_peer_pid(self) -> int:
        """From a worker address: the pid of the process whose shared-memory
        FIFO UCX attached for this endpoint (its pidfd is watched); 0."""
    @property
    def transports(self) -> tuple[tuple[str, str], ...]:
        """(transport, device) UCX uses for this endpoint, one per lane
        (``ucp_ep_query``); ``()`` once closed. Shared memory shows as
        ``posix`` or ``sysv``."""
    @property
    def error(self) -> UCXError | None:
        """The peer's error as an exception instance, or None."""
    def send(self, buf: Buffer, tag: int | str | bytes | None = None, force_tag: bool = False) -> Request:
        """Tagged send. tag None: ``send_tag``; else ``tag`` (an int, or a
        str/bytes name) mixed with ``send_tag`` unless ``force_tag``."""
    def recv(self, buf: Buffer, tag: int | str | bytes | None = None, force_tag: bool = False) -> Request:
        """Tagged receive (full mask) on ``recv_tag`` (or mixed/forced tag)."""
    def tag_send(self, buf: Buffer, tag: int, /) -> Request: ...
    def tag_recv(self, buf: Buffer, tag: int, mask: int = 0xFFFFFFFFFFFFFFFF, /) -> Request:
        """Like Worker.tag_recv but tracked by this endpoint: it fails when
        the endpoint closes or the peer dies."""
    def stream_send(self, buf: Buffer, /) -> Request: ...
    def stream_recv(self, buf: Buffer, /) -> Request:
        """Receives exactly len(buf) bytes (WAITALL)."""
    def gather_send(self, buffers: Sequence[Buffer], tag: int | None = None, force_tag: bool = False,
                    header: Sequence[Buffer] | None = None) -> Request:
        """The buffers as one operation: its runs (``gather_runs``), posted
        in order in one call; ``header`` buffers first, each a message of
        its own. One Request."""
    def gather_recv(self, buffers: Sequence[Buffer], tag: int | None = None, force_tag: bool = False) -> Request:
        """Receive a gather_send of buffers of these sizes and memory types,
        scattered into them; result is None. A message whose length is not
        its run's raises UCXMessageTruncatedError naming both sizes."""
    @classmethod
    def gather_runs(cls, buffers: Sequence[Buffer], /) -> list[tuple[int, int, int, bool]]:
        """(first frame, frame count, bytes, is IOV) of each message a gather
        of ``buffers`` is made of; both sides derive the same list."""
    def am_send(self, buf: Buffer, /) -> Request: ...
    def am_recv(self) -> Request:
        """Next active message from this endpoint (queued until received)."""
    def set_close_callback(self, callback: Callable[[], object] | None, /) -> None:
        """Called once, from the loop, when the endpoint closes or fails."""
    def recv_tag_for(self, tag: int | str | bytes | None = None, force_tag: bool = False) -> int:
        """The UCX tag ``recv(buf, tag, force_tag)`` matches."""
    def am_probe(self) -> bool:
        """An active message from this endpoint waits for ``am_recv()``."""
    def raise_on_error(self) -> None:
        """Raise the endpoint's peer error (typed UCXError), if any."""
    @property
    def recv_count(self) -> int:
        """Receives posted by ``recv()`` and ``am_recv()``."""
    # The asyncio layer's per-endpoint state (ucxx.Endpoint); None at first.
    _state: Any
    def close(self) -> Request:
        """Graceful (flush) close; awaitable. Pending receives fail with
        UCXCanceledError. Idempotent."""
    def abort(self) -> None:
        """Immediate (force) close. Idempotent."""
    def _peer_exited(self) -> None:
        """The peer process exited (its pidfd said so): fail as on a UCX
        peer error, with UCXConnectionResetError. Idempotent."""
    def _close_by_peer(self) -> None:
        """The peer announced its close: abort; later receives still match
        messages that had already arrived."""
    def _begin_close(self) -> None:
        """This side began a graceful close: a failure before it ends fails
        pending requests with UCXCanceledError."""

@final
class Listener:
    worker: Worker
    @property
    def port(self) -> int: ...
    @property
    def ip(self) -> str: ...
    @property
    def closed(self) -> bool: ...
    def close(self) -> None: ...

@final
class ProgressCoroutine(Coroutine[Any, Any, None]):
    """The C coroutine driving a Worker on one loop (see Worker.start)."""

    @property
    def worker(self) -> Worker: ...
    def __await__(self) -> Generator[Any, None, None]: ...
    def send(self, value: None, /) -> Any: ...
    def throw(self, typ: Any, val: Any = ..., tb: Any = ..., /) -> Any: ...
    def close(self) -> None: ...

