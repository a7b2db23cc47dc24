"""The public module API: names, init/reset, config, versions, info."""

import asyncio
import inspect
import logging

import pytest

import ucxx
import ucxx.core
from ucxx import _ucxx

pytestmark = pytest.mark.leak_check

PUBLIC = [
    "init", "reset", "create_listener", "create_endpoint",
    "create_endpoint_from_worker_address", "get_worker_address",
    "get_ucx_address_from_buffer", "get_config", "get_ucx_version", "progress",
    "continuous_ucx_progress", "recv", "get_ucp_context_info",
    "get_ucp_worker_info", "get_active_transports", "stop_notifier_thread",
    "Endpoint", "Listener", "get_address", "exceptions", "utils", "__version__",
]

EXCEPTIONS = [
    "UCXError", "UCXCanceledError", "UCXCloseError", "UCXConnectionResetError",
    "UCXMessageTruncatedError", "UCXNotConnectedError", "UCXUnreachableError",
    "UCXTimedOutError", "UCXNoMemoryError", "UCXConfigError",
]


@pytest.mark.parametrize("name", PUBLIC)
def test_public_names(name):
    assert hasattr(ucxx, name), name


def test_signatures():
    sig = inspect.signature(ucxx.init)
    for p in ("options", "env_takes_precedence", "progress_mode", "connect_timeout", "spin_us"):
        assert p in sig.parameters
    assert list(inspect.signature(ucxx.create_listener).parameters)[:3] == [
        "callback_func", "port", "endpoint_error_handling"]
    assert list(inspect.signature(ucxx.create_endpoint).parameters)[:3] == [
        "ip_address", "port", "endpoint_error_handling"]
    assert inspect.iscoroutinefunction(ucxx.create_endpoint)
    assert inspect.iscoroutinefunction(ucxx.create_endpoint_from_worker_address)
    assert inspect.iscoroutinefunction(ucxx.recv)


@pytest.mark.parametrize("name", EXCEPTIONS)
def test_exceptions_flat(name):
    cls = getattr(ucxx.exceptions, name)
    assert getattr(ucxx, name) is cls
    assert cls is getattr(_ucxx, name)
    assert issubclass(cls, ucxx.exceptions.UCXError)
    assert issubclass(cls, Exception)
    if cls is not ucxx.exceptions.UCXError:
        assert cls.__bases__ == (ucxx.exceptions.UCXError,)


def test_version():
    assert isinstance(ucxx.__version__, str) and ucxx.__version__
    v = ucxx.get_ucx_version()
    assert isinstance(v, tuple) and len(v) == 3 and v >= (1, 15, 0)
    assert ucxx.__ucx_version__ == "%d.%d.%d" % v


def test_version_check_mismatch(monkeypatch):
    rt = tuple(_ucxx.get_ucx_version())
    monkeypatch.setattr(_ucxx, "UCX_BUILD_VERSION", (rt[0], rt[1] + 1, 0))
    with pytest.raises(ImportError) as ei:
        ucxx._check_ucx_version()
    msg = str(ei.value)
    assert "%d.%d.%d" % rt in msg and "%d.%d.0" % (rt[0], rt[1] + 1) in msg
    assert "run time" in msg and "built" in msg
    monkeypatch.setattr(_ucxx, "UCX_BUILD_VERSION", (rt[0] + 1, 0, 0))
    with pytest.raises(ImportError):
        ucxx._check_ucx_version()
    # Newer minor at run time than at build time is fine.
    monkeypatch.setattr(_ucxx, "UCX_BUILD_VERSION", (rt[0], max(rt[1] - 1, 0), 0))
    ucxx._check_ucx_version()


@pytest.mark.no_ctx
def test_get_config_and_version_create_no_context():
    assert ucxx.core._ctx is None
    cfg = ucxx.get_config()
    assert isinstance(cfg, dict) and "TLS" in cfg
    assert "KEEPALIVE_INTERVAL" in cfg
    ucxx.get_ucx_version()
    assert ucxx.core._ctx is None


