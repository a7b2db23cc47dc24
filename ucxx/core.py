"""Module-level API (RAPIDS ucxx compatible): one global ApplicationContext,
created on first use or by :func:`init`."""

from __future__ import annotations

import logging

from . import _ucxx
from ._lib_async import ApplicationContext
from ._lib_async.application_context import effective_options, get_active_transports as _transports
from ._lib_async.endpoint import Endpoint
from ._lib_async.listener import Listener
from ._lib_async.utils import UCXAddress
from .exceptions import UCXError

logger = logging.getLogger("ucx")

__all__ = [
    "init",
    "reset",
    "create_listener",
    "create_endpoint",
    "create_endpoint_from_worker_address",
    "get_worker_address",
    "get_ucx_address_from_buffer",
    "get_config",
    "get_ucx_version",
    "progress",
    "continuous_ucx_progress",
    "recv",
    "register_am_allocator",
    "get_ucp_context_info",
    "get_ucp_worker_info",
    "get_active_transports",
    "stop_notifier_thread",
    "get_ucp_worker",
    "get_ucxx_worker",
    "Endpoint",
    "Listener",
    "ApplicationContext",
]

# The one application context of this process; None until first needed.
_ctx: ApplicationContext | None = None

# Contexts a reset() could not close because the application still held
# open endpoints or listeners of theirs; closed by a later reset() once
# those are gone (see docs/DECISIONS.md, "reset()").
_retired: list[ApplicationContext] = []


def _get_ctx() -> ApplicationContext:
    """The global ApplicationContext, created with defaults if needed."""
    global _ctx
    if _ctx is None:
        _ctx = ApplicationContext()
    return _ctx


def init(
    options={},
    env_takes_precedence=False,
    progress_mode=None,
    enable_delayed_submission=None,
    enable_python_future=None,
    connect_timeout=None,
    spin_us=None,
) -> None:
    """Initialise UCX with explicit settings.

    Usually the context is created on first use; call this first to choose
    its settings. RuntimeError if it already exists (call :func:`reset`).

    options: dict
        UCX options, names without the ``UCX_`` prefix (``{"TLS": "tcp"}``).
        A name or value UCX refuses raises UCXInvalidOptionError (a
        UCXConfigError and a UCXInvalidParamError).
    env_takes_precedence: bool
        If True, an option also set in the environment (``UCX_TLS``) takes
        the environment's value.
    progress_mode: str
        ``"blocking"`` (default), ``"polling"``, ``"thread"`` or
        ``"thread-polling"``; None: ``$UCXPY_PROGRESS_MODE``, else blocking.
    enable_delayed_submission, enable_python_future: bool
        RAPIDS ucxx's capability flags (None: ``$UCXPY_ENABLE_DELAYED_SUBMISSION``
        / ``$UCXPY_ENABLE_PYTHON_FUTURE``). Accepted in every progress mode
        and recorded on the worker; they change nothing here: transfers are
        always posted at once, completions always resolve asyncio futures
        (docs/COMPAT.md).
    connect_timeout: float
        Seconds the connection handshake may take; None:
        ``$UCXPY_CONNECT_TIMEOUT``, else 5.
    spin_us: "auto" or float
        How long an await progresses the worker itself before it suspends
        (microseconds). ``"auto"`` adapts the budget to the traffic: it
        grows while replies arrive shortly after a spin gave up and shrinks
        to 0 while waits are long (capped at 200 us; an idle process does
        not spin). 0 never spins. None: ``$UCXPY_SPIN_US``, else ``"auto"``
        (polling mode: a fixed 100; thread-polling: 0). See docs/ENGINE.md.
    """
    global _ctx
    if _ctx is not None:
        raise RuntimeError(
            "UCX is already initiated. Call reset() and init() "
            "in order to re-initate UCX with new options."
        )
    _ctx = ApplicationContext(
        options,
        env_takes_precedence=env_takes_precedence,
        progress_mode=progress_mode,
        connect_timeout=connect_timeout,
        spin_us=spin_us,
        enable_delayed_submission=enable_delayed_submission,
        enable_python_future=enable_python_future,
    )


def _close_retired() -> None:
    for ctx in list(_retired):
        if ctx.live_objects():
            logger.debug("reset(): %r still has open endpoints/listeners", ctx)
            continue
        _retired.remove(ctx)
        ctx.close()


