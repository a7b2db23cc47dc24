"""ucxx: asyncio UCX workers, endpoints, listeners and tagged transfers,
over a C extension (a drop-in for the async API of RAPIDS' ucxx)."""

import os as _os

# 1. Load UCX. The libucx wheel ships the libraries; load them (RTLD_LOCAL)
#    before the extension so that its dependencies resolve to them. Without
#    the wheel a system UCX (UCX_HOME / ld.so paths) must be found instead.
_UCX_SOURCE = None
try:
    import libucx as _libucx
except ImportError:
    _libucx = None
else:
    _loaded = _libucx.load_library()
    if any(lib is not None for lib in _loaded or ()):
        _UCX_SOURCE = "the libucx wheel (" + _os.path.join(
            _os.path.dirname(_libucx.__file__), "lib"
        ) + ")"
    del _loaded

try:
    from . import _ucxx
except ImportError as _e:
    raise ImportError(
        "cannot load the ucxx C extension: "
        f"{_e}. UCX comes from the libucx wheel (pip install libucx-cu12) or "
        "from a system installation found by the dynamic loader."
    ) from _e


def _loaded_ucx_path():
    """Path of the libucp actually mapped into this process, if known."""
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                if "libucp.so" in line:
                    return line.split(None, 5)[-1].strip()
    except OSError:
        pass
    return None


def _check_ucx_version():
    runtime = tuple(_ucxx.get_ucx_version())
    build = tuple(_ucxx.UCX_BUILD_VERSION)
    path = _loaded_ucx_path()
    where_rt = path or _UCX_SOURCE or "a system UCX"
    where_build = "the UCX headers ucxx._ucxx was compiled against (" + _ucxx.__file__ + ")"
    rt_s = "%d.%d.%d" % runtime
    build_s = "%d.%d.%d" % build
    if runtime[0] != build[0] or runtime[1] < build[1]:
        raise ImportError(
            f"UCX version mismatch: UCX {rt_s} was loaded at run time from "
            f"{where_rt}, but ucxx was built with UCX {build_s} from "
            f"{where_build}. The run-time UCX must have the same major "
            "version and at least the same minor version; reinstall ucxx "
            "against the UCX you use, or load the UCX it was built with."
        )
    if runtime < (1, 15, 0):
        raise ImportError(
            f"UCX {rt_s} (loaded from {where_rt}) is too old: ucxx needs UCX 1.15 or newer."
        )
    return rt_s


__ucx_version__ = _check_ucx_version()
__ucx_library__ = _loaded_ucx_path() or _UCX_SOURCE

from . import exceptions, testing, types  # noqa: E402
from .core import *  # noqa: E402,F401,F403
from .core import (  # noqa: E402,F401
    ApplicationContext,
    Endpoint,
    Listener,
    continuous_ucx_progress,
    create_endpoint,
    create_endpoint_from_worker_address,
    create_listener,
    get_active_transports,
    get_config,
    get_ucp_context_info,
    get_ucp_worker,
    get_ucp_worker_info,
    get_ucxx_worker,
    get_ucx_address_from_buffer,
    get_ucx_version,
    get_worker_address,
    init,
    progress,
    recv,
    register_am_allocator,
    reset,
    stop_notifier_thread,
)
from .exceptions import *  # noqa: E402,F401,F403
from .utils import get_address, get_ucxpy_logger  # noqa: E402,F401
from . import utils  # noqa: E402,F401


def _package_version():
    try:
        from importlib.metadata import PackageNotFoundError, version
    except ImportError:  # pragma: no cover
        return "0.0.0"
    try:
        dist_version = version("ucxx")
    except PackageNotFoundError:
        return "0.0.0"
    return dist_version


__version__ = _package_version()

if _os.environ.get("UCXPY_LOG_LEVEL"):
    import logging as _logging

    _logging.getLogger("ucx").setLevel(_os.environ["UCXPY_LOG_LEVEL"].upper())
    del _logging

del _os