@pytest.mark.no_ctx
def test_lazy_context(monkeypatch):
    monkeypatch.delenv("UCXPY_PROGRESS_MODE", raising=False)
    assert ucxx.core._ctx is None
    ctx = ucxx.core._get_ctx()
    assert ucxx.core._ctx is ctx
    assert ucxx.core._get_ctx() is ctx
    assert ctx.progress_mode == "blocking"


@pytest.mark.no_ctx
def test_init_twice_raises():
    ucxx.init()
    with pytest.raises(RuntimeError):
        ucxx.init()


@pytest.mark.no_ctx
def test_init_options():
    ucxx.init(options={"TLS": "tcp", "SEG_SIZE": "16K"})
    cfg = ucxx.get_config()
    assert cfg["TLS"] == "tcp"
    assert ucxx.core._ctx is not None


@pytest.mark.no_ctx
def test_init_env_takes_precedence(monkeypatch):
    monkeypatch.setenv("UCX_SEG_SIZE", "12K")
    ucxx.init(options={"SEG_SIZE": "16K"}, env_takes_precedence=True)
    assert ucxx.get_config()["SEG_SIZE"].lower().startswith("12")
    ucxx.reset()
    ucxx.init(options={"SEG_SIZE": "16K"}, env_takes_precedence=False)
    assert ucxx.get_config()["SEG_SIZE"].lower().startswith("16")


@pytest.mark.no_ctx
def test_default_ucx_options(monkeypatch):
    """docs/DECISIONS.md: UCX keepalive every 1 s, also on tcp (the
    kernel's TCP keepalive off), a 30 s TCP user timeout (which bounds a
    silent peer), 64K tcp send segments, eager messages below 8 MiB
    within a host and 16K shared-memory segments, each unless the caller's
    options or the environment set it; UCX takes them."""
    from ucxx._lib_async.application_context import effective_options

    defaults = {"KEEPALIVE_INTERVAL": "1s", "TCP_KEEPIDLE": "inf", "TCP_USER_TIMEOUT": "30s",
                "TCP_CM_REUSEADDR": "y", "TCP_TX_SEG_SIZE": "64K",
                "RNDV_THRESH": "intra:8m,inter:auto",
                "POSIX_SEG_SIZE": "16K", "SYSV_SEG_SIZE": "16K"}
    for name in defaults:
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    assert effective_options() == defaults
    assert effective_options({"UCX_TCP_USER_TIMEOUT": "auto"})["TCP_USER_TIMEOUT"] == "auto"
    monkeypatch.setenv("UCX_TCP_KEEPIDLE", "10s")
    opts = effective_options()
    assert "TCP_KEEPIDLE" not in opts and opts["TCP_USER_TIMEOUT"] == "30s"
    ucxx.init(options={"TLS": "tcp"})
    assert ucxx.core._ctx.options == {"TLS": "tcp", **opts}
    assert ucxx.get_config()["KEEPALIVE_INTERVAL"].startswith("1000000")
    assert ucxx.get_config()["RNDV_THRESH"].lower() == "intra:8m,inter:auto"
    assert effective_options({"SYSV_SEG_SIZE": "8256"})["SYSV_SEG_SIZE"] == "8256"


@pytest.mark.no_ctx
@pytest.mark.parametrize("where", ["options", "environment"])
def test_shared_memory_segment_defaults_yield_to_mm_seg_size(monkeypatch, where):
    """UCX's POSIX_SEG_SIZE and SYSV_SEG_SIZE inherit MM_SEG_SIZE: where the
    caller sets that, the package's 16K is left out, so the caller's size
    holds for both."""
    from ucxx._lib_async.application_context import effective_options

    for name in ("MM_SEG_SIZE", "POSIX_SEG_SIZE", "SYSV_SEG_SIZE"):
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    options = {}
    if where == "options":
        options["MM_SEG_SIZE"] = "8256"
    else:
        monkeypatch.setenv("UCX_MM_SEG_SIZE", "8256")
    opts = effective_options(options)
    assert "POSIX_SEG_SIZE" not in opts and "SYSV_SEG_SIZE" not in opts
    ucxx.init(options=options)      # UCX takes the inherited name
    ucxx.reset()