def reset() -> None:
    """Shut UCX down; the next API call creates a new context.

    If endpoints or listeners of the current context are still open (and
    referenced), raises UCXError naming them. The context is detached all
    the same: the next API call gets a new one, and the old one is closed by
    a later ``reset()`` once those objects are closed or dropped.
    """
    global _ctx
    ctx, _ctx = _ctx, None
    _close_retired()
    if ctx is None:
        return
    alive = ctx.live_objects()
    if alive:
        _retired.append(ctx)
        lines = "".join(f"\n  {o!r}" for o in alive)
        # The error's traceback keeps this frame: not the objects it names.
        alive = ctx = None
        raise UCXError(
            "Trying to reset UCX but not all Endpoints and/or Listeners are "
            "closed(). The following objects are still referencing "
            f"ApplicationContext:{lines}"
        )
    ctx.close()


def stop_notifier_thread() -> None:
    """Compatibility no-op: there is no notifier thread to stop."""
    if _ctx is not None:
        _ctx.stop_notifier_thread()
    else:
        logger.debug("stop_notifier_thread(): UCX is not initialized")


def get_ucx_version() -> tuple[int, int, int]:
    """Version of the UCX library in use, e.g. ``(1, 22, 0)``. Creates no
    context."""
    return _ucxx.get_ucx_version()


def get_config() -> dict:
    """UCX configuration as a dict (names without ``UCX_``): that of the
    current context, or, when there is none, the one a new context would
    get. Creates no context."""
    if _ctx is not None:
        return _ctx.config
    return _ucxx.get_config(effective_options())


def progress() -> int:
    """Progress the worker once (not from inside a UCX callback)."""
    return _get_ctx().worker.progress()


def continuous_ucx_progress(event_loop=None, loop=None):
    """Make sure the worker is progressed by ``event_loop`` (default: the
    running loop, else the current one). Returns the progress task."""
    return _get_ctx().continuous_ucx_progress(loop=loop or event_loop)


def create_listener(
    callback_func, port=None, endpoint_error_handling=True, connect_timeout=None, host=None
) -> Listener:
    return _get_ctx().create_listener(
        callback_func,
        port,
        endpoint_error_handling=endpoint_error_handling,
        connect_timeout=connect_timeout,
        host=host,
    )


async def create_endpoint(
    ip_address, port, endpoint_error_handling=True, connect_timeout=None
) -> Endpoint:
    return await _get_ctx().create_endpoint(
        ip_address,
        port,
        endpoint_error_handling=endpoint_error_handling,
        connect_timeout=connect_timeout,
    )


async def create_endpoint_from_worker_address(address, endpoint_error_handling=True) -> Endpoint:
    return await _get_ctx().create_endpoint_from_worker_address(
        address, endpoint_error_handling=endpoint_error_handling
    )


def register_am_allocator(allocator, allocator_type="host") -> None:
    """Allocate received active messages of ``allocator_type`` ("host" or
    "cuda") with ``allocator(nbytes)`` (it must return a writable buffer, or
    an object with ``__cuda_array_interface__`` for "cuda"). The host default
    is a numpy ``uint8`` array (``numpy.empty(nbytes, dtype=numpy.uint8)``)."""
    types = {"host": _ucxx.MEMORY_TYPE_HOST, "cuda": _ucxx.MEMORY_TYPE_CUDA}
    if allocator_type not in types:
        raise ValueError(
            f"allocator_type must be 'host' or 'cuda', not {allocator_type!r}"
        )
    _get_ctx().worker.register_am_allocator(types[allocator_type], allocator)


def get_worker_address() -> UCXAddress:
    """This process's UCX worker address, a ``bytes`` subclass (give it to
    a peer's ``create_endpoint_from_worker_address``)."""
    return _get_ctx().worker_address


def get_ucx_address_from_buffer(buffer) -> UCXAddress:
    """A worker address from its serialized form (any bytes-like)."""
    return UCXAddress.create_from_buffer(buffer)


async def recv(buffer, tag):
    """Receive on the worker (any sender) into ``buffer`` with exactly
    ``tag``. Returns the number of bytes received."""
    return await _get_ctx().recv(buffer, tag)


def get_ucp_context_info() -> str:
    """``ucp_context_print_info`` of the current context."""
    return _get_ctx().ucp_context_info


def get_ucp_worker_info() -> str:
    """``ucp_worker_print_info`` of the current worker."""
    return _get_ctx().ucp_worker_info


def get_active_transports() -> set:
    """Transports UCX may use in this context (from its info output)."""
    return _transports(get_ucp_context_info())


def get_ucp_worker() -> int:
    """The ``ucp_worker_h`` as an int."""
    return _get_ctx().ucp_worker


def get_ucxx_worker() -> int:
    """The address of the worker object as an int (RAPIDS ucxx: of its
    ``ucxx::Worker``)."""
    return _get_ctx().ucxx_worker


create_listener.__doc__ = ApplicationContext.create_listener.__doc__
create_endpoint.__doc__ = ApplicationContext.create_endpoint.__doc__
create_endpoint_from_worker_address.__doc__ = (
    ApplicationContext.create_endpoint_from_worker_address.__doc__
)