@pytest.mark.no_ctx
@pytest.mark.parametrize("where", ["options", "environment"])
def test_tcp_send_segment_default_yields_to_a_receive_segment(monkeypatch, where):
    """The 64K send segment is left to UCX where the caller sets the
    receive segment: a smaller one would make UCX refuse the worker."""
    from ucxx._lib_async.application_context import effective_options

    for name in ("TCP_TX_SEG_SIZE", "TCP_RX_SEG_SIZE"):
        monkeypatch.delenv(f"UCX_{name}", raising=False)
    options = {"TLS": "tcp"}
    if where == "options":
        options["TCP_RX_SEG_SIZE"] = "16K"
    else:
        monkeypatch.setenv("UCX_TCP_RX_SEG_SIZE", "16K")
    assert "TCP_TX_SEG_SIZE" not in effective_options(options)
    ucxx.init(options=options)      # creates the worker
    assert "TCP_TX_SEG_SIZE" not in ucxx.core._ctx.options
    ucxx.reset()
    with pytest.raises(ucxx.UCXError):
        ucxx.init(options={**options, "TCP_TX_SEG_SIZE": "64K"})
    ucxx.reset()


@pytest.mark.no_ctx
def test_default_ucx_options_the_loaded_ucx_lacks_are_left_out(monkeypatch):
    """A default option the loaded UCX does not have (TCP_USER_TIMEOUT is
    new in UCX 1.22) is not passed: UCX would refuse the whole config."""
    from ucxx import _ucxx
    from ucxx._lib_async import application_context as ac

    real = _ucxx.get_config

    def older_ucx(options=None):
        if options and "TCP_USER_TIMEOUT" in options:
            raise ucxx.exceptions.UCXConfigError("no such option")
        return real(options)

    monkeypatch.setattr(_ucxx, "get_config", older_ucx)
    monkeypatch.delenv("UCX_TCP_USER_TIMEOUT", raising=False)
    ac._known_options.cache_clear()
    try:
        opts = ac.effective_options()
        assert "TCP_USER_TIMEOUT" not in opts and "KEEPALIVE_INTERVAL" in opts
        # without a user timeout, UCX's keepalive messages to a silent host
        # would be retransmitted for minutes: the kernel's keepalive instead
        assert {k: opts[k] for k in ac.KERNEL_KEEPALIVE_OPTIONS} == ac.KERNEL_KEEPALIVE_OPTIONS
    finally:
        ac._known_options.cache_clear()


@pytest.mark.no_ctx
def test_init_unknown_option():
    with pytest.raises(ucxx.UCXConfigError) as ei:
        ucxx.init(options={"NO_SUCH_OPTION_XYZ": "1"})
    assert "NO_SUCH_OPTION_XYZ" in str(ei.value)
    assert ucxx.core._ctx is None


@pytest.mark.no_ctx
def test_init_bad_progress_mode():
    with pytest.raises(ValueError, match="bogus-mode"):
        ucxx.init(progress_mode="bogus-mode")
    assert ucxx.core._ctx is None


@pytest.mark.no_ctx
def test_progress_mode_from_env(monkeypatch):
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "polling")
    ucxx.init()
    assert ucxx.core._ctx.progress_mode == "polling"
    ucxx.reset()
    monkeypatch.setenv("UCXPY_PROGRESS_MODE", "nonsense")
    with pytest.raises(ValueError, match="nonsense"):
        ucxx.init()
    with pytest.raises(ValueError, match="nonsense"):
        ucxx.core._get_ctx()


@pytest.mark.no_ctx
def test_spin_us(monkeypatch):
    monkeypatch.delenv("UCXPY_SPIN_US", raising=False)
    monkeypatch.delenv("UCXPY_PROGRESS_MODE", raising=False)  # spin: not for thread modes
    ucxx.init(spin_us=0)
    assert ucxx.core._ctx.worker.spin_us == 0
    ucxx.reset()
    monkeypatch.setenv("UCXPY_SPIN_US", "7")
    ucxx.init()
    assert ucxx.core._ctx.worker.spin_us == 7
    ucxx.reset()
    with pytest.raises(ValueError, match="-3"):
        ucxx.init(spin_us=-3)


@pytest.mark.no_ctx
def test_connect_timeout(monkeypatch):
    monkeypatch.delenv("UCXPY_CONNECT_TIMEOUT", raising=False)
    ucxx.init()
    assert ucxx.core._ctx.connect_timeout == 5.0
    ucxx.reset()
    ucxx.init(connect_timeout=2.5)
    assert ucxx.core._ctx.connect_timeout == 2.5
    ucxx.reset()
    with pytest.raises(ValueError, match="abc"):
        ucxx.init(connect_timeout="abc")


@pytest.mark.no_ctx
def test_reset_without_context_is_noop():
    ucxx.reset()
    ucxx.reset()
    assert ucxx.core._ctx is None


@pytest.mark.no_ctx
def test_reset_then_new_context():
    ctx1 = ucxx.core._get_ctx()
    ucxx.reset()
    assert ucxx.core._ctx is None
    ctx2 = ucxx.core._get_ctx()
    assert ctx2 is not ctx1
    assert ctx1.worker.closed and ctx1.context.closed


def test_info_and_transports():
    info = ucxx.get_ucp_context_info()
    assert isinstance(info, str) and info
    assert isinstance(ucxx.get_ucp_worker_info(), str)
    tls = ucxx.get_active_transports()
    assert isinstance(tls, set)
    assert "tcp" in tls or tls & {"posix", "sysv", "cma", "self"}


def test_worker_address_roundtrip():
    addr = ucxx.get_worker_address()
    assert isinstance(addr, (bytes, bytearray)) and len(addr) > 0
    assert ucxx.get_ucx_address_from_buffer(bytearray(addr)) == bytes(addr)


def test_progress_and_notifier():
    assert isinstance(ucxx.progress(), int)
    ucxx.stop_notifier_thread()
    ucxx.stop_notifier_thread()


@pytest.mark.no_ctx
def test_stop_notifier_thread_without_context():
    ucxx.stop_notifier_thread()
    assert ucxx.core._ctx is None


async def test_continuous_ucx_progress_idempotent():
    loop = asyncio.get_running_loop()
    t1 = ucxx.continuous_ucx_progress()
    t2 = ucxx.continuous_ucx_progress(loop=loop)
    assert t1 is t2
    assert not t1.done()


def test_get_address():
    assert ucxx.get_address(ifname="lo") == "127.0.0.1"
    addr = ucxx.get_address()
    assert isinstance(addr, str) and addr.count(".") == 3
    with pytest.raises(OSError, match="no-such-if0"):
        ucxx.get_address(ifname="no-such-if0")


def test_get_address_loopback_only(monkeypatch):
    import ucxx.utils as u

    monkeypatch.delenv("UCXPY_IFNAME", raising=False)
    monkeypatch.setattr(u, "_interfaces", lambda: ["lo"])
    assert u.get_address() == "127.0.0.1"


def test_get_address_env(monkeypatch):
    monkeypatch.setenv("UCXPY_IFNAME", "lo")
    assert ucxx.get_address() == "127.0.0.1"


def test_no_handler_installed_at_import():
    # Records reach the application's handlers (and caplog).
    assert logging.getLogger("ucx").propagate
